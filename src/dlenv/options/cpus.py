"""How many CPUs this process may really use, how many threads and DataLoader workers follow from them, without
importing torch (verify-env reports them, and must run where torch does not import).

os.cpu_count() is the host's count. What a process may use is less where its affinity mask is narrower
(`taskset`, `docker --cpuset-cpus`, a Slurm step's cpuset) or its cgroup has a CPU quota (`docker --cpus`,
Kubernetes limits, Slurm's cgroup): the smaller of the two (`cpu_budget`). The quota is read from the
process's own cgroup (/proc/self/cgroup) and each of its parents, cgroup v2 (`cpu.max`) or v1
(`cpu.cfs_quota_us` / `cpu.cfs_period_us`); every file is read bounded and parsed strictly, and one that
is missing or does not parse counts as no quota. PyTorch's intra-op threads, OpenMP's in child processes and
'auto' DataLoader workers follow that count (`threads`), so a busy or limited machine is not
oversubscribed; an OMP_NUM_THREADS the user set wins.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: the most bytes read of a cgroup file (a real one holds a line of two numbers)
CGROUP_READ_LIMIT = 256
#: the most parent cgroups looked at above the process's own
CGROUP_DEPTH = 32
_V2_MAX = re.compile(r"(max|[0-9]{1,19}) ([0-9]{1,19})\n?")
_INT = re.compile(r"-?[0-9]{1,19}\n?")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use (`count`) and what set it: the host's CPUs, the affinity mask's and
    the cgroup quota in CPUs (None: no quota)."""

    count: int
    host: int
    affinity: int
    quota: float | None = None

    @property
    def why(self) -> str:
        """What limits the count, in words: "4 CPUs (cgroup quota 4.0 of 16)"."""
        n = f"{self.count} CPU{'s' if self.count != 1 else ''}"
        if self.quota is not None and self.count < self.affinity:
            return f"{n} (cgroup quota {self.quota:.1f} of {self.host})"
        if self.affinity < self.host:
            return f"{n} (affinity {self.affinity} of {self.host})"
        return f"{n} (all of the host's)"


def _read_small(path: Path) -> str | None:
    """The text of a regular file of at most CGROUP_READ_LIMIT bytes; None for anything else."""
    try:
        with open(path, "rb") as f:
            data = f.read(CGROUP_READ_LIMIT + 1)
    except OSError:
        return None
    if len(data) > CGROUP_READ_LIMIT:
        return None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        return None


def parse_cpu_max(text: str | None) -> float | None:
    """CPUs a cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD") allows; None: no quota or not parsable."""
    m = _V2_MAX.fullmatch(text or "")
    if not m or m.group(1) == "max" or int(m.group(2)) <= 0 or int(m.group(1)) <= 0:
        return None
    return int(m.group(1)) / int(m.group(2))


def parse_cfs(quota: str | None, period: str | None) -> float | None:
    """CPUs a cgroup v1 quota and period (`cpu.cfs_quota_us`, `cpu.cfs_period_us`) allow; None: no quota
    (-1) or not parsable."""
    if not (_INT.fullmatch(quota or "") and _INT.fullmatch(period or "")):
        return None
    q, p = int(quota), int(period)  # type: ignore[arg-type]
    return q / p if q > 0 and p > 0 else None


def _own_cgroups(root: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/self/cgroup: ("", path) for v2, ("cpu,cpuacct", path) for v1."""
    text = _read_small_lines(root / "proc/self/cgroup")
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/") and ".." not in parts[2].split("/"):
            out.append((parts[1], parts[2]))
    return out


def _read_small_lines(path: Path, limit: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _ancestors(base: Path, cgroup: str) -> list[Path]:
    """The cgroup folder of `cgroup` under the mount `base` and each parent up to the mount itself (inside a
    container the mount is often the container's own cgroup while /proc/self/cgroup names the host's path)."""
    parts = [p for p in cgroup.split("/") if p][:CGROUP_DEPTH]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_quota(root: str | Path = "/") -> float | None:
    """The smallest CPU quota (in CPUs) of this process's cgroup and its parents, v2 or v1; None: none."""
    root = Path(root)
    quotas = []
    for controllers, path in _own_cgroups(root):
        if controllers == "":
            for d in _ancestors(root / "sys/fs/cgroup", path):
                quotas.append(parse_cpu_max(_read_small(d / "cpu.max")))
        elif "cpu" in controllers.split(","):
            for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                for d in _ancestors(root / "sys/fs/cgroup" / mount, path):
                    quotas.append(parse_cfs(_read_small(d / "cpu.cfs_quota_us"),
                                            _read_small(d / "cpu.cfs_period_us")))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def cpu_budget(root: str | Path = "/") -> CpuBudget:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota (whole CPUs, at least
    one: a quota of 2.5 CPUs keeps 2 threads busy, 0.5 one)."""
    host = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = host
    quota = cgroup_quota(root)
    count = affinity if quota is None else max(1, min(affinity, math.floor(quota)))
    return CpuBudget(count, host, affinity, quota)


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by the cgroup CPU quota (`cpu_budget`)."""
    return cpu_budget().count


def threads(env: Mapping[str, str] | None = None, budget: CpuBudget | None = None) -> tuple[int, str]:
    """(intra-op threads for PyTorch and OpenMP, why): an OMP_NUM_THREADS the user set (a whole number of
    at least one) wins; else one per CPU this process may use (`cpu_budget`)."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given), f"{int(given)} threads (OMP_NUM_THREADS={given}, yours)"
    budget = budget or cpu_budget()
    return budget.count, budget.why


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
