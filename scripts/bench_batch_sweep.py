"""Training speed against batch size on one GPU: where does img/s stop rising? (issue 46, --batch-size auto)

For each model, batches double from --start until a step runs out of memory; each batch runs real
training steps (AdamW, bf16 autocast, channels-last for convolutional models) twice: with cuDNN
autotuning on (as the trainer trains) and off (as dlenv's batch probe measures). It prints img/s,
peak memory and the ratio to the best, so one sees whether the probe's timings rank batches as
training does, and where the largest batch that fits stands.

    python3 scripts/bench_batch_sweep.py --models resnet50,vit_b_16 --img-size 224

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def speed(model, batch: int, size: int, cl: bool, autotune: bool, steps: int) -> tuple[float, float] | None:
    import torch

    torch.backends.cudnn.benchmark = autotune
    fmt = torch.channels_last if cl else torch.contiguous_format
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        x = torch.randn(batch, 3, size, size, device="cuda").contiguous(memory_format=fmt)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps + 2):
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        t = sorted(times[2:])[len(times[2:]) // 2]
        return batch / t, torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del opt
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def main() -> int:
    import torch
    import torchvision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,vit_b_16")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=8192)
    a = ap.parse_args()
    print(f"GPU {torch.cuda.get_device_name(0)}, PyTorch {torch.__version__}, {a.img_size} px, bf16, AdamW")
    for name in a.models.split(","):
        cl = not name.startswith("vit")
        model = getattr(torchvision.models, name)(num_classes=1000).cuda()
        if cl:
            model = model.to(memory_format=torch.channels_last)
        rows = []
        b = a.start
        while b <= a.max_batch:
            on = speed(model, b, a.img_size, cl, True, a.steps)
            if on is None:
                rows.append((b, None, None, None))
                break
            off = speed(model, b, a.img_size, cl, False, a.steps)
            rows.append((b, on[0], off[0] if off else None, on[1]))
            print(f"  {name} batch {b}: {on[0]:.0f} img/s autotuned, {off[0] if off else 0:.0f} probe-style, "
                  f"{on[1]:.1f} GiB", flush=True)
            b *= 2
        best = max(r[1] for r in rows if r[1])
        print(f"\n| {name} batch | img/s (autotuned) | x best | img/s (autotune off) | peak GiB |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for b, on, off, peak in rows:
            if on is None:
                print(f"| {b} | out of memory | | | |")
            else:
                print(f"| {b} | {on:,.0f} | {on / best:.2f} | {off or 0:,.0f} | {peak:.1f} |")
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
