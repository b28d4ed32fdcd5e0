"""How many CPUs this process may really use, without importing torch.

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
