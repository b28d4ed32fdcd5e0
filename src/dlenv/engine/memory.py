"""GPU memory: what a run uses, what the allocator is doing, and what to do when it runs out.

- `MemoryMonitor`: `record_memory(phase)` at points of a step (it reads the allocator's counters on
  the host: no synchronisation, no slowdown); `generate_report()` gives mean/max/min allocated and
  reserved GiB per phase as a pandas DataFrame.
- `diagnose()`: the allocator's state in words: allocated, reserved, fragmentation, the largest free
  block, and what to try. `run_report()` puts both in the memory.md the trainer writes each epoch.
- `oom_message()`: the one message the trainer prints on CUDA out of memory, with the batch, the
  peak, the card's size and the next things to try, in order.

We never call `torch.cuda.empty_cache()` on a timer: it makes the allocator return and re-request
memory from the driver (slow, synchronising) and does not lower the peak a step needs. Setting
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (PyTorch 2.1+) is the fix for fragmentation.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any

import torch

from dlenv import compat

GIB = 1024 ** 3


def _device(device: Any = None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class MemoryMonitor:
    """Allocated and reserved GPU memory per phase of a step (forward, backward, step, ...).

    On a CPU device every reading is 0, so the trainer calls it unconditionally. Statistics are kept
    as running sums per phase, so a long run costs no memory.
    """

    def __init__(self, device: Any = None, held: int = 0):
        self.enabled = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        self.device = _device(device) if self.enabled else torch.device("cpu")
        # bytes the process held before the run began (a notebook's tensors): not this run's, so the
        # peaks leave them out and a run reports the same in any process
        self.held = held
        # phase -> [count, sum_alloc, max_alloc, min_alloc, sum_res, max_res, min_res] in bytes
        self._stats: dict[str, list[float]] = {}

    def record_memory(self, phase: str) -> tuple[float, float]:
        """Record allocated and reserved memory now under `phase`; returns them in GiB."""
        if self.enabled:
            a = float(torch.cuda.memory_allocated(self.device))
            r = float(torch.cuda.memory_reserved(self.device))
        else:
            a = r = 0.0
        s = self._stats.get(phase)
        if s is None:
            self._stats[phase] = [1, a, a, a, r, r, r]
        else:
            s[0] += 1
            s[1] += a
            s[2], s[3] = max(s[2], a), min(s[3], a)
            s[4] += r
            s[5], s[6] = max(s[5], r), min(s[6], r)
        return a / GIB, r / GIB

    def peak(self, reset: bool = False) -> tuple[float, float]:
        """Peak allocated and reserved GiB since the last reset (0, 0 on CPU); optionally reset them."""
        if not self.enabled:
            return 0.0, 0.0
        a = max(0, torch.cuda.max_memory_allocated(self.device) - self.held) / GIB
        r = max(0, torch.cuda.max_memory_reserved(self.device) - self.held) / GIB
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return a, r

    def reset(self) -> None:
        """Forget the recorded phases."""
        self._stats.clear()

    def generate_report(self):
        """A DataFrame indexed by phase: samples, alloc_mean/max/min_gib, reserved_mean/max/min_gib."""
        import pandas as pd

        rows = []
        for phase, (n, sa, ma, mina, sr, mr, minr) in self._stats.items():
            rows.append({"phase": phase, "samples": int(n),
                         "alloc_mean_gib": sa / n / GIB, "alloc_max_gib": ma / GIB, "alloc_min_gib": mina / GIB,
                         "reserved_mean_gib": sr / n / GIB, "reserved_max_gib": mr / GIB,
                         "reserved_min_gib": minr / GIB})
        cols = ["phase", "samples", "alloc_mean_gib", "alloc_max_gib", "alloc_min_gib",
                "reserved_mean_gib", "reserved_max_gib", "reserved_min_gib"]
        return pd.DataFrame(rows, columns=cols).set_index("phase")


def _segments(device: torch.device) -> tuple[int, int, int] | None:
    """From memory_snapshot: (largest free block, bytes of segments holding tensors, bytes allocated in
    them), or None where the snapshot is unavailable."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # the snapshot API differs between releases; the diagnosis works without it
        return None
    largest = used_total = used_alloc = 0
    for seg in segments:
        if seg.get("device", device.index) != device.index:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "inactive":
                largest = max(largest, int(block.get("size", 0)))
        if seg.get("allocated_size", 0) > 0:
            used_total += int(seg.get("total_size", 0))
            used_alloc += int(seg["allocated_size"])
    return largest, used_total, used_alloc


def diagnose(device: Any = None) -> str:
    """The allocator's state in a few plain sentences, with what to try. A CPU-only machine says so."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: nothing to diagnose (memory on the CPU is the operating system's)."
    d = _device(device)
    stats = torch.cuda.memory_stats(d)
    alloc = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    peak = stats.get("allocated_bytes.all.peak", 0)
    total = torch.cuda.get_device_properties(d).total_memory
    seg = _segments(d)
    # fragmentation: the share of the segments that hold tensors which is free but cached
    if seg is not None and seg[1]:
        frag = 1 - seg[2] / seg[1]
    else:
        frag = 1 - alloc / reserved if reserved else 0.0
    largest = seg[0] if seg is not None else None
    lines = [f"{torch.cuda.get_device_name(d)}: {alloc / GIB:.2f} GiB allocated by tensors, "
             f"{reserved / GIB:.2f} GiB reserved by the caching allocator (peak allocated "
             f"{peak / GIB:.2f} GiB) of {total / GIB:.1f} GiB on the card."]
    free_txt = f"; the largest free block is {largest / GIB:.2f} GiB" if largest is not None else ""
    lines.append(f"Fragmentation: {frag:.0%} of the segments holding tensors is cached but unused{free_txt}.")
    retries = stats.get("num_alloc_retries", 0)
    if retries:
        lines.append(f"The allocator had to free its cache and retry {retries} times (slow, and a sign "
                     "the run is close to the limit).")
    advice = []
    if frag > 0.3 and reserved > 0.5 * total:
        if compat.HAS_EXPANDABLE_SEGMENTS:
            advice.append("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting "
                          "(lets segments grow instead of fragmenting)")
        else:
            advice.append("set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 before starting "
                          "(limits splitting of large blocks)")
    if peak > 0.8 * total:
        advice.append("lower the peak: --amp, then --checkpoint, then a smaller --batch-size with "
                      "--accum-steps")
    lines.append("What to try: " + ("; ".join(advice) + "." if advice else
                                    "nothing: memory use looks healthy."))
    return "\n".join(lines)


def run_report(monitor: MemoryMonitor) -> str:
    """memory.md of a training run: GiB allocated and reserved per phase of the step (`generate_report`,
    sampled every few micro-batches) and the allocator's state now (`diagnose`)."""
    report = monitor.generate_report()
    lines = ["# GPU memory of this run", "",
             "Allocated and reserved GiB at each phase of the training step, sampled every few micro-batches:", "",
             "| phase | samples | allocated mean | allocated max | reserved mean | reserved max |",
             "|---|---:|---:|---:|---:|---:|"]
    for phase, r in report.iterrows():
        lines.append(f"| {phase} | {int(r['samples'])} | {r['alloc_mean_gib']:.2f} | {r['alloc_max_gib']:.2f} | "
                     f"{r['reserved_mean_gib']:.2f} | {r['reserved_max_gib']:.2f} |")
    lines += ["", "## The allocator now", "", diagnose(monitor.device if monitor.enabled else None)]
    return "\n".join(lines) + "\n"


def oom_message(batch_size: int, accum_steps: int, peak_gib: float, total_gib: float, amp: bool,
                checkpoint: bool) -> str:
    """The message for a CUDA out-of-memory stop: what happened and what to try next, in order.

    Suggestions skip what is already on; the smaller batch keeps the effective batch with accumulation.
    """
    head = (f"CUDA out of memory at micro-batch {batch_size} (accumulation {accum_steps}): the run had "
            f"reached {peak_gib:.2f} GiB allocated of the card's {total_gib:.1f} GiB. The last good "
            "run file is intact.")
    tries = []
    if not amp:
        tries.append("--amp (half-size activations, usually faster too)")
    if not checkpoint:
        tries.append("--checkpoint (recompute block activations in the backward pass)")
    if batch_size > 1:
        half = max(1, batch_size // 2)
        tries.append(f"--batch-size {half} --accum-steps {accum_steps * 2} (same images per optimizer "
                     "step)")
    else:
        tries.append("a smaller --img-size or a smaller --model")
    tries.append("or --batch-size auto to find the largest batch that fits")
    return head + " Try, in order: " + "; ".join(f"{i}) {t}" for i, t in enumerate(tries, 1)) + "."


def start_clean(device: torch.device) -> int:
    """Before a run measures anything on `device`: collect the process's garbage, return the cached blocks,
    and return the bytes still allocated (what the process holds that is not this run's).

    Both steps matter (docs/memory.md, "A run's numbers in any process"). An exception kept alive keeps
    the frames of the step that raised it, and their activations: a caught CUDA out-of-memory held 134 GiB
    of an H200 until Python's cycle collector happened to run, so the next run in the process peaked at
    the whole card and trained 30x slower. Cached free blocks are the other part: cuDNN's autotuner may
    take the largest as workspace.
    """
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def release_failed_step(exc: BaseException | None) -> None:
    """Free what a failed step's exception keeps alive: the locals of every finished frame of its traceback
    and of the exceptions it chains (activations, gradients), then the garbage and the cached blocks.

    Call it where an out-of-memory error becomes the user's one line: the user's process (a notebook
    keeps its last exception) then no longer holds the failed step's memory.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # skips the frames still running
        exc = exc.__cause__ or exc.__context__
    release_cached()


def release_cached() -> None:
    """After a run or a probe is over: collect its garbage, then give back the BLAS workspaces and the cached
    blocks, so what stays allocated is what the caller's own tensors hold (a notebook's next cell starts
    where the first began). Not between the steps of a run: the workspaces and blocks would be taken again."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        compat.clear_blas_workspaces()
        torch.cuda.empty_cache()
