"""How many CPUs this process may really use, and how many DataLoader workers 'auto' starts on them,
without importing torch (verify-env reports both, and must run where torch does not import).

os.cpu_count() is the host's count; inside a container the affinity mask (`--cpuset-cpus`) and the
cgroup CPU quota (`docker --cpus`) are what limit DataLoader workers, image checks and verify-env's
report.
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by a cgroup v2 CPU quota if one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


#: most workers 'auto' picks: beyond this, more processes mostly cost memory and start-up time.
MAX_AUTO_WORKERS = 32
#: up to this many cores every one of them decodes (the loader, not the GPU, sets the pace there);
#: above it TRAINER_CORES stay with the training process: its loop launches the GPU's work, and its
#: pin-memory and GPU-augmentation threads receive every batch (scripts/bench_pipeline.py measured
#: 12, 14 and 16 workers on 16 cores: docs/input-pipeline.md)
ALL_CORES_UP_TO = 8
TRAINER_CORES = 2
#: a /dev/shm smaller than this is shared with everything else in the container (Docker's default is
#: 64 MiB): 'auto' stays well clear of it with at most SMALL_SHM_WORKERS workers
SMALL_SHM = 1 << 30
SMALL_SHM_WORKERS = 2


def auto_workers(cpus: int) -> int:
    """Workers 'auto' starts on `cpus` usable cores, before /dev/shm is considered: all of them up to
    ALL_CORES_UP_TO, then all but TRAINER_CORES, at most MAX_AUTO_WORKERS (4 -> 4, 8 -> 8, 12 -> 10,
    16 -> 14, 64 -> 32)."""
    return max(0, min(max(min(cpus, ALL_CORES_UP_TO), cpus - TRAINER_CORES), MAX_AUTO_WORKERS))


def workers_that_fit(n: int, shm_total: int, shm_free: int, per_worker: int, given: bool = False) -> int:
    """Of `n` workers, how many this /dev/shm holds (workers pass their batches through it): as many
    as have room for `per_worker` bytes each; for 'auto' (not `given`), at most SMALL_SHM_WORKERS on a
    small one, which the rest of the container shares. A number the user gave is only held to what fits."""
    fit = int(shm_free // per_worker) if per_worker else n
    if shm_total < SMALL_SHM and not given:
        fit = min(fit, SMALL_SHM_WORKERS)
    return max(0, min(n, fit))
