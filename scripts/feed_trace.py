#!/usr/bin/env python3
"""What a torch.profiler trace says about feeding the GPU: idle gaps, who was late, streams, syncs.

Reads the Chrome trace that `torch.profiler.profile.export_chrome_trace` writes (CPU and CUDA
activities) and reduces a window of training steps to the numbers that explain a step slower than
the model's own speed:

- GPU idle: the time no kernel, copy or memset runs on any stream, in total, per step, and as a
  histogram of gaps (a few microseconds between back-to-back kernels is the GPU's own switching; a
  gap of 0.1 ms or more is the GPU waiting for the CPU);
- each gap's cause: the GPU work that ended it was either queued before the gap began (it waited on
  another stream or an event), or launched during the gap by some thread, the CPU being late; then
  what that thread ran meanwhile, as exclusive time per CPU op, runtime call, annotation or Python
  frame, and the time no event covers (`BETWEEN`: Python between torch calls, waiting for the GIL,
  or a thread blocked and idle);
- the streams: per stream its kernels, copies and busy time, where the H2D copies and the input
  augmentation's kernels run, and which stream the model trains on (the busiest);
- synchronisation the CPU waited for (cuda*Synchronize, blocking cudaMemcpy, pinned and device
  allocations, .item()) per thread and per step;
- the time each thread spent in the `phase:`/`feed:` annotations scripts/profile_feed.py adds.

Used by scripts/profile_feed.py; `python3 scripts/feed_trace.py TRACE.json[.gz]` prints one summary.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: trace categories of work on the GPU, and of CPU-side events (torch 1.13 and 2.x spell them alike)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
CPU_CATS = {"cpu_op", "user_annotation", "python_function"} | LAUNCH_CATS
#: runtime calls and ops after which the calling thread has waited for the GPU (or may have); and
#: cudaStreamWaitEvent, where a stream (not the CPU) waits for another
SYNC = re.compile(r"^(cuda(Stream|Device|Event)Synchronize|cudaStreamWaitEvent|cudaMemcpy|cudaMemcpy2D|"
                  r"cudaHostAlloc|cudaMallocHost|cudaFreeHost|cudaMalloc|cudaFree|cuMemAlloc.*|cuMemFree.*|aten::_local_scalar_dense|"
                  r"aten::item|aten::pin_memory|aten::_pin_memory)$")
#: kernels of the input augmentation (dlenv.data.gpu_aug: affine_grid + grid_sample)
FEED_KERNELS = re.compile(r"grid_sampler|affine_grid|AffineGrid", re.IGNORECASE)
#: gap histogram edges, microseconds
BUCKETS = ((0, 10, "<10us"), (10, 100, "10-100us"), (100, 1000, "0.1-1ms"), (1000, float("inf"), ">1ms"))
BETWEEN = "(no op: Python code, waiting for the GIL, or idle)"
#: a Python frame's name in with_stack traces: "file.py(123): function", "<built-in method ...>"
PY_FRAME = re.compile(r"\.py\(\d+\): |^<built-in ")
#: CUDA synchronisation activities on the GPU's timeline (enable_cuda_sync_events): waits, not work
SYNC_CAT = "cuda_sync"


@dataclass(frozen=True)
class Ev:
    """One complete ('X') event: times in microseconds."""

    cat: str
    name: str
    tid: Any
    ts: float
    dur: float
    args: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def stream(self) -> Any:
        return self.args.get("stream", self.tid)

    @property
    def correlation(self) -> Any:
        return self.args.get("correlation")


def load(path: str | Path) -> dict:
    """A trace file (.json or .json.gz) as a dict."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def events(trace: dict) -> list[Ev]:
    """The trace's complete events of the categories this module reads, sorted by start."""
    out = []
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in GPU_CATS | CPU_CATS | {SYNC_CAT}:
            continue
        out.append(Ev(cat, str(e.get("name", "")), e.get("tid"), float(e.get("ts", 0)), float(e.get("dur", 0)),
                      e.get("args") or {}))
    return sorted(out, key=lambda e: (e.ts, -e.dur))


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint (start, end) pairs."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The stretches of [lo, hi] that no interval of `busy` (merged) covers."""
    out, t = [], lo
    for a, b in busy:
        if b <= lo or a >= hi:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def own_name(e: Ev) -> str:
    """What the exclusive time of `e` is called: an op's or Python frame's own name; an annotation's own
    time is Python between the ops under it (the profiler's step annotation: plain BETWEEN)."""
    if e.cat != "user_annotation":
        return e.name
    return BETWEEN if e.name.startswith("ProfilerStep#") else f"{e.name} {BETWEEN}"


def self_segments(evs: list[Ev]) -> list[tuple[float, float, str]]:
    """Exclusive time of nested events of one thread: (start, end, name) where `name` is the innermost
    event running (`own_name`). A child that outlives its parent (a clock glitch) is clipped to it."""
    out: list[tuple[float, float, str]] = []
    stack: list[list[Any]] = []  # [event, cursor: where its own time resumes, end]

    def pop() -> None:
        e, cursor, end = stack.pop()
        if end > cursor:
            out.append((cursor, end, own_name(e)))
        if stack:
            stack[-1][1] = max(stack[-1][1], min(end, stack[-1][2]))

    for e in sorted(evs, key=lambda e: (e.ts, -e.dur)):
        while stack and stack[-1][2] <= e.ts:
            pop()
        end = e.end
        if stack:
            parent = stack[-1]
            end = min(end, parent[2])
            if e.ts > parent[1]:
                out.append((parent[1], e.ts, own_name(parent[0])))
            parent[1] = max(parent[1], e.ts)
        stack.append([e, e.ts, end])
    while stack:
        pop()
    return sorted(out)


def time_by_name(segments: list[tuple[float, float, str]], lo: float, hi: float) -> dict[str, float]:
    """Microseconds of [lo, hi] per innermost event name; the rest under BETWEEN."""
    out: dict[str, float] = defaultdict(float)
    covered = 0.0
    for a, b, name in segments:
        if b <= lo or a >= hi:
            continue
        t = min(b, hi) - max(a, lo)
        out[name] += t
        covered += t
    if hi - lo - covered > 1e-6:
        out[BETWEEN] += hi - lo - covered
    return dict(out)


def in_op(name: str) -> bool:
    """Whether exclusive time under `name` is spent inside a torch op or CUDA call (not Python, not idle)."""
    return BETWEEN not in name and not PY_FRAME.search(name)


def top(d: dict[str, float], n: int, scale: float = 1.0) -> list[list[Any]]:
    """The `n` largest entries of {name: us} as [name, value / scale] (rounded), largest first."""
    return [[k, round(v / scale, 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


def summarize(trace: dict, main_tid: Any = None, thread_names: dict | None = None, gap_us: float = 20.0,
              n_top: int = 8) -> dict[str, Any]:
    """The numbers of one profiled window (see the module docstring); times in ms unless named _us.

    Steps are the ProfilerStep#N annotations (on `main_tid`, else the thread that has them); without
    them the whole trace is one step. Gaps shorter than `gap_us` count in the totals and histogram but
    are not attributed. `thread_names` maps tids to names (others: 'tid N').
    """
    evs = events(trace)
    names = {**{k: v for k, v in (thread_names or {}).items()}}
    steps = [e for e in evs if e.name.startswith("ProfilerStep#") and e.cat in CPU_CATS]
    if steps and main_tid not in {e.tid for e in steps}:  # not given, or the trace numbers threads its own way
        main_tid = steps[0].tid
    steps = [e for e in steps if e.tid == main_tid] or steps
    cpu = [e for e in evs if e.cat in CPU_CATS]
    gpu = [e for e in evs if e.cat in GPU_CATS]
    lo = steps[0].ts if steps else min((e.ts for e in evs), default=0.0)
    hi = steps[-1].end if steps else max((e.end for e in evs), default=0.0)
    n_steps = max(1, len(steps))

    def label(tid: Any) -> str:
        if tid == main_tid:
            return "main"
        return str(names.get(tid, names.get(str(tid), f"tid {tid}")))

    launches = {e.correlation: e for e in cpu if e.cat in LAUNCH_CATS and e.correlation is not None}
    # the GPU work of this window: what the window's CPU launched (the GPU runs behind the CPU)
    window_gpu = [e for e in gpu if (c := launches.get(e.correlation)) is not None and lo <= c.ts <= hi]
    if not window_gpu:
        window_gpu = [e for e in gpu if lo <= e.ts <= hi]
    out: dict[str, Any] = {"steps": len(steps), "cpu_window_ms": round((hi - lo) / 1e3, 3)}
    by_tid: dict[Any, list[Ev]] = defaultdict(list)
    for e in cpu:
        if e.end >= lo and e.ts <= hi:  # runtime calls too: a cudaStreamSynchronize in a gap is the answer
            by_tid[e.tid].append(e)
    segs = {tid: self_segments(v) for tid, v in by_tid.items()}
    if window_gpu:
        g_lo, g_hi = min(e.ts for e in window_gpu), max(e.end for e in window_gpu)
        busy = merge([(e.ts, e.end) for e in gpu if e.end > g_lo and e.ts < g_hi])
        idle = gaps(busy, g_lo, g_hi)
        span = g_hi - g_lo
        idle_us = sum(b - a for a, b in idle)
        hist = {name: {"count": 0, "ms": 0.0} for _, _, name in BUCKETS}
        for a, b in idle:
            for b_lo, b_hi, name in BUCKETS:
                if b_lo <= b - a < b_hi:
                    hist[name]["count"] += 1
                    hist[name]["ms"] = round(hist[name]["ms"] + (b - a) / 1e3, 4)
        out["gpu"] = {"span_ms": round(span / 1e3, 3), "busy_ms": round((span - idle_us) / 1e3, 3),
                      "idle_ms": round(idle_us / 1e3, 3), "idle_share": round(idle_us / span, 4) if span else 0.0,
                      "step_ms": round(span / n_steps / 1e3, 3), "idle_per_step_ms": round(idle_us / n_steps / 1e3, 3),
                      "gaps": hist}
        out["gaps"] = _attribute(idle, gpu, launches, segs, label, gap_us, n_top, n_steps)
    out["streams"] = _streams(window_gpu or gpu, [e for e in evs if e.cat == SYNC_CAT and lo <= e.ts <= hi], n_top)
    out["syncs"] = _syncs(cpu, lo, hi, label, n_steps)
    out["threads"] = {label(tid): {"busy_ms_per_step": round(sum(min(b, hi) - max(a, lo) for a, b, name in s
                                                                  if in_op(name) and a < hi and b > lo)
                                                              / n_steps / 1e3, 3),
                                   "top_ms_per_step": top(time_by_name(s, lo, hi), n_top, 1e3 * n_steps)}
                      for tid, s in segs.items()}
    out["phases"] = _phases(cpu, lo, hi, label, n_steps)
    return out


def _attribute(idle: list[tuple[float, float]], gpu: list[Ev], launches: dict, segs: dict, label: Any, gap_us: float,
               n_top: int, n_steps: int) -> dict[str, Any]:
    """Each idle gap of at least `gap_us`: queued work waiting on a dependency, or a late launch (by which
    thread, and what that thread and the main thread ran meanwhile)."""
    starts = sorted(gpu, key=lambda e: e.ts)
    k = 0
    waiting, late = 0.0, defaultdict(float)
    late_on: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    main_during: dict[str, float] = defaultdict(float)
    main_tid = next((t for t in segs if label(t) == "main"), None)
    largest = []
    for a, b in idle:
        if b - a < gap_us:
            continue
        while k < len(starts) and starts[k].ts < b:
            k += 1
        nxt = starts[k] if k < len(starts) else None
        launch = launches.get(nxt.correlation) if nxt is not None else None
        if launch is None or launch.ts <= a:
            waiting += b - a
            cause = "queued before the gap (waits on another stream or event)"
        else:
            who = label(launch.tid)
            late[who] += b - a
            cause = f"launched late by {who}"
            for name, t in time_by_name(segs.get(launch.tid, []), a, min(b, launch.ts)).items():
                late_on[who][name] += t
        if main_tid is not None:
            for name, t in time_by_name(segs[main_tid], a, b).items():
                main_during[name] += t
        largest.append((b - a, cause, nxt.name[:80] if nxt is not None else "-"))
    largest.sort(key=lambda x: -x[0])
    return {"attributed_ms": round((waiting + sum(late.values())) / 1e3, 3),
            "queued_waiting_ms": round(waiting / 1e3, 3),
            "late_launch_ms": {k: round(v / 1e3, 3) for k, v in late.items()},
            "late_thread_top_ms": {who: top(d, n_top, 1e3) for who, d in late_on.items()},
            "main_thread_during_gaps_ms": top(main_during, n_top, 1e3),
            "largest": [[round(t / 1e3, 3), cause, name] for t, cause, name in largest[:n_top]],
            "per_step_ms": round((waiting + sum(late.values())) / n_steps / 1e3, 3)}


def _streams(gpu: list[Ev], syncs: list[Ev], n_top: int) -> dict[str, Any]:
    per: dict[Any, dict[str, Any]] = {}
    waits: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in syncs:
        w = waits[e.stream][e.name]
        w[0] += 1
        w[1] += e.dur / 1e3
    for e in gpu:
        s = per.setdefault(e.stream, {"kernels": 0, "kernel_ms": 0.0, "copies": defaultdict(lambda: [0, 0.0, 0]),
                                      "feed_kernels": 0, "names": defaultdict(float)})
        if e.cat == "kernel":
            s["kernels"] += 1
            s["kernel_ms"] += e.dur / 1e3
            s["names"][e.name[:60]] += e.dur
            s["feed_kernels"] += bool(FEED_KERNELS.search(e.name))
        else:
            c = s["copies"][e.name.split(" (")[0] if e.cat == "gpu_memcpy" else "Memset"]
            c[0] += 1
            c[1] += e.dur / 1e3
            c[2] += int(e.args.get("bytes", 0) or 0)
    compute = max(per, key=lambda k: per[k]["kernel_ms"], default=None)
    out = {}
    for sid, s in per.items():
        role = ["model (busiest)"] if sid == compute else []
        if s["feed_kernels"]:
            role.append("input augmentation")
        if any(k.startswith("Memcpy HtoD") for k in s["copies"]):
            role.append("H2D copies")
        out[str(sid)] = {"role": ", ".join(role) or "-", "kernels": s["kernels"], "kernel_ms": round(s["kernel_ms"], 3),
                         "augmentation_kernels": s["feed_kernels"],
                         "copies": {k: {"count": v[0], "ms": round(v[1], 3), "MB": round(v[2] / 1e6, 1)}
                                    for k, v in s["copies"].items()},
                         "top_kernels_ms": top(s["names"], n_top, 1e3),
                         "sync_events": {k: {"count": c, "ms": round(ms, 3)} for k, (c, ms) in waits[sid].items()}}
    return out


def _syncs(cpu: list[Ev], lo: float, hi: float, label: Any, n_steps: int) -> dict[str, Any]:
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in cpu:
        if lo <= e.ts <= hi and SYNC.match(e.name):
            v = out[label(e.tid)][e.name]
            v[0] += 1
            v[1] += e.dur / 1e3
    return {who: {name: {"per_step": round(c / n_steps, 2), "ms_per_step": round(ms / n_steps, 3)}
                  for name, (c, ms) in d.items()} for who, d in out.items()}


def _phases(cpu: list[Ev], lo: float, hi: float, label: Any, n_steps: int) -> dict[str, Any]:
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in cpu:
        if e.name.startswith(("phase:", "feed:")) and lo <= e.ts <= hi:
            v = out[f"{label(e.tid)} {e.name}"]
            v[0] += 1
            v[1] += e.dur / 1e3
    return {k: {"per_step": round(c / n_steps, 2), "ms_per_step": round(ms / n_steps, 3)} for k, (c, ms) in out.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: feed_trace.py TRACE.json[.gz]", file=sys.stderr)
        return 2
    try:
        trace = load(argv[0])
    except (OSError, ValueError) as e:
        print(f"feed_trace: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summarize(trace), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
