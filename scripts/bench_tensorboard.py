"""What `train --tensorboard` costs a run, for docs/docker.md ("JupyterLab and TensorBoard").

    python scripts/bench_tensorboard.py [--repeats 3]

With torch already loaded (as in a run), each repeat in a fresh process: the seconds to import
torch.utils.tensorboard and open a SummaryWriter (what a run pays once, at its start), and the
milliseconds to add one epoch's scalars (the 14 columns of results.csv) and flush them, over 50 epochs
(median and worst). Prints one line per repeat and the machine's load average beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COLUMNS = 14  # results.csv's columns, which the trainer writes as scalars each epoch


def one() -> str:
    import torch  # noqa: F401  (loaded before the writer, as in a run)

    t = time.perf_counter()
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as d:
        writer = SummaryWriter(log_dir=d)
        opened = time.perf_counter() - t
        per_epoch = []
        for epoch in range(1, 51):
            t = time.perf_counter()
            for k in range(COLUMNS):
                writer.add_scalar(f"column{k}", k / epoch, epoch)
            writer.flush()
            per_epoch.append(time.perf_counter() - t)
        writer.close()
    return (f"import + open: {opened:.2f} s; one epoch's {COLUMNS} scalars + flush: median "
            f"{statistics.median(per_epoch) * 1e3:.1f} ms, worst {max(per_epoch) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(one())
        return
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    for _ in range(args.repeats):
        line = subprocess.run([sys.executable, __file__, "--one"], capture_output=True, text=True,
                              check=True).stdout.strip()
        print(f"{line}  (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
