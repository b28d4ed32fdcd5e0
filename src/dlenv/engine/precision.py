"""The one mixed-precision path: fp32, fp16 with a GradScaler, or bf16, chosen once.

The training loop holds one `Precision` and calls the same four things whatever the mode:

    with precision.autocast():
        loss = criterion(model(x), y) / accum_steps
    precision.backward(loss)
    if last_micro_batch:
        stepped = precision.step(optimizer, clip=1.0)   # unscale, clip, step; False if fp16 skipped it
        optimizer.zero_grad(set_to_none=True)

In fp32 the autocast is a no-op and the scaler is a disabled GradScaler (scale() returns the loss,
step() just steps), so "off" is the same code, not a branch. bf16 has fp32's exponent range and needs
no loss scaling; fp16 does, and its scaler skips a step whose gradients overflowed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from dlenv import compat
from dlenv.errors import UserError

MODES = ("fp32", "fp16", "bf16")
#: each mode's compute dtype: the one table of it
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _device_type(device: Any) -> str:
    return torch.device(device).type


def resolve_precision(amp: bool, amp_dtype: str, device: Any) -> str:
    """The precision mode for --amp / --amp-dtype on `device`: "fp32", "fp16" or "bf16".

    No AMP is fp32. On CUDA, auto is bf16 where the GPU supports it (Ampere and newer), else fp16.
    On CPU, AMP is bf16 (CPU autocast has no fp16). Raises UserError for fp16 on CPU, bf16 on a GPU
    without it, or an unknown dtype.
    """
    if amp_dtype not in ("auto", "fp16", "bf16"):
        raise UserError(f"--amp-dtype {amp_dtype!r} is not one of auto, fp16, bf16")
    if not amp:
        return "fp32"
    kind = _device_type(device)
    if kind == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if amp_dtype == "auto":
            return "bf16" if bf16_ok else "fp16"
        if amp_dtype == "bf16" and not bf16_ok:
            raise UserError(f"--amp-dtype bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
                            "use --amp-dtype fp16 (or auto)")
        return amp_dtype
    if kind == "cpu":
        if amp_dtype == "fp16":
            raise UserError("--amp-dtype fp16 on the CPU: CPU autocast computes in bfloat16; "
                            "use --amp-dtype bf16 (or auto), or train on a GPU for fp16")
        return "bf16"
    raise UserError(f"--amp on device {device!s}: mixed precision here supports cuda and cpu only")


#: steps timed per mode by `cpu_probe_seconds` (after one untimed step), and its images per step: a probe of
#: a second or so on any CPU, not the run's model (minutes for a large one under load, as issue 45 met)
_CPU_PROBE_STEPS, _CPU_PROBE_BATCH = 3, 4
#: /proc/cpuinfo flags of bfloat16 arithmetic in hardware: x86's AVX-512 BF16 and AMX, Arm's BF16 extension
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


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


def decide_precision(amp: bool, amp_dtype: str, device: Any,
                     step_seconds: Callable[[str], float] | None = None,
                     cache: str | Path | None = None, what: str = "", native: bool | None = None) -> tuple[str, str]:
    """(mode, why): the precision a run trains in, and the sentence config.yaml and the log give for it.

    As `resolve_precision`, except that --amp on a CPU never makes the run slower: with --amp-dtype auto,
    `step_seconds(mode)` times this model's training step in fp32 and bf16, and bf16 is kept only where
    it was faster. (Many CPUs emulate bfloat16, and autocast's casts then cost more than they save;
    docs/training.md has the measurements.) --amp-dtype bf16 forces bf16. `native` (`cpu_bf16_native`)
    decides without timing where the CPU's flags say it has no bfloat16 instructions (False): fp32.

    `cache` (`cpu_amp_cache()`): a file that keeps the verdict per CPU model, torch version, thread
    count and `what` (the model and size step_seconds times), so the timing happens once per machine,
    not at every start. A cache that cannot be read, holds nonsense or cannot be written only
    means measuring again.
    """
    mode = resolve_precision(amp, amp_dtype, device)
    kind = _device_type(device)
    if mode == "fp32":
        return mode, "no --amp"
    if kind != "cpu" or amp_dtype != "auto" or step_seconds is None:
        return mode, f"--amp --amp-dtype {amp_dtype} on {kind}"
    if native is False:
        return "fp32", ("--amp on this CPU: it has no bfloat16 instructions (no avx512_bf16, amx_bf16 or bf16 in "
                        "/proc/cpuinfo), so autocast would emulate bf16 and run slower: training in fp32; "
                        "--amp-dtype bf16 forces bf16")
    key = _machine_key(what)
    ratio = _kept_ratio(Path(cache), key) if cache is not None else None
    if ratio is not None:
        return _cpu_verdict(ratio, f"measured once on this CPU, kept in {cache}")
    fp32 = step_seconds("fp32")
    try:
        bf16 = step_seconds("bf16")
    except RuntimeError as e:  # an op of this model without a bf16 CPU kernel: fp32 trains, bf16 cannot
        return "fp32", f"--amp on this CPU: a bf16 step failed ({str(e).splitlines()[0][:160]}), so training in fp32"
    ratio = bf16 / fp32
    if cache is not None:
        _keep_ratio(Path(cache), key, ratio)
    return _cpu_verdict(ratio, "measured")


def _cpu_verdict(ratio: float, how: str) -> tuple[str, str]:
    """(mode, why) for a bf16 step that took `ratio` times fp32's."""
    if ratio < 1:
        return "bf16", f"--amp on this CPU: a bf16 step took {ratio:.2f}x the time of fp32's ({how})"
    return "fp32", (f"--amp on this CPU: a bf16 step took {ratio:.2f}x the time of fp32's ({how}: the CPU "
                    "emulates bfloat16), so training in fp32; --amp-dtype bf16 forces bf16")


#: bounds on the CPU AMP cache: a ratio outside them is not a measurement but a damaged file; the file
#: keeps the newest _CACHE_ENTRIES verdicts and is not read past _CACHE_BYTES
_RATIO_RANGE, _CACHE_ENTRIES, _CACHE_BYTES = (0.01, 100.0), 64, 64 * 1024


#: the verdicts' file in the working folder: the mounted workspace, which outlives the container and is
#: writable for `docker run --user` where HOME (often /tmp or /) is not kept
WORKSPACE_CACHE = Path(".dlenv") / "cpu-amp.json"


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


def _machine_key(what: str) -> str:
    key = f"{_cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    return f"{key} | {what[:200]}" if what else key


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's verdicts ({key: {"bf16_over_fp32": ratio}}), {} when it is missing or unreadable."""
    from dlenv.files.safeio import read_text

    try:
        data = json.loads(read_text(path, _CACHE_BYTES, "CPU AMP cache"))
    except (OSError, UserError, ValueError):  # missing, not a regular file, too big, not UTF-8 or JSON
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) and data.get("version") == 1 else None
    return verdicts if isinstance(verdicts, dict) else {}


def _kept_ratio(path: Path, key: str) -> float | None:
    return _ratio_of(_read_cache(path).get(key))


def _ratio_of(entry: Any) -> float | None:
    """An entry's bf16/fp32 time ratio, or None unless it is a number within _RATIO_RANGE."""
    ratio = entry.get("bf16_over_fp32") if isinstance(entry, dict) else None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        return None
    return float(ratio) if _RATIO_RANGE[0] <= ratio <= _RATIO_RANGE[1] else None  # nan fails both


def _keep_ratio(path: Path, key: str, ratio: float) -> None:
    """Add the verdict to the cache atomically; any failure is silent (the next run measures again)."""
    from dlenv.files.atomic import write_atomic

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


def cpu_probe_seconds(mode: str) -> float:
    """The fastest of a few training steps of a small fixed network (two convolutions and a linear head,
    _CPU_PROBE_BATCH images of 32x32) on the CPU in `mode`: what bf16 costs here against fp32, in about a
    second whatever the run's model; for `decide_precision`. The caller's random streams are left alone."""
    import time

    from torch import nn

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


def cpu_checkpoint_ratio(blocks: int) -> tuple[float, str]:
    """(fraction of blocks recomputed, why) for --checkpoint --checkpoint-ratio auto on a CPU: none.
    Checkpointing trades compute for memory, and a CPU run is rarely short of memory: each recomputed
    block runs its forward twice (docs/benchmarks.md has the cost measured)."""
    return 0.0, (f"auto: none of {blocks} blocks on a CPU: recomputing a block costs its forward again, to save "
                 "memory a CPU run rarely lacks; --checkpoint-ratio 1 recomputes them all")


class Precision:
    """Autocast, loss scaling and the optimizer step for one precision mode.

    `mode` is "fp32", "fp16" or "bf16"; `device` where the model runs. `scaler` replaces the default
    GradScaler for fp16 (e.g. another init_scale); bf16 and fp32 take none. Raises ValueError for an
    unknown mode, fp16 on the CPU, or a scaler given to bf16/fp32.
    """

    def __init__(self, mode: str, device: Any = "cuda", scaler: Any = None):
        if mode not in MODES:
            raise ValueError(f"precision mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.device_type = _device_type(device)
        self.dtype = DTYPES[mode]
        if mode == "fp16" and self.device_type != "cuda":
            raise ValueError(f"fp16 precision needs a CUDA device, not {device!s} (CPU autocast is bf16)")
        if scaler is not None and mode != "fp16":
            raise ValueError(f"{mode} precision takes no GradScaler: only fp16 needs loss scaling")
        self.scaler = scaler if scaler is not None else compat.grad_scaler(enabled=mode == "fp16")

    def __repr__(self) -> str:
        return f"Precision({self.mode!r}, {self.device_type!r})"

    def autocast(self) -> Any:
        """The forward's context: autocast to fp16/bf16, or a no-op for fp32."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return compat.autocast(self.device_type, self.dtype, enabled=True)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), on the scaled loss in fp16 so small gradients don't flush to zero."""
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: float | None = None,
             parameters: Iterable[torch.Tensor] | None = None) -> bool:
        """Unscale the gradients, clip their total norm to `clip` if given, step the optimizer.

        `parameters` are the ones to clip (default: all in the optimizer). Returns False when fp16
        skipped the step because a gradient was inf/NaN (the scaler then lowers its scale), else True.
        Does not zero the gradients.
        """
        if clip is not None:
            # Clip the true gradients: in fp16 they are still multiplied by the loss scale here.
            self.scaler.unscale_(optimizer)
            if parameters is None:
                parameters = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, clip)
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it found inf/NaN and skipped optimizer.step().
        return self.scaler.get_scale() >= scale

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (fp16), {} for fp32 and bf16."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what state_dict() gave; an empty state (from an fp32/bf16 run) keeps the fresh scaler."""
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
