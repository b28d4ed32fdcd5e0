"""The epochs of a run: `fit` trains, validates, records and saves until the plan's epochs are done or
a signal stops the run.

Each epoch: the training part (dlenv.train.loop.train_one_epoch) from where the state says, then
validation, one results.csv row, last.pth (best_model.pth when the metric improved) and memory.md,
all written by rank 0 only. The fixed objects of a run (plan, parts, data, run folder, memory
monitor) sit in one `_Epochs`, so each epoch's functions take only what changes.

CUDA out of memory under --batch-size auto (the loop's Replan, the state back at the last optimizer
step) re-plans the run at half the micro-batch and twice the accumulation (`TrainPlan.halved`): the
loaders are built again at the new batch and the epoch goes on from that step, as a resume would. The
same images make each optimizer step, and config.yaml and every later save record the new split, so
a --resume continues with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv import compat, errors, runfolder
from dlenv.cluster import distributed, launch
from dlenv.data import pipeline
from dlenv.engine import memory
from dlenv.engine.step import NonFiniteLoss, Parts
from dlenv.errors import EXIT_NONFINITE, EXIT_OOM, UserError, host_memory_line
from dlenv.files import runstate
from dlenv.files.atomic import write_text
from dlenv.model import finetune
from dlenv.runfolder import results, runstatus, trainstate
from dlenv.runfolder.trainstate import TrainState
from dlenv.train import console, loop
from dlenv.train.loop import Replan
from dlenv.train.plan import TrainPlan, per_rank
from dlenv.watch.probes import GpuBusy


@dataclass
class Run:
    """Where a run writes (only the main process writes) and what every save carries."""

    dir: Path | None            # None on other ranks of a new run
    meta: dict[str, Any]
    tb: Any                     # a TensorBoard SummaryWriter, or None
    is_main: bool
    lock: Any = None            # runfolder.RunLock: a second run in this folder is refused while it lives
    advised: bool = False       # the data-wait explanation is given once per run
    held: int = 0               # bytes of the GPU the process held before the run (not counted in its peaks)
    tracker: Any = None         # dlenv.train.tracking.Tracker (MLflow), or None

    @property
    def last(self) -> Path | None:
        return self.dir / runfolder.LAST if self.dir else None

    @property
    def best(self) -> Path | None:
        return self.dir / runfolder.BEST if self.dir else None


def fit(decided: TrainPlan, parts: Parts, state: TrainState, data: pipeline.Data, run: Run,
        say: Callable[[str], None], rebuild: Callable[[TrainPlan], pipeline.Data],
        on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """`_fit`, with how it ended recorded in the run folder's status.yaml by the main process
    (dlenv.runfolder.runstatus: finished, stopped with its resume line, failed with its one line)."""
    flags = launch.relaunch_flags(decided.config)
    with runstatus.recording(run.dir if run.is_main else None,
                             lambda: f"Resume with: {console.way_on(run.last, flags)}") as record:
        record["summary"] = _fit(decided, parts, state, data, run, say, rebuild, on_step)
        return record["summary"]


def _fit(decided: TrainPlan, parts: Parts, state: TrainState, data: pipeline.Data, run: Run,
         say: Callable[[str], None], rebuild: Callable[[TrainPlan], pipeline.Data],
         on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """Epochs until the plan's are done or a signal stops the run; returns the summary (see `train`).

    A stop saves last.pth at the step boundary the loop stopped at. Non-finite losses and CUDA or host out
    of memory become one UserError each (exit 4 and 3) naming the last good run file (an OOM under
    --batch-size auto re-plans instead, the data built again by `rebuild`, see the module doc); a
    failed peer becomes dlenv.cluster.distributed.PeerFailure.
    """
    summary: dict[str, Any] = {"run_dir": str(run.dir) if run.dir else None, "status": "done", "exit_code": 0,
                               "precision": parts.precision.mode, "batch_size": state.micro_batch,
                               "accum_steps": state.accum_steps, "last": str(run.last) if run.last else None,
                               "best": str(run.best) if run.best else None, "img_per_s": None,
                               "peak_alloc_gib": None, "compile_s": 0.0}
    epochs = _Epochs(decided, parts, data, run, memory.MemoryMonitor(parts.device, run.held), say, rebuild)
    epochs.eta, t_run = console.run_eta(decided.epochs, decided.batches_per_epoch, state.epoch, state.batch_in_epoch,
                                        data.val), time.perf_counter()
    # the handlers stay until the workers are shut down: a signal in that last moment is only noted
    # a stop signal during start-up that a library swallowed (errors.stop noted it): honoured here, before the
    # epochs' own handlers take over, not lost
    errors.check_stop()
    flags = launch.relaunch_flags(decided.config)  # the resume lines name how the run was launched (--gpus 2)
    with console.Stop(say, decided.world_size, run.last, flags) as stop:
        try:
            while state.epoch < decided.epochs:
                t_epoch = time.perf_counter()
                stop.moment = "this optimizer step"
                try:
                    stats = epochs.train(state, stop, on_step)
                except Replan as e:
                    epochs.replan(state, e)
                    continue
                if stats.interrupted:
                    stop.moment = "this save"
                    rng = distributed.gather(runstate.rng_state())  # every rank's streams, on every rank here
                    if run.is_main:
                        # the way on first, before the save: a kill during it still leaves it in the log
                        say(console.stopping_line(state.epoch, state.batch_in_epoch, decided.batches_per_epoch,
                                                  state.step, run.last, flags))
                        trainstate.save_last(parts, state, epochs.data.sampler, run.meta, run.last, rng)
                    return _stopped(summary, stop.stopped_by, run.last, say, flags)
                row = epochs.end(state, stats, t_epoch, stop)
                summary["compile_s"] = summary["compile_s"] + stats.compile_s
                summary.update(img_per_s=row["img_per_s"], peak_alloc_gib=row["mem_alloc_gib"],
                               batch_size=row["batch_size"], accum_steps=row["accum_steps"])
                if stop.requested():
                    return _stopped(summary, stop.stopped_by, run.last, say, flags)
        except NonFiniteLoss as e:
            raise UserError(f"training stopped: {e}. {trainstate.last_good(run.last)} Try a lower --lr, --clip-grad "
                            "1.0, or --amp-dtype bf16 instead of fp16", exit_code=EXIT_NONFINITE) from None
        except (RuntimeError, MemoryError) as e:
            host = host_memory_line(e, state.micro_batch, decided.config.img_size, decided.config.workers,
                                    state.accum_steps)
            if host is not None:  # the batch that did it is this state's, not the flag's (auto, a re-plan)
                raise UserError(f"{host}. {trainstate.last_good(run.last)}", exit_code=EXIT_OOM) from None
            if decided.world_size > 1 and distributed.is_peer_error(e):  # e.g. in DDP's gradient all-reduce
                raise distributed.peer_failure(e, "a training step") from None
            if not compat.is_oom(e):
                raise
            advice = epochs.oom_advice(state)
            memory.release_failed_step(e)  # the failed step's tensors, which a kept exception would hold
            raise UserError(advice, exit_code=EXIT_OOM) from None
        finally:
            if run.tb is not None:
                run.tb.close()
            _close_loaders(epochs.data)
            if epochs.busy is not None:
                epochs.busy.close()
    best = run.best if run.best is not None and run.best.is_file() else None
    summary.update(epochs=state.epoch, step=state.step, best_metric=state.best_metric,
                   best=str(best) if best else None)
    say(console.done_line(state.epoch, time.perf_counter() - t_run, "top-1" if epochs.data.val is not None else "-loss",
                          state.best_metric, best, run.dir))
    return summary


def _close_loaders(data: pipeline.Data) -> None:
    """Shut the loaders' worker processes down at the end of a run, however it ends: left to the garbage
    collector, each would cost a 5 s wait at some later point of the process (loaders.SafeLoader)."""
    for loader in (data.train, data.val):
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def _stopped(summary: dict[str, Any], signum: int | None, last_path: Path | None, say,
             flags: list[str]) -> dict[str, Any]:
    line = console.stopped_line(signum, last_path, flags)
    say(line)
    summary.update(status="interrupted", exit_code=console.SIGNAL_EXIT.get(signum, 130), line=line)
    return summary


@dataclass
class _Epochs:
    """What stays the same from epoch to epoch of one run."""

    plan: TrainPlan
    parts: Parts
    data: pipeline.Data
    run: Run
    monitor: memory.MemoryMonitor
    say: Callable[[str], None]
    rebuild: Callable[[TrainPlan], pipeline.Data]  # the data for another plan of this run (`replan`)
    eta: Any = None                 # progress.RunEta: the time left in the whole run
    busy: Any = None                # dlenv.watch.probes.GpuBusy on CUDA: the epoch's gpu_busy column

    def train(self, state: TrainState, stop: console.Stop,
              on_step: Callable[[TrainState], None] | None) -> loop.EpochStats:
        """The training part of an epoch, from where `state` says (a resumed epoch starts mid-way)."""
        parts, data = self.parts, self.data
        if data.sampler is not None:
            data.sampler.set_epoch(state.epoch, start=state.position)
        finetune.set_epoch(parts.bare, state.epoch)  # --freeze-epochs: the head alone, then everything
        total = min(state.batch_in_epoch + len(data.train), self.plan.batches_per_epoch)
        batches = iter(data.train)
        if parts.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(parts.device)
            if self.busy is None:  # NVML in a light thread: the share of the epoch a kernel ran
                self.busy = GpuBusy(parts.device.index if parts.device.index is not None
                                    else torch.cuda.current_device())
            self.busy.start()
        progress = console.Progress(total, state.batch_in_epoch, f"epoch {state.epoch + 1}/{self.plan.epochs}",
                                    self.run.is_main, run_eta=self.eta, world=self.plan.world_size)
        rescue = loop.Rescue(parts, state, progress, self.say, retry_oom=self.plan.halves)
        try:
            return loop.train_one_epoch(parts, state, loop.Epoch(batches, total, stop, progress, self.monitor, on_step),
                                        rescue)
        finally:
            progress.close()

    def end(self, state: TrainState, stats: loop.EpochStats, t_epoch: float, stop: console.Stop) -> dict[str, Any]:
        """Validate, count the epoch, append its results.csv row, save last.pth (best_model.pth when the
        metric improved) and memory.md; returns the row. A stop signal meanwhile is taken after all of
        that (`stop.moment` names where it came)."""
        parts, data, run, world = self.parts, self.data, self.run, self.plan.world_size
        peak_alloc, peak_reserved = self.monitor.peak()
        busy = self.busy.stop() if self.busy is not None else None  # training only, not validation
        evaluated = parts.ema.module if parts.ema is not None else parts.bare
        t_val = time.perf_counter()
        stop.moment = "this epoch (its validation, then the save)"
        val = (loop.validate(evaluated, data.val, parts.precision, parts.device, parts.memory_format)
               if data.val is not None else None)
        if self.eta is not None:
            self.eta.validated(time.perf_counter() - t_val)
        state.epoch += 1
        state.batch_in_epoch, state.position = 0, 0
        if world > 1:  # the mean over all ranks' batches, as one process would report
            stats.loss = distributed.reduce_metrics({"loss": stats.loss})["loss"] / world
        metric = val.top1 if val is not None else -stats.loss
        improved = state.best_metric is None or metric > state.best_metric
        if improved:
            state.best_metric, state.best_epoch = metric, state.epoch
        row = {"epoch": state.epoch, "train_loss": stats.loss,
               "val_loss": val.loss if val else None, "top1": val.top1 if val else None,
               "top5": val.top5 if val else None, "lr": parts.optimizer.param_groups[0]["lr"],
               "img_per_s": stats.images * world / max(stats.seconds, 1e-9),
               "data_wait": stats.data_wait / max(stats.seconds, 1e-9),
               "epoch_s": time.perf_counter() - t_epoch, "mem_alloc_gib": peak_alloc,
               "mem_reserved_gib": peak_reserved, "batch_size": state.micro_batch,
               "accum_steps": state.accum_steps, "oom_retries": state.oom_retries,
               "gpu_busy": None if busy is None else busy / 100.0}
        stop.moment = "this epoch's save"
        rng = distributed.gather(runstate.rng_state())  # each rank's streams: a resume gives each its own
        if run.is_main:
            results.append_row(run.dir / "results.csv", row)
            if run.tracker is not None:
                run.tracker.epoch(row, state.step)
            if run.tb is not None:
                for k, v in row.items():
                    if isinstance(v, (int, float)) and k != "epoch":
                        run.tb.add_scalar(k, v, state.epoch)
                run.tb.flush()
            trainstate.save_last(parts, state, data.sampler, run.meta, run.last, rng)
            if improved:
                trainstate.save_best(parts, state, data.sampler, run.meta, run.best)
            self.write_memory_report()
        self.say(console.epoch_line(row, self.plan.epochs, improved and val is not None, stats.compile_s, self.eta))
        # the first epoch's wait includes starting the workers: judge from the second on
        if data.sampler is not None and not run.advised and (state.epoch > 1 or self.plan.epochs == 1):
            advice = console.data_wait_advice(row["data_wait"], data.plan.cache, data.plan.on_device,
                                              data.plan.workers, parts.device.type)
            if advice:
                self.say(advice)
                run.advised = True
        return row

    def replan(self, state: TrainState, oom: Replan) -> None:
        """Go on from the last optimizer step (where `state` is) at half the micro-batch and twice the
        accumulation: the plan, the loaders, the counters, config.yaml and what later saves record."""
        before = self.plan
        self.plan = before.halved(per_rank(before.data, before.micro_batch // 2))  # one GPU: rank 0 of 1
        _close_loaders(self.data)
        if self.parts.device.type == "cuda":
            # the failed step's blocks back to the driver: cuDNN autotunes the new shapes with workspace up
            # to the largest cached block (see run._train), which must not be one the OOM left behind
            torch.cuda.empty_cache()
        self.data = self.rebuild(self.plan)
        state.micro_batch, state.accum_steps = self.plan.micro_batch, self.plan.accum_steps
        state.batch_in_epoch *= 2  # the same images in batches of half the size
        state.oom_retries += 1
        self.eta = console.run_eta(self.plan.epochs, self.plan.batches_per_epoch, state.epoch, state.batch_in_epoch,
                                   self.data.val)
        options = self.plan.options()
        options["name"] = self.run.meta["config"].get("name", options["name"])  # the folder it got
        self.run.meta["config"] = options
        if self.run.is_main:
            trainstate.write_config_yaml(self.run.dir / "config.yaml", self.run.meta["config"],
                                    self.plan.notes(self.parts.device))
        again = f"; {oom.dropped} micro-batch(es) of the window are trained again" if oom.dropped else ""
        self.say(f"CUDA out of memory ({oom.reason}): continuing from the last optimizer step with micro-batch "
                 f"{self.plan.micro_batch} x {self.plan.accum_steps} accumulation (same images per step){again}")

    def write_memory_report(self) -> None:
        """memory.md in the run folder (GPU runs): memory per phase of the step, and the allocator's state."""
        if self.run.is_main and self.monitor.enabled:

            # a report is a help, never a reason to fail: a run that just ran out of memory writes it too
            with contextlib.suppress(OSError, RuntimeError):
                write_text(self.run.dir / "memory.md", memory.run_report(self.monitor))

    def oom_advice(self, state: TrainState) -> str:
        """The CUDA out-of-memory message (dlenv.engine.memory.oom_message); memory.md then holds the allocator's
        state. Checkpointing counts as on where the plan recomputes blocks (`TrainPlan.recomputed_blocks`, what
        the start line names): --checkpoint that recomputes none (a CPU's auto, ratio 0) is still advised."""
        device = self.parts.device
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        card = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
        self.write_memory_report()
        return memory.oom_message(state.micro_batch, state.accum_steps, peak, card,
                                  amp=self.parts.precision.mode != "fp32",
                                  checkpoint=self.plan.recomputed_blocks > 0)
