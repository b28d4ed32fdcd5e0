#!/usr/bin/env python3
"""The ceiling, measured in one call (issue 55): a plain PyTorch loop's best, against dlenv's default long run.

The plain loop has no dlenv code in it: torchvision's model (weights=None, 1000 classes), one fixed random batch
of images and labels already on the device, model and batch in channels_last, bf16 autocast, CrossEntropyLoss,
`loss.backward()`, `opt.step()`, `opt.zero_grad(set_to_none=True)`; cudnn.benchmark on CUDA, as the trainer
sets it. Rows: each mode (eager, torch.compile's default, reduce-overhead (CUDA graphs, with
torch.compiler.cudagraph_mark_step_begin each step) and max-autotune-no-cudagraphs) with each optimizer
(sgd-foreach: SGD lr 0.1, momentum 0.9, Nesterov, weight decay 5e-5, foreach; adamw-fused: AdamW lr 1e-3,
weight decay 0.05, fused). A mode is compiled once, then both optimizers are timed on it, each fresh (the
optimizer step is outside the compiled graph): --warmup steps (a compiled mode's compile falls in the first
optimizer's, whose warm-up seconds include it), then --steps timed ones between two synchronizes.

dlenv's row is `dlenv.train.train` on --synthetic data with --amp and every other option at its default,
--compile auto and --optimizer auto included. Both autos count the run's planned steps: epochs x batches per
epoch, where --max-steps S caps an epoch (a synthetic epoch is S batches); --compile auto compiles from
3,000 planned micro-batches (dlenv.train.auto.COMPILE_MIN_BATCHES), --optimizer auto takes SGD from 10,000
planned optimizer steps (dlenv.engine.optim.AUTO_SGD_FROM_STEPS). A short run cannot plan a long one, so this
row plans what a long run plans (epochs = ceil(10,000 / S), S = --dlenv-steps) and is stopped as Ctrl-C stops
a run: a SIGINT at the last step of epoch --dlenv-epochs, the epoch's results.csv row written (as
scripts/bench_train.py's "long" rows do). Its img/s is that epoch's (results.csv's img_per_s; the earlier
epochs compile and warm up), its warm-up seconds run from train() to the measured epoch, and what the autos
chose is read from the run's config.yaml into the row's note. On a CPU, --compile auto does not compile.

Each mode and dlenv's row run in a child process of this script, one after the other, cheap ones first:
eager, default, dlenv's row, reduce-overhead, max-autotune-no-cudagraphs. A child may use what is left of
--budget less the seconds RESERVE_S keeps for the children after it (at least its own reserve, never more than
is left); one that runs out of time is killed with its process group (Inductor's compile workers too) and its
rows read "not measured: compile took over N s". A child that stops on an error gets a "failed" row; the
others still run. Compiled children share Inductor's on-disk cache (its default folder): a later compile of
the same graph may be quicker than a first one, which changes warm-up seconds, not img/s.

--profile: each child then runs torch.profiler (CUDA activity; once more with CPU activity too where that
recorded no kernel) over PROFILE_STEPS steps of its fastest row (dlenv's: of the epoch after the measured one,
which the stop then cuts short), and bench_ceiling_profile.md gets, for the best plain row and dlenv's, the top
kernels by total time and the GPU's busy share of the profiled span (the union of kernel intervals against first
start to last end). A failed profile costs no measurement.

    python3 scripts/bench_ceiling.py --out /tmp/ceiling                      # one H100 or H200, --budget 240
    python3 scripts/bench_ceiling.py --modes eager,default --no-dlenv --out /tmp/c
    python3 scripts/bench_ceiling.py --device cpu --model resnet18 --batch-size 4 --img-size 64 --steps 2 \\
        --warmup 1 --out /tmp/c                                              # a check of the script on a CPU

Writes bench_ceiling.csv and bench_ceiling.md to --out after every child (a call cut short keeps what was
measured), and bench_ceiling_profile.md with --profile; prints the table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the plain loop's modes, cheap ones first; "eager" is no torch.compile, "default" torch.compile(model)
MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
OPTIMIZERS = ("sgd-foreach", "adamw-fused")
DLENV = "dlenv default long run"
#: the order children run in: dlenv's row after the cheap plain ones, before the compiles that may not end
ORDER = ("eager", "default", DLENV, "reduce-overhead", "max-autotune-no-cudagraphs")
#: seconds each child is kept for while the ones before it run (a guess at what it needs on an H100 at the
#: defaults; max-autotune gets only what is left over)
RESERVE_S = {"eager": 25.0, "default": 60.0, DLENV: 70.0, "reduce-overhead": 60.0, "max-autotune-no-cudagraphs": 0.0}
#: seconds kept back from the last child: killing it and writing the tables
MARGIN_S = 5.0
#: a child is not started with fewer seconds than this left
MIN_START_S = 10.0
PROFILE_STEPS = 8
TOP_KERNELS = 15
COLUMNS = ["mode", "optimizer", "img_s", "ms_per_step", "warmup_s", "status", "note"]


# ---------------------------------------------------------------------------------------------------
# The parent: which children, how long each may take, and the tables. No torch here (--help, and a parent
# that holds no CUDA context while its children measure).


@dataclass(frozen=True)
class Job:
    """One child: a plain-loop mode (timing `optimizers` on it) or dlenv's row (optimizer "auto")."""

    mode: str
    optimizers: tuple[str, ...]

    @property
    def compiled(self) -> bool:
        return self.mode not in ("eager", DLENV)


@dataclass
class ChildRun:
    """What a child left: its records (JSON lines), whether it ran out of time, its exit status."""

    records: list[dict] = field(default_factory=list)
    timed_out: bool = False
    rc: int | None = 0


def plan_jobs(modes: list[str] | None, optimizers: list[str], device: str, dlenv: bool) -> list[Job]:
    """The children in ORDER. Without --modes: every mode on CUDA, eager alone elsewhere (compiling on a CPU
    measures nothing this bench is for). Raises ValueError naming an unknown mode or optimizer."""
    bad = [m for m in modes or () if m not in MODES] + [o for o in optimizers if o not in OPTIMIZERS]
    if bad:
        raise ValueError(f"unknown {', '.join(map(repr, bad))}; modes: {', '.join(MODES)}; optimizers: "
                         f"{', '.join(OPTIMIZERS)}")
    if not optimizers:
        raise ValueError(f"no optimizer; use one or more of {', '.join(OPTIMIZERS)}")
    chosen = set(modes) if modes else set(MODES if device.startswith("cuda") else ("eager",))
    jobs = [Job(m, tuple(optimizers)) for m in ORDER if m in chosen]
    if dlenv:
        jobs.append(Job(DLENV, ("auto",)))
        jobs.sort(key=lambda j: ORDER.index(j.mode))
    return jobs


def timeout_for(jobs: list[Job], i: int, left: float) -> float:
    """Seconds child `i` may run with `left` seconds of the budget left: what is left less the reserves of the
    children after it, at least its own reserve, never more than is left."""
    later = sum(RESERVE_S.get(j.mode, 0.0) for j in jobs[i + 1:])
    return max(min(left, RESERVE_S.get(jobs[i].mode, 0.0)), left - later)


def rows_of(job: Job, run: ChildRun, timeout: float) -> list[dict]:
    """A row per optimizer of `job`: the child's own, or one that says why it has none."""
    got = {r.get("asked", r["optimizer"]): r for r in run.records if r.get("type") == "row"}
    phases = [r for r in run.records if r.get("type") == "phase"]
    errors = [r["message"] for r in run.records if r.get("type") == "error"]
    rows = []
    for k, opt in enumerate(job.optimizers):
        if opt in got:
            rows.append({c: got[opt].get(c) for c in COLUMNS})
            continue
        if run.timed_out:
            first = k == 0 or not got
            if first and job.compiled and all(p.get("phase") == "warmup" for p in phases):
                why = f"not measured: compile took over {timeout:.0f} s"
            elif job.mode == DLENV:
                why = f"not measured: the trainer had not reached its measured epoch's end in {timeout:.0f} s"
            else:
                why = f"not measured: stopped after {timeout:.0f} s (--budget)"
        elif errors:
            why = f"failed: {errors[-1]}"
        else:
            why = f"failed: the child exited with status {run.rc} before this row"
        rows.append({"mode": job.mode, "optimizer": opt, "status": why})
    return rows


def run_schedule(jobs: list[Job], budget: float, spawn: Callable[[Job, float], ChildRun],
                 clock: Callable[[], float] = time.monotonic,
                 written: Callable[[list[dict], list[dict]], None] = lambda rows, records: None
                 ) -> tuple[list[dict], list[dict]]:
    """Run each job's child by `spawn(job, timeout)` within `budget` seconds from now; returns (rows, every
    child's records). `written(rows, records)` after each child: the tables so far."""
    deadline = clock() + budget
    rows: list[dict] = []
    records: list[dict] = []
    for i, job in enumerate(jobs):
        left = deadline - clock() - MARGIN_S
        if left < MIN_START_S:
            rows += [{"mode": job.mode, "optimizer": o, "status": f"not measured: --budget {budget:.0f} s spent"}
                     for o in job.optimizers]
        else:
            timeout = timeout_for(jobs, i, left)
            print(f"== {job.mode}: up to {timeout:.0f} s ({left:.0f} s of --budget left)", flush=True)
            run = spawn(job, timeout)
            records += run.records
            rows += rows_of(job, run, timeout)
        written(rows, records)
    return rows, records


def ratios(rows: list[dict]) -> tuple[dict | None, list[float | None]]:
    """The best measured plain row (most img/s), and each row's img/s over that row's (None: not measured)."""
    plain = [r for r in rows if r.get("mode") != DLENV and _num(r.get("img_s"))]
    best = max(plain, key=lambda r: float(r["img_s"]), default=None)
    if best is None:
        return None, [None] * len(rows)
    top = float(best["img_s"])
    return best, [float(r["img_s"]) / top if _num(r.get("img_s")) else None for r in rows]


def _num(v: object) -> bool:
    try:
        return v not in (None, "") and float(v) > 0  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _f(v: object, fmt: str) -> str:
    return format(float(v), fmt) if _num(v) else "-"  # type: ignore[arg-type]


def header(info: dict, a: argparse.Namespace) -> str:
    """The line above the table: the device and software the children reported, and the workload."""
    gpu = info.get("device_name") or a.device
    cuda = info.get("cuda") or "none"
    return (f"{gpu}, PyTorch {info.get('torch', '?')}, CUDA {cuda}; {a.model}, batch {a.batch_size}, "
            f"{a.img_size} px, bf16 autocast, channels_last, synthetic data on the device; {a.warmup} warm-up and "
            f"{a.steps} timed steps per plain row")


def table(rows: list[dict], head: str) -> str:
    """The markdown table of `rows`, each with its img/s over the best plain row's; the best row marked."""
    best, xs = ratios(rows)
    out = [head, "", "| mode | optimizer | img/s | ms/step | warm-up s | x best plain | status |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r, x in zip(rows, xs, strict=True):
        mark = r is best
        mode = f"**{r['mode']}**" if mark else r["mode"]
        ratio = "-" if x is None else f"**{x:.3f} (best)**" if mark else f"{x:.3f}"
        out.append(f"| {mode} | {r['optimizer']} | {_f(r.get('img_s'), ',.0f')} | {_f(r.get('ms_per_step'), '.1f')} "
                   f"| {_f(r.get('warmup_s'), '.1f')} | {ratio} | {r.get('status') or '-'} |")
    mine = [(r, x) for r, x in zip(rows, xs, strict=True) if r["mode"] == DLENV]
    if best is not None:
        out += ["", f"Best plain row: {best['mode']}, {best['optimizer']} ({float(best['img_s']):,.0f} img/s)."]
        for r, x in mine:
            out.append(f"dlenv's default long run: {x:.3f}x the best plain row." if x is not None
                       else f"dlenv's default long run: {r.get('status')}.")
    notes = [f"- {r['mode']}, {r['optimizer']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(out + ([""] + notes if notes else []))


def profile_md(rows: list[dict], records: list[dict]) -> str:
    """The best plain row's and dlenv's profiles (top kernels, busy share), from the children's records."""
    best, _ = ratios(rows)
    want = [(best["mode"], best["optimizer"])] if best is not None else []
    want += [(r["mode"], r["optimizer"]) for r in rows if r["mode"] == DLENV]
    out = []
    for mode, opt in want:
        prof = next((p for p in records if p.get("type") == "profile" and p.get("mode") == mode
                     and p.get("optimizer") == opt), None)
        if prof is None:
            out += [f"### {mode}, {opt}", "", "No profile (not measured, or the profile failed).", ""]
            continue
        if prof.get("error"):
            out += [f"### {mode}, {opt}", "", f"The profile failed: {prof['error']}", ""]
            continue
        span, busy = prof["span_us"], prof["busy_us"]
        share = busy / span if span else 0.0
        out += [f"### {mode}, {opt}", "",
                f"{prof['steps']} steps profiled ({prof['activity']} activity): the {prof['unit']} busy "
                f"{share:.1%}, idle {1 - share:.1%} of {span / 1000:,.1f} ms (first start to last end); the sum "
                f"of their durations {prof['sum_us'] / 1000:,.1f} ms.", "",
                f"| {prof['unit']} top {TOP_KERNELS} by total time | total ms | calls | share of the span |",
                "| --- | ---: | ---: | ---: |"]
        for name, total, calls in prof["kernels"][:TOP_KERNELS]:
            short = name if len(name) <= 100 else name[:97] + "..."
            short = short.replace("|", "\\|")
            out.append(f"| `{short}` | {total / 1000:,.2f} | {calls} | {total / span if span else 0:.1%} |")
        out.append("")
    return "\n".join(out)


def write_outputs(out: Path, rows: list[dict], records: list[dict], a: argparse.Namespace) -> None:
    """bench_ceiling.csv and .md (and the profile's .md with --profile), rewritten whole."""
    info = next((r for r in records if r.get("type") == "info"), {})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_ceiling.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "bench_ceiling.md").write_text(table(rows, header(info, a)) + "\n", encoding="utf-8")
    if a.profile:
        (out / "bench_ceiling_profile.md").write_text(profile_md(rows, records), encoding="utf-8")


def child_command(job: Job, result: Path, a: argparse.Namespace) -> list[str]:
    """This script's command line for `job`'s child."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", job.mode, "--result", str(result),
           *(["--optimizers", ",".join(job.optimizers)] if job.mode != DLENV else []), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--model", a.model, "--batch-size", str(a.batch_size), "--img-size",
           str(a.img_size), "--device", a.device, "--dlenv-steps", str(a.dlenv_steps), "--dlenv-epochs",
           str(a.dlenv_epochs)]
    return cmd + (["--profile"] if a.profile else [])


def spawn_child(job: Job, timeout: float, a: argparse.Namespace, work: Path) -> ChildRun:
    """Run `job`'s child for at most `timeout` seconds, in a process group of its own that is killed whole when
    it ends (the compile workers with it); its records come from the JSON lines it wrote, even when killed."""
    result = work / f"{job.mode.replace(' ', '_')}.jsonl"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # a process group of its own in this session (not a new session: whatever ends this call's session ends it)
    proc = subprocess.Popen(child_command(job, result, a), env=env, preexec_fn=os.setpgrp)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its group: whatever it started is ended too
        proc.wait()
    return ChildRun(read_records(result), timed_out, None if timed_out else proc.returncode)


def read_records(path: Path) -> list[dict]:
    """The JSON lines a child wrote (a line cut short by a kill is left out)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# ---------------------------------------------------------------------------------------------------
# The children: torch from here on.


class Emit:
    """Appends one JSON line per record to the result file, flushed: the parent reads them even after a kill."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, **record) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _info(torch, dev) -> dict:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return {"type": "info", "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda}


def _sync(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_optimizer(torch, name: str, params: list) -> tuple[object, str]:
    """The plain loop's optimizer `name`, and a note when this torch cannot honour its kernel choice (then the
    plain per-parameter step, said in the row's note)."""
    kinds = {"sgd-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                               "weight_decay": 5e-5}, {"foreach": True}),
             "adamw-fused": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.05}, {"fused": True})}
    cls, kw, kernels = kinds[name]
    try:
        return cls(params, **kw, **kernels), ""
    except (TypeError, RuntimeError, ValueError) as e:
        return cls(params, **kw), f"{next(iter(kernels))}=True unavailable here ({str(e).splitlines()[0]}): default"


class Window:
    """torch.profiler around a few steps (`begin`, the steps, `end`): CUDA activity alone on a GPU (CPU on a
    CPU); where that records no kernel (kineto has dropped them without CPU activity), `end` asks for one more
    window with CPU activity too. `result`: `summarize`'s dict, or {"error": ...}."""

    def __init__(self, torch, dev):
        from torch.profiler import ProfilerActivity

        self.torch, self.dev = torch, dev
        cpu, cuda = ProfilerActivity.CPU, ProfilerActivity.CUDA
        self.tries = [[cuda], [cpu, cuda]] if dev.type == "cuda" else [[cpu]]
        self.prof, self.result = None, None

    def begin(self) -> None:
        from torch.profiler import profile

        _sync(self.torch, self.dev)
        self.prof = profile(activities=self.tries[0])
        self.prof.__enter__()

    def end(self, steps: int) -> bool:
        """Close the window over `steps` steps; True when done (a result, or no other try left)."""
        _sync(self.torch, self.dev)
        self.prof.__exit__(None, None, None)
        activities = self.tries.pop(0)
        got = summarize(self.prof, self.dev, steps)
        got["activity"] = " and ".join(str(x).split(".")[-1] for x in activities)
        self.prof = None
        if got["kernels"] or not self.tries:
            self.result = got if got["kernels"] else {"error": f"the profile recorded no {got['unit']}"}
            return True
        return False


def profile_steps(torch, dev, step: Callable[[], None], n: int) -> dict:
    """`Window`'s result over `n` calls of `step` (twice where the first window recorded no kernel)."""
    window = Window(torch, dev)
    while True:
        window.begin()
        for _ in range(n):
            step()
        if window.end(n):
            return window.result


def summarize(prof, dev, n: int) -> dict:
    """A finished torch.profiler profile of `n` steps on `dev`: the events on that device by total time (the
    top ones), their summed and merged time, and the span from the first start to the last end."""
    want = "CUDA" if dev.type == "cuda" else "CPU"
    spans, totals = [], {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).split(".")[-1] != want:
            continue
        t0, t1 = float(e.time_range.start), float(e.time_range.end)
        if t1 > t0:
            spans.append((t0, t1))
            total, calls = totals.get(e.name, (0.0, 0))
            totals[e.name] = (total + t1 - t0, calls + 1)
    return {"unit": "kernels" if want == "CUDA" else "CPU ops", "steps": n, **busy_share(spans),
            "kernels": sorted(([k, t, c] for k, (t, c) in totals.items()), key=lambda x: -x[1])[:TOP_KERNELS * 2]}


def busy_share(spans: list[tuple[float, float]]) -> dict:
    """{span_us: first start to last end, busy_us: the union of the intervals, sum_us: their summed lengths}."""
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "sum_us": 0.0}
    spans = sorted(spans)
    busy, (cur0, cur1) = 0.0, spans[0]
    for t0, t1 in spans[1:]:
        if t0 > cur1:
            busy += cur1 - cur0
            cur0, cur1 = t0, t1
        else:
            cur1 = max(cur1, t1)
    busy += cur1 - cur0
    return {"span_us": max(t1 for _, t1 in spans) - spans[0][0], "busy_us": busy,
            "sum_us": sum(t1 - t0 for t0, t1 in spans)}


def child_plain(a: argparse.Namespace, emit: Emit) -> int:
    """One mode of the plain loop, each optimizer timed on it; then, with --profile, its fastest row profiled."""
    import torch
    import torchvision
    from torch import nn

    dev = torch.device(a.device)
    emit(**_info(torch, dev))
    optimizers = [o for o in a.optimizers.split(",") if o]
    if a.child != "eager" and not hasattr(torch, "compile"):
        for opt in optimizers:
            emit(type="row", mode=a.child, optimizer=opt, status=f"not measured: PyTorch {torch.__version__} has no "
                                                                 "torch.compile")
        return 0
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: the fastest convolutions, as the trainer sets it
    fmt = torch.channels_last
    get = getattr(torchvision.models, "get_model", None)
    model = (get(a.model, weights=None, num_classes=1000) if get else
             getattr(torchvision.models, a.model)(num_classes=1000))
    model = model.to(dev, memory_format=fmt).train()
    x = torch.randn(a.batch_size, 3, a.img_size, a.img_size, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (a.batch_size,), device=dev)
    crit = nn.CrossEntropyLoss()
    run = model if a.child == "eager" else torch.compile(model, mode=None if a.child == "default" else a.child)
    mark = (getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
            if a.child == "reduce-overhead" else None)
    steppers = {}
    for name in optimizers:
        opt, note = make_optimizer(torch, name, list(model.parameters()))

        def step(opt=opt):
            if mark is not None:
                mark()  # CUDA graphs: a new iteration, so the last one's outputs may be overwritten
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = crit(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def phase(what: str, n: int, name: str = name, step: object = step) -> float:  # n steps, said first
            emit(type="phase", mode=a.child, optimizer=name, phase=what)
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            _sync(torch, dev)
            return time.perf_counter() - t0

        try:
            warm = phase("warmup", a.warmup)
            secs = phase("timed", a.steps)
        except Exception as e:  # a compile that fails: this row says so, the next optimizer still tries
            emit(type="error", message=_line(e))
            emit(type="row", mode=a.child, optimizer=name, status=f"failed: {_line(e)}")
            continue
        img_s = a.batch_size * a.steps / secs
        emit(type="row", mode=a.child, optimizer=name, img_s=round(img_s, 1),
             ms_per_step=round(secs * 1000 / a.steps, 2), warmup_s=round(warm, 1), status="ok", note=note)
        print(f"{a.child}, {name}: {img_s:,.0f} img/s, {secs * 1000 / a.steps:.1f} ms/step, warm-up {warm:.1f} s",
              flush=True)
        steppers[name] = (img_s, step)
    if a.profile and steppers:
        name = max(steppers, key=lambda k: steppers[k][0])
        try:
            emit(type="profile", mode=a.child, optimizer=name, **profile_steps(torch, dev, steppers[name][1],
                                                                             PROFILE_STEPS))
        except Exception as e:  # the rows are written already
            emit(type="profile", mode=a.child, optimizer=name, error=_line(e))
    return 0


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def child_dlenv(a: argparse.Namespace, emit: Emit) -> int:
    """dlenv's trainer as a long run plans (see the module doc), stopped as Ctrl-C stops it after the measured
    epoch (with --profile: PROFILE_STEPS steps into the next one, profiled)."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from dlenv.engine.optim import AUTO_SGD_FROM_STEPS
    from dlenv.options import config
    from dlenv.train.auto import COMPILE_MIN_BATCHES

    dev = torch.device(a.device)
    emit(**_info(torch, dev))
    steps, measured = a.dlenv_steps, a.dlenv_epochs
    planned = max(measured + 1, math.ceil(max(AUTO_SGD_FROM_STEPS, COMPILE_MIN_BATCHES) / steps))
    seen: dict = {}

    def stop() -> None:
        seen["stopped"] = True
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the trainer stops after this step

    def on_step(state) -> None:
        if state.step == (measured - 1) * steps + 1:
            seen["measured_from"] = time.perf_counter()
        if seen.get("stopped"):
            return
        if not a.profile:
            if state.step == measured * steps:  # the measured epoch's last step: its results.csv row is written
                stop()
            return
        if state.step < measured * steps + 2:  # a profile of the next epoch's steps, past its first ones
            return
        try:
            if "window" not in seen:
                seen["window"], seen["from"] = Window(torch, dev), state.step
                seen["window"].begin()
            elif state.step - seen["from"] == PROFILE_STEPS:
                if seen["window"].end(PROFILE_STEPS):
                    stop()
                else:
                    seen["from"] = state.step
                    seen["window"].begin()
        except Exception as e:  # the measured epoch is in results.csv already
            seen["prof_error"] = _line(e)
            stop()

    emit(type="phase", mode=DLENV, optimizer="auto", phase="warmup")
    project = tempfile.mkdtemp(prefix="bench-ceiling-")
    cfg = config.build(config.TrainConfig, data=None, synthetic=True, model=a.model, amp=True,
                       batch_size=a.batch_size, img_size=a.img_size, epochs=planned, max_steps=steps,
                       project=project, name="run", device=a.device)
    try:
        return _train_and_report(a, emit, cfg, on_step, project, seen, planned)
    finally:
        import shutil

        shutil.rmtree(project, ignore_errors=True)  # its last.pth: a few hundred MB a call


def _train_and_report(a: argparse.Namespace, emit: Emit, cfg, on_step, project: str, seen: dict, planned: int
                      ) -> int:
    """Train `cfg`, then emit dlenv's row (and its profile) from the run folder."""
    from dlenv.runfolder.trainstate import read_config_notes
    from dlenv.train import train

    steps, measured = a.dlenv_steps, a.dlenv_epochs
    t0 = time.perf_counter()
    error = None
    try:
        summary = train(cfg, on_step=on_step)
        run_dir = Path(summary["run_dir"])
    except Exception as e:  # the measured epoch's row may be there all the same
        error, summary = _line(e), {}
        run_dir = next(iter(sorted(Path(project).glob("run*"))), Path(project) / "run")
    rows = _results(run_dir / "results.csv")
    if len(rows) < measured:
        why = f"failed: {error}" if error else f"failed: {len(rows)} epochs in results.csv, not {measured}"
        emit(type="row", mode=DLENV, optimizer="auto", status=why)
        return 1
    img_s = float(rows[measured - 1]["img_per_s"])
    options = _yaml(run_dir / "config.yaml")
    notes = read_config_notes(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    chose = options.get("optimizer", "?")
    note = (f"--compile auto: {options.get('compile', '?')} ({notes.get('compile_rule', '?')}); --optimizer auto: "
            f"{chose}; --amp: {notes.get('precision', '?')}; planned {planned} epochs of {steps} steps, stopped "
            f"after epoch {measured} as Ctrl-C stops it; img/s of epoch {measured}; compiled "
            f"{float(summary.get('compile_s') or 0):.0f} s")
    warm = seen.get("measured_from", t0) - t0
    emit(type="row", mode=DLENV, optimizer=f"auto: {chose}", asked="auto", img_s=round(img_s, 1),
         ms_per_step=round(a.batch_size * 1000 / img_s, 2), warmup_s=round(warm, 1), status="ok", note=note)
    print(f"{DLENV}: {img_s:,.0f} img/s; {note}", flush=True)
    if a.profile:
        window = seen.get("window")
        result = (window.result if window is not None and window.result is not None and "prof_error" not in seen
                  else {"error": seen.get("prof_error", "the run stopped before the profiled steps")})
        emit(type="profile", mode=DLENV, optimizer=f"auto: {chose}", **result)
    return 0


def _results(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------------


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="", help=f"comma-separated, of {', '.join(MODES)} (default: all on CUDA, "
                                               "eager on a CPU)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of " + ", ".join(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=40, help="timed steps per plain row")
    p.add_argument("--warmup", type=int, default=15, help="warm-up steps per plain row (a compile falls in them)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole call: each child gets at most "
                                                               "what is left of it")
    p.add_argument("--out", type=Path, default=Path("runs/bench-ceiling"), help="folder for the tables")
    p.add_argument("--model", default="resnet50", help="a torchvision model name")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a check of the script itself")
    p.add_argument("--no-dlenv", action="store_true", help="skip dlenv's row")
    p.add_argument("--dlenv-steps", type=int, default=0, help="dlenv's row: steps per epoch (--max-steps; default "
                                                              "100 on CUDA, 5 on a CPU)")
    p.add_argument("--dlenv-epochs", type=int, default=2, help="dlenv's row: the epoch measured (the earlier ones "
                                                               "compile and warm up)")
    p.add_argument("--profile", action="store_true", help="profile the best plain row and dlenv's "
                                                          "(bench_ceiling_profile.md)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)   # the mode this process measures
    p.add_argument("--result", default="", help=argparse.SUPPRESS)  # where it writes its JSON lines
    return p


def main(argv: list[str] | None = None) -> int:
    a = get_args_parser().parse_args(argv)
    a.dlenv_steps = a.dlenv_steps or (100 if a.device.startswith("cuda") else 5)
    for name in ("steps", "warmup", "batch_size", "img_size", "dlenv_steps", "dlenv_epochs"):
        if getattr(a, name) < (0 if name == "warmup" else 1):
            print(f"bench_ceiling: --{name.replace('_', '-')} {getattr(a, name)} is too small", file=sys.stderr)
            return 2
    if a.child:
        emit = Emit(a.result)
        try:
            return child_dlenv(a, emit) if a.child == DLENV else child_plain(a, emit)
        except Exception as e:  # the parent says why this child has no rows
            emit(type="error", message=_line(e))
            raise
    modes = [m.strip() for m in a.modes.split(",") if m.strip()] or None
    optimizers = [o.strip() for o in a.optimizers.split(",") if o.strip()]
    try:
        jobs = plan_jobs(modes, optimizers, a.device, not a.no_dlenv)
    except ValueError as e:
        print(f"bench_ceiling: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    # a SIGTERM (a call's own time limit) unwinds like Ctrl-C, so that spawn_child kills the child it waits for
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with tempfile.TemporaryDirectory(prefix="bench-ceiling-") as work:
        rows, records = run_schedule(jobs, a.budget, lambda job, timeout: spawn_child(job, timeout, a, Path(work)),
                                     written=lambda rows, records: write_outputs(a.out, rows, records, a))
    write_outputs(a.out, rows, records, a)
    print("\n" + (a.out / "bench_ceiling.md").read_text(encoding="utf-8"))
    if a.profile:
        print((a.out / "bench_ceiling_profile.md").read_text(encoding="utf-8"))
    print(f"total {time.perf_counter() - t0:.0f} s of --budget {a.budget:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
