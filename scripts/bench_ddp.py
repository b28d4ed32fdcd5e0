#!/usr/bin/env python3
"""Two GPUs against one through `dlenv train --gpus N`: images/s scaling and demo-data accuracy.

1. Speed: ResNet-50 `--amp` on `--synthetic` data (already on the GPU) at the same per-GPU batch,
   `--gpus 1` vs `--gpus 2`. The trainer's second epoch is the timed one (the first warms up cuDNN
   autotuning, the allocator and NCCL); images/s over all GPUs comes from results.csv.
   Target: 2 GPUs >= 1.85x one GPU.
2. Accuracy: ResNet-18 `--amp` on the built-in demo data for a few epochs at the same effective
   batch (1 x B vs 2 x B/2, so the same learning rate), a few seeds each; final val top-1 of each.
   Target: the 2-GPU mean within noise of the 1-GPU mean (3 standard errors of the difference, from
   the seeds' spread and the val set's size, whichever is larger).

Every run is the real command line (torchrun launch included), run as a subprocess:

    python3 scripts/bench_ddp.py --out $OUT/bench-ddp
    python3 scripts/bench_ddp.py --steps 100 --batch 256 --seeds 3

Writes bench_ddp.csv, bench_ddp.md and each run's log to --out; exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

SPEEDUP_TARGET = 1.85


def _env() -> dict[str, str]:
    """The environment of each run: dlenv importable from this checkout (it is not installed there)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def run_train(label: str, options: list[str], out: Path, timeout: int) -> tuple[dict, float]:
    """`python -m dlenv train <options>` into out/runs/<label>; (last results.csv row, wall seconds)."""
    from dlenv.runfolder import results

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dlenv", "train", *options, "--project", str(out / "runs"), "--name", label,
           "--exist-ok"]
    t0 = time.perf_counter()
    with open(logs / f"{label}.log", "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=timeout, cwd=out)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        tail = (logs / f"{label}.log").read_text(encoding="utf-8").splitlines()[-15:]
        raise RuntimeError(f"{label} failed (exit {p.returncode}):\n" + "\n".join(tail))
    df = results.read_results(out / "runs" / label / "results.csv")
    return df.iloc[-1].to_dict(), wall


def speed(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for gpus in (1, 2):
        opts = ["--synthetic", "--model", args.model, "--amp", "--batch-size", str(args.batch),
                "--img-size", str(args.img_size), "--epochs", "2", "--max-steps", str(args.steps),
                "--gpus", str(gpus), "--device", "cuda", "--workers", "0"]
        row, wall = run_train(f"speed-{args.model}-{gpus}gpu", opts, out, args.timeout)
        rows.append({"part": "speed", "model": args.model, "gpus": gpus, "batch_per_gpu": args.batch,
                     "img_per_s": row["img_per_s"], "mem_alloc_gib": row["mem_alloc_gib"], "wall_s": wall})
    rows[1]["speedup"] = rows[1]["img_per_s"] / rows[0]["img_per_s"]
    rows[1]["efficiency"] = rows[1]["speedup"] / 2
    return rows


def accuracy(args: argparse.Namespace, out: Path) -> list[dict]:
    from dlenv.data.demo import ensure_demo_data

    demo = ensure_demo_data(out / "demo")
    n_val = sum(1 for _ in (demo / "val").rglob("*.png"))
    rows = []
    for seed in range(args.seeds):
        for gpus in (1, 2):
            opts = ["--data", str(demo), "--model", "resnet18", "--amp", "--epochs", str(args.epochs),
                    "--batch-size", str(args.demo_batch // gpus), "--gpus", str(gpus), "--device", "cuda",
                    "--seed", str(seed)]
            row, wall = run_train(f"demo-{gpus}gpu-seed{seed}", opts, out, args.timeout)
            rows.append({"part": "accuracy", "model": "resnet18", "gpus": gpus, "seed": seed,
                         "batch_per_gpu": args.demo_batch // gpus, "top1": row["top1"], "val_loss": row["val_loss"],
                         "img_per_s": row["img_per_s"], "wall_s": wall, "n_val": n_val})
    return rows


def accuracy_check(rows: list[dict]) -> tuple[float, float, float, float]:
    """(mean top-1 on 1 GPU, on 2 GPUs, difference, allowed difference) in percentage points."""
    import statistics

    acc = {g: [r["top1"] for r in rows if r["gpus"] == g] for g in (1, 2)}
    m1, m2 = statistics.mean(acc[1]), statistics.mean(acc[2])
    n_val, k = rows[0]["n_val"], len(acc[1])
    p = (m1 + m2) / 200
    se_val = 100 * math.sqrt(2 * p * (1 - p) / n_val / k)  # the val set's sampling error of a difference
    spread = [statistics.stdev(acc[g]) for g in (1, 2)] if k > 1 else [0.0, 0.0]
    se_seeds = math.sqrt((spread[0] ** 2 + spread[1] ** 2) / k)  # run-to-run noise
    return m1, m2, m2 - m1, 3 * max(se_val, se_seeds)


def markdown(rows: list[dict], head: str, checks: list[tuple[str, bool]]) -> str:
    lines = [f"# dlenv train --gpus 2 vs --gpus 1\n\n{head}\n"]
    speed = [r for r in rows if r["part"] == "speed"]
    if speed:  # none under --skip-speed
        lines += ["## Speed (synthetic data, same per-GPU batch)\n",
                  "| model | GPUs | batch/GPU | images/s | speed-up | efficiency | peak alloc GiB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in speed:
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "1.00x"
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else "100%"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['batch_per_gpu']} | {r['img_per_s']:,.0f} | {sp} | {eff} | "
                     f"{r['mem_alloc_gib']:.1f} |")
    acc = [r for r in rows if r["part"] == "accuracy"]
    if acc:
        lines += ["", "## Demo data, same effective batch\n", "| GPUs | batch/GPU | seed | val top-1 % | val loss |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['gpus']} | {r['batch_per_gpu']} | {r['seed']} | {r['top1']:.2f} | {r['val_loss']:.4f} |"
                  for r in acc]
    lines += ["", "## Targets\n"] + [f"- [{'x' if ok else ' '}] {text}" for text, ok in checks]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50", help="model of the speed part")
    ap.add_argument("--batch", type=int, default=256, help="per-GPU batch of the speed part")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=60, help="steps per epoch of the speed part (2 epochs)")
    # the trainer's defaults (batch 32, 10 epochs): enough optimizer steps that the demo is learned
    # (fewer, larger steps left both sides near chance, where "the same accuracy" says little)
    ap.add_argument("--epochs", type=int, default=10, help="epochs of each demo-data run")
    ap.add_argument("--demo-batch", type=int, default=32, help="effective batch of the demo-data runs")
    ap.add_argument("--seeds", type=int, default=2, help="demo-data runs per GPU count")
    ap.add_argument("--skip-accuracy", action="store_true", help="measure speed only")
    ap.add_argument("--skip-speed", action="store_true", help="compare accuracy only")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed per run")
    ap.add_argument("--out", default="runs/bench-ddp", help="folder for bench_ddp.csv / .md, logs and runs")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"bench_ddp: needs 2 CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    rows, checks = [], []
    if not args.skip_speed:
        rows = speed(args, out)
        sp = rows[1]["speedup"]
        checks.append((f"{args.model} --amp, 2 GPUs: {sp:.2f}x one GPU's images/s (target >= {SPEEDUP_TARGET}x)",
                       sp >= SPEEDUP_TARGET))
    if not args.skip_accuracy:
        acc = accuracy(args, out)
        rows += acc
        m1, m2, diff, allowed = accuracy_check(acc)
        checks.append((f"demo val top-1: 1 GPU {m1:.2f}%, 2 GPUs {m2:.2f}% (difference {diff:+.2f} points, "
                       f"noise bound +-{allowed:.2f})", abs(diff) <= allowed))

    import pandas as pd

    head = (f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, PyTorch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
            f"speed: {args.img_size} px, {args.steps} steps per epoch, second epoch timed")
    pd.DataFrame(rows).to_csv(out / "bench_ddp.csv", index=False)
    md = markdown(rows, head, checks)
    (out / "bench_ddp.md").write_text(md, encoding="utf-8")
    print(md)
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
