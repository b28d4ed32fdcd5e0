"""What this CPU does with bfloat16, for `--amp` on a CPU (dlenv.train.auto.decide_precision decides):
whether it computes bfloat16 in hardware (its /proc/cpuinfo flags), what a bf16 training step costs
against fp32 (`cpu_probe_seconds`: a small fixed network timed for a second or so), and the verdict kept
per machine in `.dlenv/cpu-amp.json` (`cpu_amp_cache`), so the timing happens once per machine, not at
every start. A cache that cannot be read, holds nonsense or cannot be written only means measuring again.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv.engine.precision import Precision
from dlenv.errors import UserError
from dlenv.files.atomic import write_atomic
from dlenv.files.safeio import read_text

#: steps timed per mode by `cpu_probe_seconds` (after one untimed step), and its images per step: a probe of
#: a second or so on any CPU, not the run's model (minutes for a large one under load, as issue 45 met)
_CPU_PROBE_STEPS, _CPU_PROBE_BATCH = 3, 4
#: /proc/cpuinfo flags of bfloat16 arithmetic in hardware: x86's AVX-512 BF16 and AMX, Arm's BF16 extension
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
#: bounds on the CPU AMP cache: a ratio outside them is not a measurement but a damaged file; the file
#: keeps the newest _CACHE_ENTRIES verdicts and is not read past _CACHE_BYTES
_RATIO_RANGE, _CACHE_ENTRIES, _CACHE_BYTES = (0.01, 100.0), 64, 64 * 1024
#: the verdicts' file in the working folder: the mounted workspace, which outlives the container and is
#: writable for `docker run --user` where HOME (often /tmp or /) is not kept
WORKSPACE_CACHE = Path(".dlenv") / "cpu-amp.json"


def cpu_bf16_native(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU computes bfloat16 in hardware, from the first CPU's flags in /proc/cpuinfo (x86
    "flags", Arm "Features"): True with avx512_bf16, amx_bf16 or Arm's bf16; False without them (autocast
    would emulate bf16 in fp32 and only add casts); None where there is no /proc/cpuinfo to read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = "".join(itertools.islice(fh, 200))  # the first CPU's block holds its flags
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return bool(_BF16_FLAGS & set(value.split()))
    return None


def cpu_probe_seconds(mode: str) -> float:
    """The fastest of a few training steps of a small fixed network (two convolutions and a linear head,
    _CPU_PROBE_BATCH images of 32x32) on the CPU in `mode`: what bf16 costs here against fp32, in about a
    second whatever the run's model; for `decide_precision`. The caller's random streams are left alone."""
    with torch.random.fork_rng(devices=[]):
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(),
                              nn.Linear(256, 10)).train()
        x = torch.randn(_CPU_PROBE_BATCH, 3, 32, 32)
        y = torch.randint(0, 10, (_CPU_PROBE_BATCH,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prec, best = Precision(mode, "cpu"), float("inf")
    for i in range(_CPU_PROBE_STEPS + 1):
        t = time.perf_counter()
        with prec.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        if i:  # the first step allocates and picks kernels
            best = min(best, time.perf_counter() - t)
    return best


def cpu_amp_cache() -> Path | None:
    """Where `decide_precision` keeps its CPU verdicts: .dlenv/cpu-amp.json in the working folder (your
    project, /root/workspace in the image) where that folder can be written; else $XDG_CACHE_HOME/dlenv/
    cpu-amp.json, else ~/.cache/dlenv/cpu-amp.json (a relative XDG_CACHE_HOME is ignored, as the XDG spec
    says); None where there is neither."""
    folder = Path.cwd() / WORKSPACE_CACHE.parent
    # a folder there to write into, or one that can be made (access() says no on a read-only mount)
    if (folder.is_dir() and os.access(folder, os.W_OK)) or (not folder.exists() and os.access(Path.cwd(), os.W_OK)):
        return Path.cwd() / WORKSPACE_CACHE
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    except (KeyError, RuntimeError):  # no HOME and no passwd entry (docker run --user 12345)
        return None
    return root / "dlenv" / "cpu-amp.json"


def _cpu_name() -> str:
    """The CPU's model string (/proc/cpuinfo's first "model name"), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in itertools.islice(fh, 100):  # the first CPU's block names it
                name, _, value = line.partition(":")
                if name.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key(what: str) -> str:
    """The cache's key for a verdict: the CPU model, the torch version, the thread count and `what` was
    timed (the model and size)."""
    key = f"{_cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    return f"{key} | {what[:200]}" if what else key


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's verdicts ({key: {"bf16_over_fp32": ratio}}), {} when it is missing or unreadable."""
    try:
        data = json.loads(read_text(path, _CACHE_BYTES, "CPU AMP cache"))
    except (OSError, UserError, ValueError):  # missing, not a regular file, too big, not UTF-8 or JSON
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) and data.get("version") == 1 else None
    return verdicts if isinstance(verdicts, dict) else {}


def kept_ratio(path: Path, key: str) -> float | None:
    """The bf16/fp32 step-time ratio the cache at `path` keeps for `key`, or None (none kept, or nonsense)."""
    return _ratio_of(_read_cache(path).get(key))


def _ratio_of(entry: Any) -> float | None:
    """An entry's bf16/fp32 time ratio, or None unless it is a number within _RATIO_RANGE."""
    ratio = entry.get("bf16_over_fp32") if isinstance(entry, dict) else None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        return None
    return float(ratio) if _RATIO_RANGE[0] <= ratio <= _RATIO_RANGE[1] else None  # nan fails both


def keep_ratio(path: Path, key: str, ratio: float) -> None:
    """Add the verdict to the cache atomically; any failure is silent (the next run measures again)."""
    entry = {"bf16_over_fp32": round(ratio, 4)} if math.isfinite(ratio) else None
    if _ratio_of(entry) is None:
        return
    verdicts = {k: v for k, v in _read_cache(path).items() if k != key and _ratio_of(v) is not None}
    verdicts[key] = entry
    verdicts = dict(list(verdicts.items())[-_CACHE_ENTRIES:])  # the newest; a file that cannot grow
    text = json.dumps({"version": 1, "verdicts": verdicts}, indent=1) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    except (OSError, UserError):
        pass
