"""The trainer: `dlenv train` / `invoke train` / `dlenv.train.train(cfg)`.

`train(cfg)` reads top to bottom: what to continue (--resume), this process's place in the run,
device, seed and precision, the data and the model, the batch split, the input plan and loaders, the
optimizer, schedule, EMA and one `Precision`, the resumed state, then config.yaml before anything
else is written; then epochs (`fit`). The epoch and the step are in `loop`; progress and signals in
`console`; the files a run saves and resumes from in `state`.

Each epoch validates, appends a row to results.csv, saves last.pth (and best_model.pth on
improvement) atomically, and on a GPU writes memory.md (memory per phase of the step and the
allocator's state, dlenv.memory). Nothing is lost: SIGINT/SIGTERM end the current optimizer step,
save last.pth (with sampler position and RNG states) and exit 130/143; `--resume` continues there,
bit for bit on a CPU with --deterministic and --workers 0. CUDA out of memory stops with advice
(exit 3; with --batch-size auto the batch is split and retried instead); a run of non-finite losses
or skipped fp16 steps stops with exit 4. Neither overwrites the last good checkpoint.

With --gpus N, `main` launches N processes through torchrun (dlenv.launch): each trains its share
under DDP (dlenv.distributed), validation sums are reduced over all of them, and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv import autobatch, compat, config, distributed, launch, memory, results, runs, runstate, usermodel
from dlenv.config import TrainConfig
from dlenv.data import pipeline
from dlenv.devices import resolve_device
from dlenv.errors import UserError
from dlenv.train import auto, console, loop
from dlenv.train import state as saved
from dlenv.train.loop import NonFiniteLoss, Parts, TrainState

EXIT_OOM, EXIT_NONFINITE = 3, 4

__all__ = ["EXIT_NONFINITE", "EXIT_OOM", "TrainState", "main", "train"]


def main(cfg: TrainConfig) -> int:
    """`dlenv train`: run `train(cfg)`, or with --gpus N launch N of them through torchrun; return the
    exit code (UserError propagates to the CLI)."""
    if launch.needs_launch(cfg):
        return launch.launch(cfg)
    return int(train(cfg)["exit_code"])


def train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """Train as `cfg` says; returns a summary dict.

    Summary keys: run_dir, status ("done" or "interrupted"), exit_code (0, 130, 143), epochs (completed),
    step, best_metric, last, best, precision, batch_size, accum_steps, img_per_s and peak_alloc_gib
    (of the last epoch). `on_step(state)` is called after every optimizer step (tests, tools).
    Raises UserError for bad input, CUDA out of memory (exit_code 3) and a run of non-finite losses
    (exit_code 4); the last good checkpoint is intact in each case.
    """
    with _GlobalSettings():
        summary = _train(cfg, on_step)
    distributed.cleanup()  # after a normal end only: with a dead peer, teardown could wait for it
    return summary


def _train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None) -> dict[str, Any]:
    from dlenv.precision import Precision, resolve_precision

    cfg, resume = saved.open_resume(cfg)  # a resumed run continues with its saved options
    dist = distributed.join(cfg)
    say = console.printer(dist.is_main)
    if resume is not None and resume.ignored:
        say(f"--resume continues {resume.run_dir} with its saved options; ignoring {', '.join(resume.ignored)} "
            f"(to change them, start a new run from its weights: --weights {cfg.resume})")
    device = resolve_device(cfg.device, dist.local_rank)
    _seed_everything(cfg.seed + dist.rank, cfg.deterministic, device)
    precision = Precision(resolve_precision(cfg.amp, cfg.amp_dtype, device), device)

    # the data and the model first: --batch-size auto and channels_last need them
    located = pipeline.locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)
    img_size = cfg.img_size or usermodel.declared_img_size(cfg.model) or located.img_size
    model_kwargs = usermodel.factory_kwargs(cfg.model, cfg.model_args, img_size)  # {} for torchvision names
    model, memory_format = _build_model(cfg, len(located.classes), device, fresh=resume is None, say=say,
                                        img_size=img_size, model_kwargs=model_kwargs)
    micro, accum = _batch_split(cfg, dist, device, located, precision.mode, img_size, memory_format, resume, say,
                                model_kwargs)
    plan = pipeline.decide(pipeline.InputOptions.of(cfg), located, device, micro, img_size, dist.local_world_size)
    data = pipeline.build_data(located, plan, device, dist, seed=cfg.seed, dtype=precision.dtype,
                               memory_format=memory_format, max_steps=cfg.max_steps, say=say, epochs=cfg.epochs)
    if located.layout is not None:
        say(plan.describe(device))
    # after the data: what it keeps on the GPU (--synthetic, --cache ram on the device) counts in the probe
    ratio = auto.checkpoint_ratio(cfg, model, model_kwargs, precision.mode, img_size, len(located.classes), device,
                                  memory_format == torch.channels_last, micro, say)
    full_epoch = len(data.train) if data.sampler is None else math.ceil(data.sampler.per_rank / micro)
    batches_per_epoch = min(full_epoch, cfg.max_steps or full_epoch)

    # a resumed run has its saved on/off; auto counts the whole run's micro-batches per GPU
    compiled = auto.decide_compile(cfg.compile, device, cfg.epochs * batches_per_epoch)
    if (cfg.compile == "auto" and (compiled[0] or not compat.HAS_COMPILE)) or (cfg.compile == "on" and not compiled[0]):
        say(f"--compile {compiled[1]}")  # once: when it compiles, or cannot
    parts, chosen = _build_parts(cfg, model, precision, device, memory_format, micro * accum * dist.world_size,
                                 steps_per_epoch=math.ceil(batches_per_epoch / accum), compile_on=compiled[0])
    state = TrainState(micro_batch=micro, accum_steps=accum)
    rng = saved.restore(resume, parts, state, data.sampler) if resume is not None else None
    run = _open_run(cfg, resume, dist, device, data, precision.mode, micro, accum, chosen, state,
                    usermodel.provenance(cfg.model, model_kwargs), compiled, ratio)
    say(_start_line(cfg, data, device, precision.mode, memory_format, micro, accum, dist.world_size, chosen,
                    run.dir, state))
    if rng is not None:  # last: building the model and the auto-batch probe drew from these streams
        runstate.set_rng_state(rng)
    return fit(cfg, parts, state, data, run, batches_per_epoch, dist, say, on_step)


# ---------------------------------------------------------------------------------------------------
# Setup, in the order `_train` calls it.


class _GlobalSettings:
    """Restores the process-wide torch settings a run changes, so train() can be called repeatedly."""

    def __enter__(self):
        self.det = torch.are_deterministic_algorithms_enabled()
        self.warn = torch.is_deterministic_algorithms_warn_only_enabled()
        self.bench = torch.backends.cudnn.benchmark
        return self

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.det, warn_only=self.warn)
        torch.backends.cudnn.benchmark = self.bench


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


def _build_model(cfg: TrainConfig, num_classes: int, device: torch.device, fresh: bool,
                 say: Callable[[str], None], img_size: int,
                 model_kwargs: dict[str, Any]) -> tuple[nn.Module, torch.memory_format]:
    """(the model on `device`, checkpointed if asked, its memory format). --weights only for a fresh run:
    a resume loads its own."""
    from dlenv.models import apply_checkpointing, build_model, is_convolutional

    model = build_model(cfg.model, num_classes, weights=cfg.weights if fresh else None, **model_kwargs)
    channels_last = cfg.channels_last and device.type == "cuda" and is_convolutional(model)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    usermodel.check_output(model, cfg.model, num_classes, img_size)  # logits [N, classes]? (own models)
    if cfg.checkpoint and apply_checkpointing(model, auto.start_ratio(cfg)) == 0:
        say(f"--checkpoint: {cfg.model} has no repeated blocks to checkpoint; training without it")
    return model, memory_format


def _batch_split(cfg: TrainConfig, dist: distributed.DistInfo, device: torch.device, located: pipeline.Located,
                 mode: str, img_size: int, memory_format: torch.memory_format, resume: saved.Resume | None,
                 say: Callable[[str], None], model_kwargs: dict[str, Any]) -> tuple[int, int]:
    """(micro-batch per GPU, accumulation steps): the options, 'auto' measured on every GPU (all use the
    smallest), and on a resume with another number of GPUs the saved effective batch kept if it divides."""
    def measure() -> int:
        upper = len(located.layout.train) if located.layout is not None else 4096
        ratio = auto.start_ratio(cfg) if cfg.checkpoint else False
        n = auto.auto_batch(cfg.model, len(located.classes), mode, ratio, img_size, device,
                            memory_format == torch.channels_last, upper, say, model_kwargs)
        return int(distributed.agree(n, "min"))

    micro, accum = autobatch.resolve_batch(cfg.batch_size, cfg.accum_steps, cfg.effective_batch, dist.world_size,
                                           measure)
    if resume is not None:
        micro, accum, note = autobatch.resume_split(micro, accum, resume.saved_world, dist.world_size)
        if note:
            say(note)
    return micro, accum


@dataclass(frozen=True)
class _Chosen:
    """What the optimizer options resolved to."""

    optimizer: str
    lr: float
    weight_decay: float
    effective_batch: int


def _build_parts(cfg: TrainConfig, model: nn.Module, precision: Any, device: torch.device,
                 memory_format: torch.memory_format, effective: int, steps_per_epoch: int,
                 compile_on: bool) -> tuple[Parts, _Chosen]:
    """Optimizer, warmup-cosine schedule, DDP, EMA and compile around `model`; what the options chose."""
    from dlenv.optim import (
        ModelEma,
        build_optimizer,
        default_lr,
        default_weight_decay,
        resolve_optimizer,
        warmup_cosine,
    )

    opt_name = resolve_optimizer(cfg.optimizer, cfg.epochs * steps_per_epoch)
    lr = cfg.lr if cfg.lr is not None else default_lr(opt_name, effective)
    wd = cfg.weight_decay if cfg.weight_decay is not None else default_weight_decay(opt_name)
    optimizer = build_optimizer(model, opt_name, lr, wd, cfg.momentum, cfg.nesterov)
    scheduler = warmup_cosine(optimizer, round(cfg.warmup_epochs * steps_per_epoch), cfg.epochs * steps_per_epoch)
    # DDP first (it broadcasts rank 0's weights), then compile the wrapped model, as PyTorch advises
    run_model = distributed.wrap_ddp(model, device, sync_bn=cfg.sync_bn)
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema else None
    eager = run_model  # kept: a compile that fails falls back to it (dlenv.train.loop)
    if compile_on:
        run_model = compat.compile_model(run_model)
    parts = Parts(run_model, model, optimizer, scheduler, precision,
                  nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing), ema, device, memory_format, cfg.clip_grad,
                  eager=eager if compile_on else None)
    return parts, _Chosen(opt_name, lr, wd, effective)


@dataclass
class _Run:
    """Where a run writes (only the main process writes) and what every save carries."""

    dir: Path | None            # None on other ranks of a new run
    meta: dict[str, Any]
    tb: Any                     # a TensorBoard SummaryWriter, or None
    is_main: bool
    lock: Any = None            # runs.RunLock: a second run in this folder is refused while it lives
    advised: bool = False       # the data-wait explanation is given once per run

    @property
    def last(self) -> Path | None:
        return self.dir / "last.pth" if self.dir else None

    @property
    def best(self) -> Path | None:
        return self.dir / "best_model.pth" if self.dir else None


def _open_run(cfg: TrainConfig, resume: saved.Resume | None, dist: distributed.DistInfo, device: torch.device,
              data: pipeline.Data, mode: str, micro: int, accum: int, chosen: _Chosen, state: TrainState,
              model_source: dict[str, Any] | None, compiled: tuple[bool, str],
              ratio: tuple[float, str] | None) -> _Run:
    """The run folder with config.yaml in it first (rank 0), results.csv cut back to a resumed epoch, and
    the metadata every checkpoint carries."""
    plan = data.plan
    options = config.to_dict(dataclasses.replace(
        cfg, batch_size=micro, accum_steps=accum, effective_batch=None, optimizer=chosen.optimizer, lr=chosen.lr,
        weight_decay=chosen.weight_decay, img_size=plan.img_size, workers=plan.workers, resume=None,
        amp_dtype=mode if mode != "fp32" else cfg.amp_dtype, compile="on" if compiled[0] else "off",
        checkpoint_ratio=ratio[0] if ratio else cfg.checkpoint_ratio))
    run_dir, lock = (resume.run_dir if resume is not None else None), None
    if dist.is_main:
        if run_dir is None:
            run_dir = runs.new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
        options["name"] = run_dir.name  # the folder it got (exp2), not the name asked for (exp)
        lock = runs.lock_run_dir(run_dir)  # held for the run's life: a second run here is refused
        saved.settle_best(run_dir, resume, state.best_metric, print)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        saved.write_config_yaml(run_dir / "config.yaml", options, {
            "precision": mode, "device": f"{device} ({gpu})", "world_size": dist.world_size,
            "effective_batch": chosen.effective_batch, "data": data.source, "classes": len(data.classes),
            "input": plan.describe(device).removeprefix("input: "), "torch": torch.__version__,
            "compile_rule": compiled[1], **({"checkpoint_rule": ratio[1]} if ratio else {}),
            **({"model_source": model_source} if model_source else {})})
        if state.epoch or state.batch_in_epoch:
            results.truncate_after(run_dir / "results.csv", state.epoch)
    meta = {"model_name": cfg.model, "num_classes": len(data.classes), "class_names": data.classes,
            "img_size": plan.img_size, "config": options, "world_size": dist.world_size,
            "model_source": model_source}
    tb = _tensorboard(run_dir) if cfg.tensorboard and dist.is_main else None
    return _Run(run_dir, meta, tb, dist.is_main, lock)


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir))


def _start_line(cfg: TrainConfig, data: pipeline.Data, device: torch.device, mode: str,
                memory_format: torch.memory_format, micro: int, accum: int, world: int, chosen: _Chosen,
                run_dir: Path | None, state: TrainState) -> str:
    what = "resuming" if state.epoch or state.batch_in_epoch else "training"
    return (f"{what} {cfg.model} on {data.source} ({len(data.classes)} classes, {data.plan.img_size} px) | "
            f"{device} {mode}{' channels_last' if memory_format == torch.channels_last else ''}"
            f"{' checkpointing' if cfg.checkpoint else ''} | batch {micro} x {accum} accum x {world} GPU = "
            f"{chosen.effective_batch}, {chosen.optimizer} lr {chosen.lr:g} | {run_dir}")


# ---------------------------------------------------------------------------------------------------
# The epochs.


def fit(cfg: TrainConfig, parts: Parts, state: TrainState, data: pipeline.Data, run: _Run, batches_per_epoch: int,
        dist: distributed.DistInfo, say: Callable[[str], None],
        on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """Epochs until cfg.epochs are done or a signal stops the run; returns the summary (see `train`).

    A stop saves last.pth at the step boundary the loop stopped at. Non-finite losses and CUDA out of
    memory become one UserError each (exit 4 and 3) naming the last good checkpoint; a failed peer
    becomes dlenv.distributed.PeerFailure.
    """
    summary: dict[str, Any] = {"run_dir": str(run.dir) if run.dir else None, "status": "done", "exit_code": 0,
                               "precision": parts.precision.mode, "batch_size": state.micro_batch,
                               "accum_steps": state.accum_steps, "last": str(run.last) if run.last else None,
                               "best": str(run.best) if run.best else None, "img_per_s": None,
                               "peak_alloc_gib": None, "compile_s": 0.0}
    monitor = memory.MemoryMonitor(parts.device)
    retry_oom = cfg.batch_size == "auto" and dist.world_size == 1
    try:
        with console.Stop(say, dist.world_size) as stop:
            while state.epoch < cfg.epochs:
                t_epoch = time.perf_counter()
                stats = _train_epoch(parts, state, data, batches_per_epoch, cfg.epochs, stop, monitor, run, on_step,
                                     retry_oom)
                if stats.interrupted:
                    if run.is_main:
                        saved.save_last(parts, state, data.sampler, run.meta, run.last)
                    return _stopped(summary, stop.signum, run.last, say)
                row = _end_epoch(cfg, parts, state, data, run, stats, monitor, t_epoch, dist.world_size, say)
                summary["compile_s"] = summary["compile_s"] + stats.compile_s
                summary.update(img_per_s=row["img_per_s"], peak_alloc_gib=row["mem_alloc_gib"],
                               batch_size=row["batch_size"], accum_steps=row["accum_steps"])
                if stop.requested():
                    return _stopped(summary, stop.signum, run.last, say)
    except NonFiniteLoss as e:
        raise UserError(f"training stopped: {e}. {saved.last_good(run.last)} Try a lower --lr, --clip-grad 1.0, "
                        "or --amp-dtype bf16 instead of fp16", exit_code=EXIT_NONFINITE) from None
    except RuntimeError as e:
        if dist.world_size > 1 and distributed.is_peer_error(e):  # e.g. in DDP's gradient all-reduce
            raise distributed.peer_failure(e, "a training step") from None
        if not compat.is_oom(e):
            raise
        raise UserError(_oom_advice(cfg, parts, state, run, monitor), exit_code=EXIT_OOM) from None
    finally:
        if run.tb is not None:
            run.tb.close()
    best = run.best if run.best is not None and run.best.is_file() else None
    summary.update(epochs=state.epoch, step=state.step, best_metric=state.best_metric,
                   best=str(best) if best else None)
    say(f"done: {state.epoch} epochs; best {'top-1' if data.val is not None else '-loss'} "
        f"{state.best_metric:.2f}; " + (f"weights in {best}" if best else "no best_model.pth was written"))
    return summary


def _train_epoch(parts: Parts, state: TrainState, data: pipeline.Data, batches_per_epoch: int, epochs: int,
                 stop: console.Stop, monitor: memory.MemoryMonitor, run: _Run,
                 on_step: Callable[[TrainState], None] | None, retry_oom: bool) -> loop.EpochStats:
    """The training part of an epoch, from where `state` says (a resumed epoch starts mid-way)."""
    if data.sampler is not None:
        data.sampler.set_epoch(state.epoch, start=state.position)
    total = min(state.batch_in_epoch + len(data.train), batches_per_epoch)
    batches = iter(data.train)
    if parts.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(parts.device)
    progress = console.Progress(total, state.batch_in_epoch, f"epoch {state.epoch + 1}/{epochs}", run.is_main)
    try:
        return loop.train_one_epoch(parts, batches, state, total, stop, progress, monitor, on_step, retry_oom)
    finally:
        progress.close()


def _end_epoch(cfg: TrainConfig, parts: Parts, state: TrainState, data: pipeline.Data, run: _Run,
               stats: loop.EpochStats, monitor: memory.MemoryMonitor, t_epoch: float, world: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    """Validate, count the epoch, append its results.csv row, save last.pth (best_model.pth when the
    metric improved) and memory.md; returns the row."""
    peak_alloc, peak_reserved = monitor.peak()
    evaluated = parts.ema.module if parts.ema is not None else parts.bare
    val = (loop.validate(evaluated, data.val, parts.precision, parts.device, parts.memory_format)
           if data.val is not None else None)
    state.epoch += 1
    state.batch_in_epoch, state.position = 0, 0
    if world > 1:  # the mean over all ranks' batches, as one process would report
        stats.loss = distributed.reduce_metrics({"loss": stats.loss})["loss"] / world
    metric = val[1] if val is not None else -stats.loss
    improved = state.best_metric is None or metric > state.best_metric
    if improved:
        state.best_metric, state.best_epoch = metric, state.epoch
    row = {"epoch": state.epoch, "train_loss": stats.loss,
           "val_loss": val[0] if val else None, "top1": val[1] if val else None,
           "top5": val[2] if val else None, "lr": parts.optimizer.param_groups[0]["lr"],
           "img_per_s": stats.images * world / max(stats.seconds, 1e-9),
           "data_wait": stats.data_wait / max(stats.seconds, 1e-9),
           "epoch_s": time.perf_counter() - t_epoch, "mem_alloc_gib": peak_alloc, "mem_reserved_gib": peak_reserved,
           "batch_size": math.ceil(state.micro_batch / state.chunks),
           "accum_steps": state.accum_steps * state.chunks, "oom_retries": state.oom_retries}
    if run.is_main:
        results.append_row(run.dir / "results.csv", row)
        if run.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "epoch":
                    run.tb.add_scalar(k, v, state.epoch)
            run.tb.flush()
        saved.save_last(parts, state, data.sampler, run.meta, run.last)
        if improved:
            saved.save_best(parts, state, data.sampler, run.meta, run.best)
        _write_memory_report(run, monitor)
    say(console.epoch_line(row, cfg.epochs, improved and val is not None, stats.compile_s))
    # the first epoch's wait includes starting the workers: judge from the second on
    if data.sampler is not None and not run.advised and (state.epoch > 1 or cfg.epochs == 1):
        from dlenv.bench.data import data_wait_advice

        advice = data_wait_advice(row["data_wait"], data.plan.cache, data.plan.on_device, data.plan.workers)
        if advice:
            say(advice)
            run.advised = True
    return row


def _write_memory_report(run: _Run, monitor: memory.MemoryMonitor) -> None:
    """memory.md in the run folder (GPU runs): memory per phase of the step, and the allocator's state."""
    if run.is_main and monitor.enabled:
        from dlenv.atomic import write_text

        # a report is a help, never a reason to fail: a run that just ran out of memory writes it too
        with contextlib.suppress(OSError, RuntimeError):
            write_text(run.dir / "memory.md", memory.run_report(monitor))


def _stopped(summary: dict[str, Any], signum: int | None, last_path: Path | None, say) -> dict[str, Any]:
    say(console.stopped_line(signum, last_path))
    summary.update(status="interrupted", exit_code=console.SIGNAL_EXIT.get(signum, 130))
    return summary


def _oom_advice(cfg: TrainConfig, parts: Parts, state: TrainState, run: _Run, monitor: memory.MemoryMonitor) -> str:
    """The CUDA out-of-memory message (dlenv.memory.oom_message); memory.md then holds the allocator's state."""
    device = parts.device
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    card = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
    _write_memory_report(run, monitor)
    return memory.oom_message(math.ceil(state.micro_batch / state.chunks), state.accum_steps * state.chunks, peak,
                              card, amp=parts.precision.mode != "fp32", checkpoint=cfg.checkpoint)
