#!/usr/bin/env python3
"""A small dataset end to end: `dlenv train` against timm's train.py, same model and settings, same call.

scikit-learn's digits (1,797 images of 8x8, drawn at 32x32 as PNGs, split 80/20 into train/ and val/
folders) trained with ResNet-18, batch 32, AMP, 15 epochs, by each tool as a user runs it: a fresh
process, its own defaults for everything else. Reports each one's wall time (process start to exit),
when its first line and its first training progress came, and its final and best validation top-1.

    python3 scripts/bench_small_data.py --make-digits /tmp/digits      # needs scikit-learn, here
    python3 scripts/bench_small_data.py --data /tmp/digits --timm-train /path/to/timm/train.py --out /tmp/o

timm's train.py is not in the timm wheel: give the one of the installed timm's version (the
pytorch-image-models repository at that tag). Writes bench_small_data.md and .csv to --out.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_digits(root: Path, size: int = 32, val_share: float = 0.2, seed: int = 0) -> Path:
    """root/train/<digit>/*.png and root/val/<digit>/*.png: every one of the 1,797 digits, 80/20."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_val = round(len(order) * val_share)
    for rank, i in enumerate(order):
        split = "val" if rank < n_val else "train"
        folder = root / split / str(int(digits.target[i]))
        folder.mkdir(parents=True, exist_ok=True)
        grey = (digits.images[i] * (255 / 16)).astype(np.uint8)
        Image.fromarray(grey).resize((size, size), Image.BILINEAR).convert("RGB").save(folder / f"{i:04d}.png")
    return root


def timed(cmd: list[str], env: dict, log: Path, progress_marker: str) -> dict:
    """Run `cmd`; wall seconds, seconds to its first output line and to the first line with the marker."""
    t0 = time.perf_counter()
    first = progress = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                bufsize=1)
        for line in proc.stdout:
            now = time.perf_counter() - t0
            out.write(f"{now:8.2f} {line}")
            if first is None and line.strip():
                first = now
            if progress is None and progress_marker in line:
                progress = now
        rc = proc.wait()
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "first_line_s": first, "first_progress_s": progress}


def dlenv_top1(run_dir: Path) -> tuple[float, float]:
    with open(run_dir / "results.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("top1")]
    tops = [float(r["top1"]) for r in rows]
    return tops[-1], max(tops)


def timm_top1(out: Path) -> tuple[float, float]:
    summary = next(out.rglob("summary.csv"))
    with open(summary, newline="") as f:
        tops = [float(r["eval_top1"]) for r in csv.DictReader(f)]
    return tops[-1], max(tops)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-digits", type=Path, help="write the digits folder here and stop")
    p.add_argument("--data", type=Path, help="a folder with train/ and val/ class folders")
    p.add_argument("--timm-train", type=Path, help="timm's train.py (skipped when not given)")
    p.add_argument("--out", type=Path, default=Path("bench-small-data"))
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--runs", type=int, default=1, help="runs of each tool, alternating")
    p.add_argument("--dlenv-args", default="", help="extra `dlenv train` flags, space-separated")
    p.add_argument("--timm-config", action="append", default=[], metavar="LABEL=FLAGS",
                   help="a timm train.py row with these extra flags (repeatable); none: one row of its defaults. "
                        "dlenv's recipe for timm: 'recipe=--opt adamw --lr 1e-3 --weight-decay 0.05 --sched cosine "
                        "--warmup-epochs 1 --amp-dtype bfloat16 --channels-last'")
    a = p.parse_args(argv)
    if a.make_digits:
        make_digits(a.make_digits)
        print(f"digits written to {a.make_digits}")
        return 0
    if not a.data:
        p.error("--data is required (or --make-digits)")
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    rows = []
    for run in range(a.runs):
        name = f"dlenv{run}"
        cmd = [sys.executable, "-m", "dlenv", "train", "--data", str(a.data), "--model", a.model, "--batch-size",
               str(a.batch_size), "--amp", "--epochs", str(a.epochs), "--project", str(a.out / "dlenv"),
               "--name", name, *a.dlenv_args.split()]
        r = timed(cmd, env, a.out / f"{name}.log", "epoch 1/")
        last, best = dlenv_top1(a.out / "dlenv" / name) if r["rc"] == 0 else (float("nan"),) * 2
        rows.append({"tool": "dlenv", **r, "top1_last": last, "top1_best": best})
        print(rows[-1], flush=True)
        for label, flags in (c.partition("=")[::2] for c in (a.timm_config or ["defaults="])) if a.timm_train else ():
            name = f"timm-{label}{run}"
            out = a.out / name
            cmd = [sys.executable, str(a.timm_train), "--data-dir", str(a.data), "--train-split", "train",
                   "--val-split", "val", "--model", a.model, "--num-classes", "10", "-b", str(a.batch_size),
                   "--amp", "--epochs", str(a.epochs), "--output", str(out), *flags.split()]
            r = timed(cmd, env, a.out / f"{name}.log", "Train: 0 [")
            last, best = timm_top1(out) if r["rc"] == 0 else (float("nan"),) * 2
            rows.append({"tool": f"timm train.py ({label}{': ' + flags if flags else ''})", **r, "top1_last": last,
                         "top1_best": best})
            print(rows[-1], flush=True)
    import torch

    info = (f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, PyTorch {torch.__version__}, "
            f"{len(os.sched_getaffinity(0))} CPUs; {a.data}: {a.model}, batch {a.batch_size}, AMP, {a.epochs} epochs")
    md = [info, "", "| tool | wall s | first line s | first progress s | top-1 last | top-1 best |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        md.append(f"| {r['tool']} | {r['wall_s']:.1f} | {fmt(r['first_line_s'])} | {fmt(r['first_progress_s'])} "
                  f"| {r['top1_last']:.1f} | {r['top1_best']:.1f} |")
    (a.out / "bench_small_data.md").write_text("\n".join(md) + "\n")
    with open(a.out / "bench_small_data.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n".join(md))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
