"""PyTorch's default intra-op threads against the count dlenv picks (dlenv.options.cpus.threads: the CPUs this
process may use, affinity and cgroup quota), training the demo's CPU model (small_cnn, 32 px, 10 classes) for
a fixed number of steps on the CPU, on an idle machine and beside a busy neighbour (one process spinning on
every core). One thread is timed too, for reference. Each measurement runs in a fresh child process (the
thread count is set once per process), and prints a markdown table of img/s (docs/training.md, "CPU threads").

    python scripts/bench_cpu_threads.py [--steps 40] [--batch-size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import torch
from dlenv.model.models import build_model
threads, steps, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
torch.manual_seed(0)
model = build_model("small_cnn", 10)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
def step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(3):  # warm-up: allocator, OpenMP pool
    step()
t = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"threads": torch.get_num_threads(), "img_s": steps * batch / (time.perf_counter() - t)}))
"""


def measure(threads: int, steps: int, batch: int) -> tuple[int, float]:
    """(threads used, img/s) of one child process; `threads` 0 leaves PyTorch's default."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(steps), str(batch)], env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["threads"], r["img_s"]


def spinners(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy (a neighbour's CPU-bound work)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="median of this many child processes per cell")
    args = ap.parse_args()

    from dlenv.options import cpus

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    chosen, why = cpus.threads(env)
    configs = [("PyTorch's default", 0), (f"dlenv's choice ({why})", chosen), ("one thread", 1)]
    rows = []
    for situation in ("idle", "busy neighbour"):
        busy = spinners(os.cpu_count() or 1) if situation == "busy neighbour" else []
        try:
            time.sleep(0.5 if busy else 0)
            for name, n in configs:
                runs = [measure(n, args.steps, args.batch_size) for _ in range(args.repeats)]
                rows.append((situation, name, runs[0][0], statistics.median(r[1] for r in runs)))
        finally:
            for p in busy:  # only the spinners this script started
                p.kill()
                p.wait()
    import torch

    print(f"small_cnn, 32 px, batch {args.batch_size}, {args.steps} steps after 3 warm-up, median of "
          f"{args.repeats}; torch {torch.__version__}, {os.cpu_count()} CPUs on the host, this process may use "
          f"{why}\n")
    print("| machine | threads | count | img/s |\n| --- | --- | ---: | ---: |")
    for situation, name, n, img_s in rows:
        print(f"| {situation} | {name} | {n} | {img_s:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
