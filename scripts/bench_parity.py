#!/usr/bin/env python3
"""The trainer of two source trees side by side, in one run: images/s and peak memory, new / old.

    git archive 5fb725f --prefix=.bench_old/ | tar -x                   # the tree before a change
    python3 scripts/bench_parity.py --old .bench_old/src --new src --out /tmp/parity

For each model and configuration, scripts/bench_train.py runs the trainer (no yardstick) once per tree
in a fresh process with that tree on PYTHONPATH, as a user runs it, old and new alternating (and swapping
who goes first each round) so the GPU's warm-up and clocks favour neither; with --rounds N each side
keeps its best. One configuration per process: a run after another in the same process starts with what
the first left allocated (PyTorch 2.x's cuBLAS workspaces, about 65 MiB per stream, which dlenv gives
back at the end of a run since 9c6fce8, issue 54, and 4d0c59a did not), so its peak would compare the
trees' clean-up, not their training.
Passes when every configuration of the new tree trains at >= --min-ratio (0.98) of the old one's
images/s, with a peak allocated memory at most old / --min-ratio. Writes parity.md and parity.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: (model, bench_train.py configurations): the trainer's everyday paths
DEFAULT = [("resnet50", ["fp32", "--amp", "--amp --checkpoint --checkpoint-ratio 1"]),
           ("vit_b_16", ["fp32", "--amp", "--amp --checkpoint --checkpoint-ratio 1"])]


def missing_rows(requested: list[tuple[str, list[str]]], best: dict[tuple[str, str, str], tuple[float, float]],
                 only: str | None = None) -> list[str]:
    """Each requested (model, configuration, tree) that produced no row: a label bench_train does not have,
    or a run that failed. Any of them fails the comparison: a row that is missing compares nothing."""
    return [f"{model} {cfg!r} ({side})" for model, configs in requested if not only or model == only
            for cfg in configs for side in ("old", "new") if (model, cfg, side) not in best]


def schedule(asked: list[tuple[str, list[str]]], rounds: int,
             only: str | None = None) -> list[tuple[str, str, str, int]]:
    """The processes to run, in order: (model, configuration, "old" or "new", round), one configuration
    each; for each configuration the two trees back to back, the first of them swapping every round."""
    runs = []
    for model, configs in asked:
        if only and model != only:
            continue
        for k in range(rounds):
            for config in configs:
                runs += [(model, config, side, k) for side in (("old", "new") if k % 2 == 0 else ("new", "old"))]
    return runs


def run_tree(src: Path, model: str, config: str, steps: int, out: Path,
             extra: list[str]) -> dict[str, tuple[float, float]]:
    """{configuration: (images/s, peak GiB)} of bench_train.py with the trainer from `src`, one configuration."""
    cmd = [sys.executable, str(HERE / "bench_train.py"), "--only", model, "--steps", str(steps), "--no-yardstick",
           "--out", str(out), f"--config={config}", *extra]
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    print("$ PYTHONPATH=" + env["PYTHONPATH"], " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, env=env, check=False)  # bench_train exits 1 when its own targets fail; rows still count
    with open(out / "bench_train.csv", newline="") as f:
        return {r["config"].removeprefix("dlenv "): (float(r["img_per_s"]), float(r["peak_gib"]))
                for r in csv.DictReader(f)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="src/ of the tree to compare against")
    ap.add_argument("--new", type=Path, default=HERE.parent / "src", help="src/ of the changed tree")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--rounds", type=int, default=1, help="runs per tree and model; the best counts")
    ap.add_argument("--min-ratio", type=float, default=0.98)
    ap.add_argument("--only", default=None, help="one model (resnet50 or vit_b_16)")
    ap.add_argument("--config", action="append", default=None,
                    help="only this configuration (e.g. --config=fp32; repeatable)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-parity"))
    ap.add_argument("--check-on-cpu", action="store_true",
                    help="a quick run of this script on the CPU at 32 px (its numbers mean nothing)")
    a = ap.parse_args()
    extra = ["--device", "cpu", "--img-size", "32"] if a.check_on_cpu else []
    best: dict[tuple[str, str, str], tuple[float, float]] = {}
    asked = [(m, [c for c in cs if not a.config or c in a.config]) for m, cs in DEFAULT]
    for n, (model, config, side, k) in enumerate(schedule(asked, a.rounds, a.only)):
        src = a.old if side == "old" else a.new
        for cfg, (ips, peak) in run_tree(src, model, config, a.steps, a.out / f"{n:02d}-{model}-{side}-{k}",
                                         extra).items():
            key = (model, cfg, side)
            old = best.get(key)
            best[key] = (max(ips, old[0]), min(peak, old[1])) if old else (ips, peak)
    lines = [f"new ({a.new}) against old ({a.old}); {a.steps} timed steps, best of {a.rounds} round(s)", "",
             "| model | configuration | old img/s | new img/s | speed new/old | old peak GiB | new peak GiB | "
             "memory old/new |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows, ok = [], True
    for (model, cfg, side), (ips, peak) in sorted(best.items()):
        if side != "new" or (model, cfg, "old") not in best:
            continue
        o_ips, o_peak = best[(model, cfg, "old")]
        speed = ips / o_ips
        mem = o_peak / peak if peak else 1.0  # no GPU memory measured (--check-on-cpu): nothing to compare
        ok &= speed >= a.min_ratio and mem >= a.min_ratio
        rows.append({"model": model, "config": cfg, "old_img_s": o_ips, "new_img_s": ips, "speed_ratio": speed,
                     "old_peak_gib": o_peak, "new_peak_gib": peak, "memory_ratio": mem})
        lines.append(f"| {model} | {cfg} | {o_ips:,.0f} | {ips:,.0f} | {speed:.3f} | {o_peak:.2f} | {peak:.2f} | "
                     f"{mem:.3f} |")
    missing = missing_rows(asked, best, a.only)
    ok &= not missing
    if missing:
        lines += ["", f"FAIL: no row for {', '.join(missing)} (a label bench_train.py does not have, or a failed run)"]
    lines += ["", f"{'PASS' if ok and rows else 'FAIL'}: every configuration >= {a.min_ratio} of the old tree's speed "
              "and memory"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "parity.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(a.out / "parity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["model", "config", "old_img_s", "new_img_s", "speed_ratio", "old_peak_gib",
                               "new_peak_gib", "memory_ratio"])
        w.writeheader()
        w.writerows(rows)
    print("\n".join(lines))
    return 0 if ok and rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
