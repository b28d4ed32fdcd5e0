"""Yardstick for bench-memory: the same configurations measured by a plain PyTorch loop.

For each configuration (FP32, AMP, checkpointing, AMP + checkpointing; --channels-last for conv
nets) this runs dlenv's bench-memory worker and then a plain loop written here with nothing but
torch and torchvision (torch.autocast, GradScaler, torch.utils.checkpoint around each repeated
block), each in a fresh process, from the same seeded weights on the same seeded batch. It prints
both side by side: peak allocated and reserved memory, images/s and the loss, and whether
bench-memory's memory numbers are within 5% of the yardstick's.

    python3 scripts/bench_memory_yardstick.py --model resnet50 --batch-size 256
    python3 scripts/bench_memory_yardstick.py --model vit_b_16 --batch-size 128

Needs a CUDA GPU (memory numbers). dlenv need not be installed: src/ is put on the path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

CONFIGS = {  # key: (amp, checkpoint, channels_last)
    "fp32": (False, False, False), "amp": (True, False, False), "ckpt": (False, True, False),
    "amp_ckpt": (True, True, False),
    "fp32_cl": (False, False, True), "amp_cl": (True, False, True), "ckpt_cl": (False, True, True),
    "amp_ckpt_cl": (True, True, True),
}
# The repeated blocks dlenv checkpoints in these families (one torch.utils.checkpoint per block).
BLOCKS = ("BasicBlock", "Bottleneck", "EncoderBlock", "CNBlock", "InvertedResidual", "MBConv",
          "FusedMBConv", "SwinTransformerBlock", "SwinTransformerBlockV2", "ResBottleneckBlock")


def plain_loop(a: argparse.Namespace) -> dict:
    """The yardstick: a textbook training loop, written without dlenv."""
    import torch
    import torch.nn.functional as F
    import torchvision
    from torch.utils.checkpoint import checkpoint

    amp, ckpt, cl = CONFIGS[a.one]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torchvision.models.get_model(a.model, weights=None, num_classes=1000)

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    if ckpt:
        def wrap(parent):
            for name, child in parent.named_children():
                if type(child).__name__ in BLOCKS:
                    setattr(parent, name, Checkpointed(child))
                else:
                    wrap(child)
        wrap(model)
    fmt = torch.channels_last if cl else torch.contiguous_format
    model = model.to(dev, memory_format=fmt).train()
    torch.backends.cudnn.benchmark = True
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.precision) if amp else None
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(a.batch_size, 3, a.img_size, a.img_size, generator=gen)
    y = torch.randint(0, 1000, (a.batch_size,), generator=gen)
    x, y = x.to(dev).contiguous(memory_format=fmt), y.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gib = 1024 ** 3
    return dict(peak_alloc_gib=torch.cuda.max_memory_allocated() / gib,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / gib,
                img_per_s=a.batch_size * a.steps / seconds, loss_last=float(loss))


def _diff(ours, theirs) -> str:
    if ours is None or not theirs:
        return "—"
    return f"{(ours / theirs - 1) * 100:+.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--amp-dtype", default="auto", choices=("auto", "fp16", "bf16"))
    p.add_argument("--configs", default="fp32,amp,ckpt,amp_ckpt",
                   help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--one", help=argparse.SUPPRESS)        # inside a yardstick worker
    p.add_argument("--precision", help=argparse.SUPPRESS)  # the AMP dtype bench-memory resolved
    a = p.parse_args()
    if a.one:
        print(json.dumps(plain_loop(a)))
        return 0

    from dlenv.bench import memory as bench

    keys = [k for k in a.configs.split(",") if k]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    rows, info = [], {}
    for key in keys:
        amp, ckpt, cl = CONFIGS[key]
        spec = dict(mode="measure", model=a.model, batch_size=a.batch_size, img_size=a.img_size,
                    warmup=a.warmup, steps=a.steps, amp_dtype=a.amp_dtype, device="cuda", amp=amp,
                    checkpoint=ckpt, channels_last=cl)
        print(f"[{key}] bench-memory ...", file=sys.stderr, flush=True)
        ours = bench.run_worker(spec)
        info = info or ours
        print(f"[{key}] plain loop ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--one", key, "--model", a.model, "--batch-size", str(a.batch_size),
               "--img-size", str(a.img_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--precision", ours.get("precision") or "fp32"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            theirs = {"status": "oom" if "out of memory" in proc.stderr else "error", "error": last}
        else:
            theirs = dict(json.loads(proc.stdout.strip().splitlines()[-1]), status="ok")
        rows.append((key, ours, theirs))

    print(f"\n{a.model}, batch {a.batch_size}, {a.img_size} px, {a.warmup}+{a.steps} steps on "
          f"{info.get('gpu', '?')}; PyTorch {info.get('torch')}, CUDA {info.get('cuda')}\n")
    print("| Configuration | alloc GiB dlenv | alloc GiB plain | diff | reserved GiB dlenv | reserved GiB plain "
          "| diff | img/s dlenv | img/s plain | loss dlenv | loss plain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for key, ours, theirs in rows:
        if ours.get("status") != "ok" or theirs.get("status") != "ok":
            print(f"| {key} | {ours.get('status')} | {theirs.get('status')} | | | | | | | | |")
            continue
        for m in ("peak_alloc_gib", "peak_reserved_gib"):
            worst = max(worst, abs(ours[m] / theirs[m] - 1))
        print(f"| {key} ({ours.get('precision')}) | {ours['peak_alloc_gib']:.2f} | {theirs['peak_alloc_gib']:.2f} | "
              f"{_diff(ours['peak_alloc_gib'], theirs['peak_alloc_gib'])} | {ours['peak_reserved_gib']:.2f} | "
              f"{theirs['peak_reserved_gib']:.2f} | {_diff(ours['peak_reserved_gib'], theirs['peak_reserved_gib'])} | "
              f"{ours['img_per_s']:.0f} | {theirs['img_per_s']:.0f} | {ours['loss_last']:.4f} | "
              f"{theirs['loss_last']:.4f} |")
    verdict = "PASS" if worst <= 0.05 else "FAIL"
    print(f"\nlargest memory difference {worst * 100:.1f}% (target: within 5%): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
