"""How fast is `dlenv data-report --check-images`? 10,000 small JPEGs, decoded in parallel.

Writes N JPEGs (default 10,000 of 96x96, ten class folders) into a temporary folder, then times the
report three ways: the quick default (headers, end markers, hashes; no decode), --check-images with
one process (the serial yardstick), and --check-images with every usable CPU. Prints a table.

    python3 scripts/bench_check_images.py [--n 10000] [--size 96] [--workers 16]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from dlenv.data.report import dataset_report  # noqa: E402
from dlenv.options.cpus import usable_cpus  # noqa: E402


def write_jpegs(root: Path, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    t = np.linspace(0, 255, size, dtype=np.float32)
    for i in range(n):
        d = root / f"class{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        c = rng.uniform(0, 1, size=3).astype(np.float32)
        img = t[None, :, None] * c + rng.normal(0, 12, (size, size, 3)).astype(np.float32)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(d / f"{i:06d}.jpg", quality=90)
    # one broken file, so the check has something to find
    good = (root / "class0" / "000000.jpg").read_bytes()
    (root / "class0" / "broken.jpg").write_bytes(good[: len(good) // 2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000, help="number of JPEGs")
    ap.add_argument("--size", type=int, default=96, help="image side in pixels")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: usable CPUs)")
    args = ap.parse_args()
    workers = args.workers or usable_cpus()
    root = Path(tempfile.mkdtemp(prefix="bench-check-images-"))
    try:
        t0 = time.perf_counter()
        write_jpegs(root, args.n, args.size)
        mib = sum(f.stat().st_size for f in root.rglob("*.jpg")) / 2**20
        print(f"{args.n} JPEGs of {args.size}x{args.size} ({mib:.0f} MiB) written in "
              f"{time.perf_counter() - t0:.1f} s; {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, {usable_cpus()} usable")
        print(f"{'mode':<30} {'workers':>7} {'seconds':>8} {'images/s':>9} {'unreadable':>10}")
        for name, check, w in (("quick (default)", False, None), ("--check-images, serial", True, 1),
                               ("--check-images, parallel", True, workers)):
            t = time.perf_counter()
            report = dataset_report(root, check_images=check, workers=w)
            dt = time.perf_counter() - t
            print(f"{name:<30} {w or '-':>7} {dt:>8.2f} {args.n / dt:>9.0f} {len(report['unreadable']):>10}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
