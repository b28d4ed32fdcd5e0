#!/usr/bin/env python3
"""The trainer against a plain PyTorch loop, in one run: images/s and peak memory.

The yardstick is the loop anyone would write for speed: the same torchvision model and batch,
bf16 autocast, channels_last for CNNs, SGD with momentum, the batch already in GPU memory, no
checkpoints, logging or validation. Our trainer runs `dlenv.train.train()` on `--synthetic` data
(also already on the GPU) with the options of each configuration. Each side runs warm-up steps
first; the trainer's second epoch is the timed one (its first is the warm-up), and peak memory is
measured over the timed steps only.

    python3 scripts/bench_train.py                      # ResNet-50 b256 and ViT-B/16 b128, 224 px
    python3 scripts/bench_train.py --steps 20 --only resnet50
    PYTHONPATH=/old/checkout/src python3 scripts/bench_train.py --no-yardstick   # another tree's trainer

Writes bench_train.csv and bench_train.md to --out, and checks the targets of docs/training.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this checkout's dlenv, unless PYTHONPATH names a source tree (scripts/bench_parity.py compares two)
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

#: (model, batch, [(label, trainer options)]). Besides TrainConfig's options: "tf32" (False: strict
#: FP32), "long" (plan a run long enough for --compile auto to compile, time its second epoch, then
#: stop it as Ctrl-C would) and "cap_gib" (the card made this small with
#: torch.cuda.set_per_process_memory_fraction: where --checkpoint-ratio auto needs most blocks).
#: Short runs plan too few steps for --compile auto: their rows are eager unless --compile on.
ALL = {"checkpoint_ratio": 1.0}
CONFIGS = [
    ("resnet50", 256, [("fp32", {}), ("fp32, TF32 off", {"tf32": False}), ("--amp", {"amp": True}),
                       ("--amp, a long run: --compile auto compiles", {"amp": True, "long": True}),
                       ("--amp --checkpoint --checkpoint-ratio 1", {"amp": True, "checkpoint": True, **ALL}),
                       ("--amp --checkpoint (ratio auto)", {"amp": True, "checkpoint": True}),
                       ("--amp --checkpoint (ratio auto, card capped at 7 GiB)",
                        {"amp": True, "checkpoint": True, "cap_gib": 7.0}),
                       ("--amp --checkpoint (ratio auto, card capped at 9 GiB)",
                        {"amp": True, "checkpoint": True, "cap_gib": 9.0}),
                       ("--amp --compile", {"amp": True, "compile": "on"}),
                       ("--amp --checkpoint --checkpoint-ratio 1 --compile",
                        {"amp": True, "checkpoint": True, "compile": "on", **ALL})]),
    ("vit_b_16", 128, [("fp32", {}), ("--amp", {"amp": True}),
                       ("--amp --checkpoint --checkpoint-ratio 1", {"amp": True, "checkpoint": True, **ALL})]),
]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class _Recompute(nn.Module):
    """A block under torch.utils.checkpoint, as a plain loop would wrap it."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def _checkpoint_blocks(model: nn.Module) -> None:
    """Every ResNet bottleneck / ViT encoder block recomputed in backward."""
    import torchvision

    kinds = (torchvision.models.resnet.Bottleneck, torchvision.models.resnet.BasicBlock,
             torchvision.models.vision_transformer.EncoderBlock)
    found = [(parent, key, child) for parent in model.modules() for key, child in parent.named_children()
             if isinstance(child, kinds)]  # all first: wrapping while walking would walk into the wrappers
    for parent, key, child in found:
        setattr(parent, key, _Recompute(child))


def yardstick(name: str, batch: int, img: int, steps: int, warmup: int,
              checkpoint: bool = False) -> tuple[float, float]:
    """A plain bf16 + channels_last loop on GPU-resident data (every block checkpointed if asked):
    (images/s, peak allocated GiB)."""
    import torchvision

    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    model = torchvision.models.get_model(name, weights=None, num_classes=1000)
    if checkpoint:
        _checkpoint_blocks(model)
    conv = not name.startswith(("vit", "swin"))
    fmt = torch.channels_last if conv else torch.contiguous_format
    model = model.to(dev, memory_format=fmt).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    x = torch.randn(batch, 3, img, img, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30
    return batch * steps / secs, peak


def ours(name: str, batch: int, img: int, steps: int, options: dict,
         device: str = "cuda") -> tuple[float, float, float, str]:
    """dlenv's trainer on --synthetic data: (images/s, peak allocated GiB) of its second epoch, the
    seconds it compiled, and what config.yaml says its auto options chose."""
    import signal

    from dlenv.options import config
    from dlenv.options.config import TrainConfig
    try:
        from dlenv.runfolder import results
        from dlenv.runfolder.trainstate import read_config_notes
    except ImportError:  # a tree before the run folder's modules moved (fc13297), as bench_parity.py runs it
        from dlenv import results
        from dlenv.train.state import read_config_notes
    from dlenv.train import train
    from dlenv.train.auto import COMPILE_MIN_BATCHES

    options = dict(options)
    long = options.pop("long", False)
    cap = options.pop("cap_gib", None)
    epochs, on_step = 2, None
    if long:  # plan enough steps for --compile auto; after epoch 2's last step, stop as Ctrl-C does
        epochs = -(-COMPILE_MIN_BATCHES // steps) + 2

        def on_step(state):
            if state.step == 2 * steps:
                os.kill(os.getpid(), signal.SIGINT)
    if cap is not None:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    # PyTorch runs FP32 convolutions in TF32 on Ampere and later by default (cudnn.allow_tf32); the
    # "TF32 off" row is strict FP32, the baseline that "FP32" meant before TF32 existed
    tf32 = options.pop("tf32", True)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32 and saved[0]
    torch.backends.cuda.matmul.allow_tf32 = tf32 and saved[1]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config.build(TrainConfig, synthetic=True, model=name, batch_size=batch, img_size=img,
                               epochs=epochs, max_steps=steps, device=device, project=tmp, workers=0, **options)
            out = train(cfg, on_step=on_step)
            run = Path(out["run_dir"])
            row = results.read_results(run / "results.csv").iloc[-1]
            said = read_config_notes(run / "config.yaml")  # what the auto options chose, and why
            chose = f"compile: {said.get('compile_rule')}" + (f"; checkpoint: {said['checkpoint_rule']}"
                                                                 if said.get("checkpoint_rule") else "")
            return float(row["img_per_s"]), float(row["mem_alloc_gib"]), float(out.get("compile_s") or 0.0), chose
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        if cap is not None and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration (and as many warm-up)")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--only", default=None, help="one model of the table (resnet50 or vit_b_16)")
    ap.add_argument("--out", default="runs/bench-train", help="folder for bench_train.csv / .md")
    ap.add_argument("--optimizer", default="auto", choices=("auto", "sgd", "adamw"),
                    help="the trainer's optimizer (auto: as users get it; sgd: the yardstick's)")
    ap.add_argument("--config", action="append", dest="configs", metavar="LABEL",
                    help="run only this configuration of the table (repeatable), e.g. --config=--amp")
    ap.add_argument("--no-yardstick", action="store_true", help="the trainer only (no plain loop to compare)")
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself (with --no-yardstick)")
    args = ap.parse_args()
    labels = {label for name, _, variants in CONFIGS for label, _ in variants if not args.only or name == args.only}
    unknown = sorted(set(args.configs or ()) - labels)
    if unknown:  # a row asked for and never run must not pass as "no difference"
        print(f"bench_train: no configuration {', '.join(map(repr, unknown))}; the table has "
              f"{', '.join(map(repr, sorted(labels)))}")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_train: needs a CUDA GPU")
        return 2
    rows = []
    for name, batch, variants in CONFIGS:
        if args.only and name != args.only:
            continue
        base = None
        if not args.no_yardstick:
            for label, ckpt in (("yardstick (plain loop, bf16)", False),
                                ("yardstick + checkpointing every block", True)):
                _free()
                ips, peak = yardstick(name, batch, args.img_size, args.steps, warmup=max(5, args.steps // 3),
                                      checkpoint=ckpt)
                rows.append({"model": name, "batch": batch, "config": label, "img_per_s": ips, "peak_gib": peak})
                print(f"row: {label}: {ips:,.0f} img/s, {peak:.2f} GiB", flush=True)
                base = base or ips
        fp32_ips = fp32_peak = strict_ips = None
        for label, options in variants:
            if args.configs and label not in args.configs:
                continue
            _free()
            ips, peak, compile_s, chose = ours(name, batch, args.img_size, args.steps,
                                               {**options, "optimizer": args.optimizer}, args.device)
            if label == "fp32":
                fp32_ips, fp32_peak = ips, peak
            if label == "fp32, TF32 off":
                strict_ips = ips
            rows.append({"model": name, "batch": batch, "config": f"dlenv {label}", "img_per_s": ips,
                         "peak_gib": peak, "compile_s": compile_s, "chose": chose})
            print(f"row: {label}: {ips:,.0f} img/s, {peak:.2f} GiB, compile {compile_s:.0f} s; {chose}", flush=True)
        for r in rows:
            if r["model"] == name:
                r["x_yardstick"] = r["img_per_s"] / base if base else None
                r["x_fp32_speed"] = r["img_per_s"] / fp32_ips if fp32_ips else None
                r["x_strict_fp32_speed"] = r["img_per_s"] / strict_ips if strict_ips else None
                r["x_fp32_peak"] = r["peak_gib"] / fp32_peak if fp32_peak else None
    import pandas as pd

    df = pd.DataFrame(rows)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    head = (f"{gpu}, PyTorch {torch.__version__}, CUDA {torch.version.cuda}, {args.img_size} px, "
            f"{args.steps} timed steps, trainer optimizer {args.optimizer}")
    checks = _checks(df)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "bench_train.csv", index=False)
    md = _markdown(df, head, checks)
    (out / "bench_train.md").write_text(md, encoding="utf-8")
    print(md)
    return 0 if all(ok for _, ok in checks) else 1


def _get(df, model: str, config: str, col: str):
    sel = df[(df["model"] == model) & (df["config"] == config)]
    if not len(sel) or col not in sel or sel[col].iloc[0] is None:
        return None
    value = float(sel[col].iloc[0])
    return None if value != value else value  # NaN: not measured in this run


def _checks(df) -> list[tuple[str, bool]]:
    """The targets: --amp >= 0.95x the yardstick; --amp --checkpoint <= 25% of FP32's peak at >= 1.4x its
    speed (ResNet-50); ViT-B/16 --amp --checkpoint <= 20% of FP32's peak."""
    out = []
    r = _get(df, "resnet50", "dlenv --amp", "x_yardstick")
    if r is not None:
        out.append((f"ResNet-50 --amp at {r:.2f}x the yardstick (>= 0.95)", r >= 0.95))
    full = "dlenv --amp --checkpoint --checkpoint-ratio 1"
    p = _get(df, "resnet50", full, "x_fp32_peak")
    s = _get(df, "resnet50", full, "x_fp32_speed")
    strict = _get(df, "resnet50", full, "x_strict_fp32_speed")
    if p is not None:
        out.append((f"ResNet-50 --amp --checkpoint peak {p:.0%} of FP32's (<= 25%)", p <= 0.25))
    if s is not None:
        out.append((f"ResNet-50 --amp --checkpoint at {s:.2f}x FP32's speed, FP32 with PyTorch's default "
                    f"TF32 convolutions (>= 1.4)", s >= 1.4))
    if strict is not None:
        out.append((f"ResNet-50 --amp --checkpoint at {strict:.2f}x strict FP32's speed (TF32 off) (>= 1.4)",
                    strict >= 1.4))
    v = _get(df, "vit_b_16", full, "x_fp32_peak")
    if v is not None:
        out.append((f"ViT-B/16 --amp --checkpoint peak {v:.0%} of FP32's (<= 20%)", v <= 0.20))
    r = _get(df, "resnet50", "dlenv --amp, a long run: --compile auto compiles", "x_yardstick")
    if r is not None:
        out.append((f"ResNet-50 default --amp, long run, at {r:.2f}x the eager plain loop (>= 1.35)", r >= 1.35))
    amp = _get(df, "resnet50", "dlenv --amp", "img_per_s")
    a = _get(df, "resnet50", "dlenv --amp --checkpoint (ratio auto)", "img_per_s")
    if amp and a:
        out.append((f"ResNet-50 --amp --checkpoint (ratio auto, fits) at {a / amp:.2f}x --amp (>= 0.97)",
                    a / amp >= 0.97))
    plain = _get(df, "resnet50", "yardstick + checkpointing every block", "img_per_s")
    for label in (full, "dlenv --amp --checkpoint (ratio auto, card capped at 7 GiB)"):
        c = _get(df, "resnet50", label, "img_per_s")
        if plain and c:
            out.append((f"ResNet-50 {label.removeprefix('dlenv ')} at {c / plain:.2f}x the plain loop's full "
                        "checkpointing (>= 0.95)", c / plain >= 0.95))
    return out


def _markdown(df, head: str, checks: list[tuple[str, bool]]) -> str:
    lines = [f"Measured on {head}.", "",
             "| model | batch | configuration | img/s | peak allocated GiB | x yardstick | peak / FP32 | compile s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    chose = []
    for r in df.to_dict("records"):
        fp, xy, cs = r.get("x_fp32_peak"), r.get("x_yardstick"), r.get("compile_s")
        lines.append(f"| {r['model']} | {r['batch']} | {r['config']} | {r['img_per_s']:,.0f} | "
                     f"{r['peak_gib']:.2f} | {'' if xy is None or xy != xy else f'{xy:.2f}'} | "
                     f"{'' if fp is None or fp != fp else f'{fp:.0%}'} | "
                     f"{'' if not cs or cs != cs else f'{cs:.0f}'} |")
        if isinstance(r.get("chose"), str):
            chose.append(f"- {r['model']} {r['config']}: {r['chose']}")
    lines += ["", "What the auto options chose (config.yaml):", *chose, ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in checks]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
