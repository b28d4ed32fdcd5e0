"""What `dlenv watch` samples: each visible GPU through NVML, and the host from /proc.

`Nvml` reads the GPUs a CUDA program here sees (CUDA_VISIBLE_DEVICES honoured; NVML itself ignores it):
utilisation, memory used and total, power and its enforced limit, SM clock and its maximum, each None
where a board does not report it. `GpuBusy` samples one GPU's utilisation in a light background thread
(the per-epoch gpu_busy column of `dlenv train`). `Host` reads the CPUs the command may run on, its
processes (every process of its session: the script and its DataLoader workers) and the machine's disk
reads, between two calls. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dlenv.errors import UserError, optional_import


@dataclass
class GpuSample:
    """One GPU at one moment, as NVML reports it (None where the card does not report a counter)."""

    util: float | None = None          # % of the last period with a kernel running
    mem_used: float | None = None      # bytes
    mem_total: float | None = None     # bytes
    power: float | None = None         # W
    power_limit: float | None = None   # W
    sm_clock: float | None = None      # MHz
    sm_clock_max: float | None = None  # MHz


@dataclass
class Sample:
    """One moment: seconds since the start, the host's and the command's figures, and each GPU's."""

    t: float
    host_cpu: float | None = None      # % busy of the CPUs the command may run on
    proc_cpu: float | None = None      # the command's processes, in % of one core (200 = two cores)
    proc_rss: float | None = None      # bytes, summed over the command's processes
    disk_read: float | None = None     # bytes/s read from the machine's disks
    procs: int | None = None           # the command's processes
    gpus: list[GpuSample] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# NVML


def _nvml() -> Any:
    """The pynvml module, initialised; raises RuntimeError with the reason when there is none."""
    try:  # optional: a machine without NVIDIA's driver still runs the command
        pynvml = optional_import("pynvml", "nvidia-ml-py (pynvml) is not installed")
    except UserError as e:  # not there, or broken (its line names pip check): the reason watch gives
        raise RuntimeError(str(e)) from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no driver here
        raise RuntimeError(str(e) or type(e).__name__) from None
    return pynvml


def visible_indices(count: int, visible: str | None = None) -> list[int | str]:
    """NVML device indices (or GPU UUIDs) of the GPUs a CUDA program here sees: CUDA_VISIBLE_DEVICES's
    entries in its order (indices or GPU-... UUIDs, up to the first that is neither, as CUDA reads it),
    else all `count`. NVML itself ignores CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return list(range(count))
    out: list[int | str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < count:
            out.append(int(entry))
        elif entry.startswith("GPU-"):
            out.append(entry)
        else:  # CUDA stops at the first entry it cannot read
            break
    return out


class Nvml:
    """The GPUs a CUDA program here sees, read through NVML. `Nvml.open()` gives one, or the one line
    that says why there is none."""

    def __init__(self, nvml: Any, handles: list[Any], names: list[str]):
        self.nvml, self.handles, self.names = nvml, handles, names

    @classmethod
    def open(cls, visible: str | None = None) -> tuple[Nvml | None, str]:
        """(Nvml, "") or (None, why there is no GPU to watch)."""
        try:
            nvml = _nvml()
        except RuntimeError as e:
            return None, f"no NVIDIA GPU to watch (NVML: {e})"
        try:
            handles = []
            for i in visible_indices(nvml.nvmlDeviceGetCount(), visible):
                handles.append(nvml.nvmlDeviceGetHandleByIndex(i) if isinstance(i, int)
                               else nvml.nvmlDeviceGetHandleByUUID(i))
            names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        except Exception as e:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return None, f"no NVIDIA GPU to watch (NVML: {e})"
        if not handles:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return None, "no NVIDIA GPU to watch (NVML sees none" + (
                f" in CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
                if "CUDA_VISIBLE_DEVICES" in os.environ else ")")
        return cls(nvml, handles, names), ""

    def sample(self) -> list[GpuSample]:
        """Each GPU's counters now; a counter the card does not report is None."""
        return [self._one(h) for h in self.handles]

    def _read(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(*args)
        except Exception:  # NVMLError_NotSupported on some boards, a GPU fallen off the bus: no figure
            return None

    def _one(self, h: Any) -> GpuSample:
        nv = self.nvml
        util = self._read("nvmlDeviceGetUtilizationRates", h)
        mem = self._read("nvmlDeviceGetMemoryInfo", h)
        power = self._read("nvmlDeviceGetPowerUsage", h)
        limit = self._read("nvmlDeviceGetEnforcedPowerLimit", h)
        return GpuSample(util=None if util is None else float(util.gpu),
                         mem_used=None if mem is None else float(mem.used),
                         mem_total=None if mem is None else float(mem.total),
                         power=None if power is None else power / 1000.0,
                         power_limit=None if limit is None else limit / 1000.0,
                         sm_clock=_float(self._read("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)),
                         sm_clock_max=_float(self._read("nvmlDeviceGetMaxClockInfo", h, nv.NVML_CLOCK_SM)))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


class GpuBusy:
    """NVML utilisation of one GPU sampled in a light background thread: `start()`, then `stop()`
    returns the mean utilisation (%) since start, or None without NVML or samples. For `dlenv train`'s
    per-epoch gpu_busy column: the same figure `dlenv watch` gives, without a watcher."""

    def __init__(self, cuda_index: int, interval: float = 1.0):
        self.cuda_index, self.interval = cuda_index, interval
        self._nvml: Nvml | None = None
        self._unavailable = False       # NVML was tried and is not there: not tried again each epoch
        self._values: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuBusy:
        self.stop()  # a previous epoch's thread (one stopped by a re-plan) ends first
        if self._nvml is None and not self._unavailable:
            nvml, _ = Nvml.open()
            if nvml is not None and self.cuda_index < len(nvml.handles):
                nvml.handles = [nvml.handles[self.cuda_index]]
                self._nvml = nvml
            else:
                self._unavailable = True
                if nvml is not None:
                    nvml.close()
        if self._nvml is None:
            return self
        self._values, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlenv-gpu-busy", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        util = self._nvml.sample()[0].util
        if util is not None:
            self._values.append(util)

    def stop(self) -> float | None:
        """The mean utilisation (%) since start(), None without a figure; the thread ends. An epoch shorter
        than the interval gets one sample here (NVML's figure covers its last period)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            if not self._values:
                self._take()
        return sum(self._values) / len(self._values) if self._values else None

    def close(self) -> None:
        self.stop()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None


# ---------------------------------------------------------------------------------------------------
# The host, from /proc


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(session id, utime + stime in ticks, resident pages) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("latin-1")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    try:
        return int(fields[3]), int(fields[11]) + int(fields[12]), int(fields[21])
    except (IndexError, ValueError):
        return None


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (busy ticks, total ticks) from /proc/stat."""
    out = {}
    try:
        with open("/proc/stat", encoding="ascii", errors="replace") as fh:
            for line in fh:
                m = re.match(r"cpu(\d+)\s+(.*)", line)
                if m:
                    v = [int(x) for x in m[2].split()]
                    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
                    out[int(m[1])] = (sum(v[:8]) - idle, sum(v[:8]))
    except (OSError, ValueError):
        pass
    return out


def _disk_read_bytes() -> int | None:
    """Bytes read from the machine's whole disks so far (/proc/diskstats; partitions not counted twice)."""
    try:
        disks = set(os.listdir("/sys/block"))
        total = 0
        with open("/proc/diskstats", encoding="ascii", errors="replace") as fh:
            for line in fh:
                f = line.split()
                if len(f) > 5 and f[2] in disks and not f[2].startswith(("loop", "ram", "zram")):
                    total += int(f[5]) * 512
        return total
    except (OSError, ValueError):
        return None


class Host:
    """The host's figures between two calls of `sample()`: the CPUs the command may run on, its
    processes (every process of its session), disk reads."""

    def __init__(self, session: int, cpus: Sequence[int] | None = None):
        self.session = session
        self.cpus = set(cpus) if cpus else None
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.ticks = _clock_ticks()
        self._last: tuple[float, dict[int, tuple[int, int]], dict[int, int], int | None] | None = None

    def _procs(self) -> dict[int, tuple[int, int]]:
        """pid -> (cpu ticks, resident pages) of the processes of the command's session."""
        out = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _proc_stat(int(name))
                if st is not None and st[0] == self.session:
                    out[int(name)] = (st[1], st[2])
        return out

    def sample(self) -> dict[str, Any]:
        now, cpus, procs, disk = time.monotonic(), _cpu_times(), self._procs(), _disk_read_bytes()
        out: dict[str, Any] = {"procs": len(procs), "proc_rss": float(sum(r for _, r in procs.values()) * self.page)}
        if self._last is not None:
            t0, cpus0, procs0, disk0 = self._last
            dt = max(now - t0, 1e-6)
            mine = [c for c in cpus if self.cpus is None or c in self.cpus]
            busy = sum(cpus[c][0] - cpus0.get(c, (0, 0))[0] for c in mine if c in cpus0)
            total = sum(cpus[c][1] - cpus0.get(c, (0, 0))[1] for c in mine if c in cpus0)
            out["host_cpu"] = 100.0 * busy / total if total > 0 else None
            # a process born since the last sample spent its whole CPU time in between
            ticks = sum(t - procs0.get(pid, 0) for pid, (t, _) in procs.items())
            out["proc_cpu"] = 100.0 * ticks / self.ticks / dt
            out["disk_read"] = (disk - disk0) / dt if disk is not None and disk0 is not None else None
        self._last = (now, cpus, {pid: t for pid, (t, _) in procs.items()}, disk)
        return out


