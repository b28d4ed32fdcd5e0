"""How fast is `dlenv unpack`? Ours against `unzip -q` and `tar xf` on the very same archives.

Builds a dataset of JPEG-like files (JPEG markers around high-entropy bytes that deflate can shrink
only slightly, as real JPEGs; 100-500 KB each, in class folders) in a temporary folder, packs it
as .zip and .tar.gz (and .tar with --formats), then times each tool extracting each archive into an
empty folder, alternating the tools, several times. Every run is a fresh process (ours too, so the
interpreter's start-up counts) and is followed by an untimed `sync` and delete, so one run's
write-back does not slow the next. It prints the median time, throughput and our ratio to the
system tool (the goal: at least 0.9).

    python3 scripts/bench_unpack.py                 # ~1 GB
    python3 scripts/bench_unpack.py --size-mb 300 --repeat 5 --formats zip,tar.gz,tar

Needs `unzip` and `tar` on the PATH; dlenv need not be installed (src/ is put on the path).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OURS = ("import sys; sys.path.insert(0, sys.argv[1]); from dlenv.data.unpack import unpack; "
        "unpack(sys.argv[2], sys.argv[3], progress=False)")


def _jpeg_like(rng, size: int) -> bytes:
    """JPEG markers around bytes of ~7.9 bits entropy: deflate saves a few percent, as on real JPEGs."""
    import numpy as np

    body = rng.integers(0, 256, size - 6, dtype=np.uint8)
    body[body > 247] = 0  # skew the byte histogram a little, like entropy-coded JPEG data
    return b"\xff\xd8\xff\xe0" + body.tobytes() + b"\xff\xd9"


def make_tree(root: Path, size_mb: int, min_kb: int, max_kb: int, seed: int = 0) -> tuple[int, int]:
    """Write ~size_mb of files under root/<split>/<class>/; returns (files, bytes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total, n, budget = 0, 0, size_mb << 20
    while total < budget:
        size = int(rng.integers(min_kb << 10, (max_kb << 10) + 1))
        split = "val" if n % 5 == 0 else "train"
        d = root / "dataset" / split / f"class_{n % 10:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img_{n:06d}.jpg").write_bytes(_jpeg_like(rng, size))
        total += size
        n += 1
    return n, total


def make_archive(tree: Path, out: Path, fmt: str) -> Path:
    """Pack tree/dataset as out.<fmt> (deflate level 6 / gzip level 6, as zip and tar czf do)."""
    src = tree / "dataset"
    if fmt == "zip":
        path = out.with_suffix(".zip")
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
            for p in sorted(src.rglob("*")):
                z.write(p, p.relative_to(tree))
    else:
        path = out.with_suffix("." + fmt)
        mode = "w:gz" if fmt == "tar.gz" else "w"
        kw = {"compresslevel": 6} if fmt == "tar.gz" else {}
        with tarfile.open(path, mode, **kw) as t:
            t.add(src, arcname="dataset")
    return path


def command(tool: str, archive: Path, dest: Path) -> list[str]:
    if tool == "ours":
        return [sys.executable, "-c", OURS, str(ROOT / "src"), str(archive), str(dest)]
    if tool == "unzip":
        return ["unzip", "-q", "-o", str(archive), "-d", str(dest)]
    return ["tar", "xf", str(archive), "-C", str(dest)]


def time_one(tool: str, archive: Path, work: Path) -> float:
    dest = work / f"out-{tool}"
    if tool != "ours":
        dest.mkdir()  # unzip/tar want the folder; ours makes it (and renames into place)
    t0 = time.perf_counter()
    subprocess.run(command(tool, archive, dest), check=True)
    seconds = time.perf_counter() - t0
    shutil.rmtree(dest)
    subprocess.run(["sync"], check=False)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="dataset size in MiB (default 1024)")
    ap.add_argument("--min-kb", type=int, default=100)
    ap.add_argument("--max-kb", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per tool and format (median)")
    ap.add_argument("--formats", default="zip,tar.gz", help="comma-separated: zip, tar.gz, tar")
    ap.add_argument("--dir", default=None, help="where to build and extract (default: a temp folder)")
    a = ap.parse_args()

    for exe in ("unzip", "tar"):
        if shutil.which(exe) is None:
            sys.exit(f"{exe} is not on the PATH (apt-get install -y {exe})")
    work = Path(tempfile.mkdtemp(prefix="bench_unpack-", dir=a.dir))
    try:
        t0 = time.perf_counter()
        files, nbytes = make_tree(work, a.size_mb, a.min_kb, a.max_kb)
        archives = {fmt: make_archive(work, work / "dataset", fmt) for fmt in a.formats.split(",")}
        shutil.rmtree(work / "dataset")
        print(f"{files} files, {nbytes / 2**20:.0f} MiB; archives built in {time.perf_counter() - t0:.0f} s "
              f"({', '.join(f'{f} {p.stat().st_size / 2**20:.0f} MiB' for f, p in archives.items())})")
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, in {work}\n")
        rows = []
        for fmt, path in archives.items():
            theirs = "unzip" if fmt == "zip" else "tar"
            times: dict[str, list[float]] = {"ours": [], theirs: []}
            time_one("ours", path, work)  # warm the page cache and the interpreter's files
            for _ in range(a.repeat):
                for tool in (theirs, "ours"):
                    times[tool].append(time_one(tool, path, work))
            med = {t: statistics.median(v) for t, v in times.items()}
            for tool in (theirs, "ours"):
                rows.append((fmt, tool, med[tool], min(times[tool]), nbytes / med[tool] / 2**20,
                             med[theirs] / med[tool]))
        print(f"{'archive':<8} {'tool':<6} {'median s':>9} {'best s':>7} {'MiB/s':>7} {'ours/theirs':>12}")
        for fmt, tool, m, best, mbs, ratio in rows:
            r = f"{ratio:.2f}x" if tool == "ours" else ""
            print(f"{fmt:<8} {tool:<6} {m:>9.2f} {best:>7.2f} {mbs:>7.0f} {r:>12}")
        print("\nthroughput ratio = their median time / our median time (>= 0.9 is the goal)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
