"""What `--batch-size auto` chooses, and how fast it trains against a fixed batch, in one call (issue 46).

For each model, `dlenv train --synthetic --amp` runs twice in fresh processes: `--batch-size auto` and the
fixed batch (ResNet-50: 256, ViT-B/16: 128), each for --steps micro-batches of one epoch; the table gives
the batch auto chose, its line, the img/s of results.csv (the epoch's, first steps included) and the
peak memory, and the ratio to the fixed batch.

    python3 scripts/bench_auto_batch_choice.py [--steps 80] [--out runs/bench-auto]

Needs a CUDA GPU. dlenv need not be installed: src/ is put on the path.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [("resnet50", 256), ("vit_b_16", 128)]


def train(model: str, batch: str, steps: int, out: Path) -> tuple[dict, str]:
    name = f"{model}-{batch}"
    cmd = [sys.executable, "-m", "dlenv", "train", "--synthetic", "--amp", "--model", model, "--img-size", "224",
           "--batch-size", batch, "--epochs", "1", "--max-steps", str(steps), "--workers", "0",
           "--project", str(out), "--name", name, "--exist-ok"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    said = next((line for line in p.stdout.splitlines() if line.startswith("--batch-size auto")), "")
    rows = []
    if (out / name / "results.csv").is_file():
        with open(out / name / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    if p.returncode or not rows:
        print(p.stdout[-2000:], p.stderr[-2000:])
    return (rows[-1] if rows else {}), said


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-auto"))
    a = ap.parse_args()
    lines = ["| model | batch | img/s | x fixed | peak GiB | auto's line |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for model, fixed in CASES:
        ref, _ = train(model, str(fixed), a.steps, a.out)
        auto, said = train(model, "auto", a.steps, a.out)
        for row, line in ((ref, ""), (auto, said)):
            if not row:
                lines.append(f"| {model} | failed | | | | {line} |")
                continue
            ips = float(row["img_per_s"])
            ratio = ips / float(ref["img_per_s"]) if ref else float("nan")
            lines.append(f"| {model} | {row['batch_size']}{' (auto)' if line else ''} | {ips:,.0f} | {ratio:.2f} "
                         f"| {float(row['mem_alloc_gib']):.1f} | {line} |")
        print("\n".join(lines[-2:]), flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
