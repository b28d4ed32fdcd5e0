"""`train(cfg)`: plan, parts, fit.

    cfg, resume = state.open_resume(cfg)            # a resumed run continues with its saved options
    decided = plan.decide(cfg, resume, ...)         # every decision once (frozen; builds nothing)
    model, data, parts = ...                        # built from the plan (dlenv.train.parts)
    run = open_run(decided, ...)                    # the run folder, config.yaml first
    fit(...)                                        # the epochs (dlenv.train.fit)

Each epoch validates, appends a row to results.csv, saves last.pth (and best_model.pth on
improvement) atomically, and on a GPU writes memory.md (memory per phase of the step and the
allocator's state, dlenv.engine.memory). Nothing is lost: SIGINT/SIGTERM/SIGHUP end the current optimizer step,
save last.pth (with sampler position and every rank's RNG states) and exit 130/143/129; `--resume`
continues there, bit for bit on a CPU with --deterministic, with any number of ranks and workers (each
sample's augmentation is drawn from its own seed, dlenv.data.sampler.SeededDraws). CUDA out of memory stops with advice
(exit 3; with --batch-size auto the run goes on from the last optimizer step at half the micro-batch
instead); a run of non-finite losses
or skipped fp16 steps stops with exit 4. Neither overwrites the last good run file.

With --gpus N, `main` launches N processes through torchrun (dlenv.cluster.launch): each trains its share
under DDP (dlenv.cluster.distributed), validation sums are reduced over all of them, and only rank 0 writes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dlenv import __version__, compat, runfolder
from dlenv.cluster import distributed, launch
from dlenv.cluster.devices import resolve_device
from dlenv.engine import memory
from dlenv.errors import Stopped, UserError
from dlenv.files import runstate
from dlenv.options.config import TrainConfig
from dlenv.runfolder import results, trainstate
from dlenv.runfolder.trainstate import TrainState
from dlenv.train import console, parts, plan, tracking
from dlenv.train.fit import Run, fit


def main(cfg: TrainConfig) -> int:
    """`dlenv train`: run `train(cfg)`, or with --gpus N launch N of them through torchrun; return the
    exit code (UserError propagates to the CLI)."""
    if launch.needs_launch(cfg):
        return launch.launch(runfolder.resumed_device(cfg))
    return int(train(cfg)["exit_code"])


def train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """Train as `cfg` says; returns a summary dict.

    Summary keys: run_dir, status ("done" or "interrupted"), exit_code (0, 130, 143, 129), epochs (completed),
    step, best_metric, last, best, precision, batch_size, accum_steps, img_per_s and peak_alloc_gib
    (of the last epoch). `on_step(state)` is called after every optimizer step (tests, tools).
    Raises UserError for bad input, CUDA out of memory (exit_code 3) and a run of non-finite losses
    (exit_code 4); the last good run file is intact in each case.
    """
    opened: dict[str, Path | None] = {}  # the new run folder, once made: a failure says where it is
    try:
        with console.StartUp(), _GlobalSettings():  # fit's console.Stop takes the signals for the loop
            summary = _train(cfg, on_step, opened)
    except Stopped as e:  # nothing trained yet: one line, and a resumed run's files untouched
        console.printer(os.environ.get("RANK", "0") == "0")(console.stopped_early_line(e.signum, cfg.resume,
                                                                                     launch.relaunch_flags(cfg)))
        return {"run_dir": None, "status": "interrupted", "exit_code": console.SIGNAL_EXIT[e.signum]}
    except Exception as e:  # re-raised below (a model of your own may raise any error)
        # The run is over; what the caller keeps is its one line. A notebook keeps the last exception
        # (sys.last_value) and with it the traceback's frames, _train's and fit's, whose locals are the run:
        # the model, the loaders, the batch on the GPU (2.5 GB of an H100 after an out-of-memory). Those
        # frames have returned now, so their locals can go, and the memory with them (docs/memory.md).
        if isinstance(e, UserError) or compat.is_oom(e):
            memory.release_failed_step(e)
        where = trainstate.nothing_trained(opened.get("run_dir"))
        if where and isinstance(e, UserError):
            e.args = (f"{e}; {where}",)
        elif where:  # the traceback follows; this line says where the folder it leaves is
            print(f"dlenv train: {where}", file=sys.stderr, flush=True)
        raise
    distributed.cleanup()  # after a normal end only: with a dead peer, teardown could wait for it
    memory.release_cached()  # a notebook's next cell starts with the card as this one found it (issue 54)
    return summary


def _train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None, opened: dict[str, Path | None]
           ) -> dict[str, Any]:
    cfg, resume = trainstate.open_resume(cfg)
    if resume is not None and resume.nothing_left:  # --epochs N of a run N epochs long: nothing to join or build
        console.printer(os.environ.get("RANK", "0") == "0")(resume.nothing_left)
        return {"run_dir": resume.run_dir, "status": "done", "exit_code": 0, "epochs": cfg.epochs}
    if os.environ.get("RANK", "0") == "0":  # only rank 0 tracks: MLflow missing is said before anything is built
        tracking.require(cfg.mlflow)
    dist = distributed.join(cfg)
    say = console.printer(dist.is_main)
    if resume is not None and resume.found:
        say(resume.found)
    if resume is not None and resume.new_end:
        say(console.new_end_line(*resume.new_end, int(resume.run_file["step"])))
    if resume is not None and resume.ignored:
        say(f"--resume continues {resume.run_dir} with its saved options; ignoring {', '.join(resume.ignored)} "
            f"(to change them, start a new run from its weights: --weights {cfg.resume})")
    if resume is not None and resume.inexact:
        say(f"--resume with {', '.join(resume.inexact)}: another device computes other numbers, so this resume "
            "does not end bit-equal to the uninterrupted run (leave the flag out to continue with the run's)")
    device = resolve_device(cfg.device, dist.local_rank)
    # Once, before any probe or measurement: what earlier work in this process left (a notebook's previous
    # run, a --batch-size auto probe, a caught out-of-memory whose frames still hold its step) is collected
    # and the cache emptied, and what is still held is left out of this run's peaks (memory.start_clean)
    held = memory.start_clean(device)
    if held > 2**30 and dist.is_main:
        say(f"{held / 2**30:.1f} GiB of {device} was already in use by this process before the run (earlier "
            "work's tensors); the peaks this run reports leave it out, but it is not free for the run")
    _seed_everything(cfg.seed + dist.rank, cfg.deterministic, device)
    decided = plan.decide(cfg, resume, dist, device)
    use_threads(decided.threads.value)
    for line in decided.said:
        say(line)
    model = parts.build_model(decided, device)
    data = parts.build_data(decided, device, dist, say)
    built = parts.build_parts(decided, model, device)
    state = TrainState(micro_batch=decided.micro_batch, accum_steps=decided.accum_steps)
    rng = (trainstate.restore(resume, built, state, data.sampler, dist.rank, dist.world_size)
           if resume is not None else None)
    for line in resume.limits if resume is not None else ():
        say(f"--resume: {line}")
    run = open_run(decided, resume, dist, device, state)
    opened["run_dir"] = run.dir if run.is_main and resume is None else None  # never a resumed run's
    run.held = held
    say(decided.start_line(device, bool(state.epoch or state.batch_in_epoch), run.dir))
    if rng is not None:  # last: building the model drew from these streams
        runstate.set_rng_state(rng)
    run.tracker = _tracker(decided, run.dir, device, say) if dist.is_main else None
    if run.tracker is None:
        return fit(decided, built, state, data, run, say, lambda p: parts.build_data(p, device, dist, say), on_step)
    status = "FAILED"
    try:
        summary = fit(decided, built, state, data, run, say, lambda p: parts.build_data(p, device, dist, say), on_step)
        status = "FINISHED" if summary["status"] == "done" else "KILLED"
        return summary
    finally:  # the end of the MLflow run, however fit ended: artifacts, what was not sent, the status
        run.tracker.close(status)


class _GlobalSettings:
    """Restores the process-wide torch settings a run changes, so train() can be called repeatedly."""

    def __enter__(self):
        self.det = torch.are_deterministic_algorithms_enabled()
        self.warn = torch.is_deterministic_algorithms_warn_only_enabled()
        self.bench = torch.backends.cudnn.benchmark
        self.threads = torch.get_num_threads()
        self.env = {k: os.environ.get(k) for k in THREAD_VARIABLES}
        return self

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.det, warn_only=self.warn)
        torch.backends.cudnn.benchmark = self.bench
        torch.set_num_threads(self.threads)
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: what child processes (DataLoader workers, a decoder's pool) read for their thread count
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def use_threads(n: int) -> None:
    """PyTorch's intra-op threads, and OpenMP's and MKL's in child processes: `n` (the plan's `threads`). A
    variable the user set is kept (it decided `n` already). Inter-op threads are left as they are: they can be
    set only before the process's first inter-op work, and torch 1.13 aborts the process (no exception) when
    that has happened, as it has after an earlier run or probe in the same process."""
    torch.set_num_threads(n)
    for k in THREAD_VARIABLES:
        os.environ.setdefault(k, str(n))


def _seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every GPU
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible matmuls (read when cuBLAS starts)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: a few CUDA backward kernels have no deterministic version; warn, don't stop
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        # cuDNN autotuning picks the fastest convolution for the fixed training shape
        torch.backends.cudnn.benchmark = device.type == "cuda"


def open_run(decided: plan.TrainPlan, resume: trainstate.Resume | None, dist: distributed.DistInfo,
             device: torch.device, state: TrainState) -> Run:
    """The run folder with config.yaml in it first (rank 0), results.csv cut back to a resumed epoch, and
    the metadata every run file carries."""
    cfg, options = decided.config, decided.options()
    run_dir, lock = (resume.run_dir if resume is not None else None), None
    if dist.is_main:
        if run_dir is None:
            run_dir = runfolder.new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
        options["name"] = run_dir.name  # the folder it got (exp2), not the name asked for (exp)
        lock = runfolder.lock_run_dir(run_dir)  # held for the run's life: a second run here is refused
        trainstate.settle_best(run_dir, resume, state.best_metric, print)
        trainstate.write_config_yaml(run_dir / "config.yaml", options, decided.notes(device), started=time.time())
        if state.epoch or state.batch_in_epoch:
            results.truncate_after(run_dir / "results.csv", state.epoch)
    meta = {"model_name": cfg.model, "num_classes": len(decided.data.classes), "class_names": decided.data.classes,
            "img_size": decided.input.img_size, "config": options, "world_size": dist.world_size,
            "model_source": decided.model.provenance}
    tb = _tensorboard(run_dir) if cfg.tensorboard and dist.is_main else None
    return Run(run_dir, meta, tb, dist.is_main, lock)


def _tracker(decided: plan.TrainPlan, run_dir: Path, device: torch.device, say: Callable[[str], None]
             ) -> tracking.Tracker | None:
    """The run's MLflow tracker (--mlflow or MLFLOW_TRACKING_URI; dlenv.train.tracking), or None: the options and
    what they resolved to as params, where it ran as tags."""
    cfg = decided.config
    if not tracking.wanted(cfg.mlflow, os.environ):
        return None
    tags = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": str(torch.__version__), "dlenv": str(__version__)}
    commit = tracking.git_commit(Path.cwd())
    if commit:
        tags["git_commit"] = commit
    options = decided.options()
    options["name"] = run_dir.name
    params = {**tracking.flat(options), **tracking.flat(decided.notes(device), "auto.")}
    return tracking.open_tracker(cfg.mlflow, cfg.mlflow_weights, run_dir, say, params, tags)


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir))
