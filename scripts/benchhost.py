"""What the input benchmarks of scripts/ (bench_pipeline.py) do first on their host: hold
the process to its first N CPUs, as `taskset` would, and check that the device they time is there."""

from __future__ import annotations

import os
import sys

import torch


def hold_cores(n: int) -> None:
    """Keep this process (and the DataLoader workers it starts, which inherit the affinity) on the first `n`
    CPUs it may use; torch's intra-op threads follow. 0 leaves everything as it is."""
    if n:
        cpus = sorted(os.sched_getaffinity(0))[:n]
        os.sched_setaffinity(0, cpus)  # dlenv's usable_cpus() reads the affinity, so --workers auto follows
        torch.set_num_threads(len(cpus))


def device_or_none(name: str, script: str) -> torch.device | None:
    """torch.device(`name`), or None after one line on stderr when it is CUDA and there is none."""
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (or --device cpu to check the script)", file=sys.stderr)
        return None
    return dev


def cpu_jiffies(cpus: list[int] | None = None) -> tuple[int, int]:
    """(busy, total) clock ticks of these CPUs (default: the ones this process may use) since boot, from
    /proc/stat: every process on them counts, not only this one. Two readings give the share of the time
    between them that the CPUs were busy. (0, 0) where there is no /proc/stat."""
    want = {f"cpu{c}" for c in (sorted(os.sched_getaffinity(0)) if cpus is None else cpus)}
    busy = total = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, *ticks = line.split()
                if name in want:
                    n = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(n)
                    busy += sum(n) - n[3] - n[4]
    except OSError:
        return 0, 0
    return busy, total
