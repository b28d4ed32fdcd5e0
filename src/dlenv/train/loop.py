"""The epoch and the step: `train_one_epoch`, `forward_backward`, `optimizer_step`, `validate`.

Each micro-batch is an autocast forward and a backward of loss / (micro-batches in the accumulation
window); at the window's end the optimizer steps through the one `Precision` object (unscale, clip,
step or skip on fp16 overflow), then the schedule and the EMA. The loop reads the GPU's numbers
(loss, finiteness) only every CHECK_EVERY micro-batches, so the CPU stays ahead of the GPU as in a
plain loop. `train_step` is the same step on one batch, for everything else that trains: the
--batch-size auto probe, bench-memory, bench-data and prune's fine-tuning.

The machinery around the step lives in named helpers: `_Tally` (the running numbers and their
checks), `_Window` (the accumulation window), `_forward_backward` (the OOM retry of --batch-size
auto, and the fall back to eager mode when torch.compile fails) and the stop signal, which is only
looked at after an optimizer step: a stop saves the state of a step boundary as it is, so nothing
has to be rolled back and a resume continues bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlenv import compat, distributed
from dlenv.errors import first_line
from dlenv.memory import MemoryMonitor

#: consecutive non-finite losses (or skipped fp16 steps) that stop a run
NONFINITE_LIMIT = 20
#: micro-batches between reads of the loss from the GPU (each read waits for the GPU)
CHECK_EVERY = 10


@dataclass
class TrainState:
    """Counters of a run. `micro_batch` x `accum_steps` images per optimizer step per GPU.

    A loader batch of `micro_batch` images is split into `chunks` pieces (1 unless an OOM was
    retried), so the micro-batch that meets the GPU is micro_batch / chunks.
    """

    micro_batch: int
    accum_steps: int
    epoch: int = 0              # completed epochs
    step: int = 0               # optimizer steps done
    batch_in_epoch: int = 0     # loader batches trained on in the current epoch
    position: int = 0           # samples of the current epoch trained on (the sampler position)
    best_metric: float | None = None
    best_epoch: int | None = None   # the epoch whose end set best_metric (best_model.pth's weights)
    chunks: int = 1
    oom_retries: int = 0
    skipped_run: int = 0        # consecutive skipped (fp16 overflow) optimizer steps

    def saved(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps, "chunks": self.chunks,
                "oom_retries": self.oom_retries}


@dataclass
class Parts:
    """The objects a step needs, passed explicitly instead of the whole config."""

    model: nn.Module            # what runs forward (compiled / wrapped for DDP)
    bare: nn.Module             # the plain module: state dicts, EMA, checkpoints
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Any
    criterion: nn.Module
    ema: Any
    device: torch.device
    memory_format: torch.memory_format
    clip: float | None
    eager: nn.Module | None = None  # the model before torch.compile: what a failed compile falls back to

    @classmethod
    def plain(cls, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Any,
              memory_format: torch.memory_format = torch.contiguous_format, scheduler: Any = None) -> Parts:
        """The parts of a plain training step: cross-entropy, no EMA, no clipping, no DDP (the bench
        commands, the --batch-size auto probe, prune's fine-tuning)."""
        device = next(model.parameters()).device
        return cls(model, model, optimizer, scheduler, precision, nn.CrossEntropyLoss(), None, device, memory_format,
                   None)


class NonFiniteLoss(Exception):
    """A run of non-finite losses or skipped steps; the trainer turns it into exit 4."""


@dataclass
class EpochStats:
    loss: float                 # mean finite training loss of this process
    images: int
    seconds: float              # training time, without compiling
    data_wait: float            # seconds spent waiting for the next batch
    interrupted: bool           # a stop signal ended the epoch early (at a step boundary)
    compile_s: float = 0.0      # seconds of steps in which torch.compile compiled (not in `seconds`)


# ---------------------------------------------------------------------------------------------------
# The epoch.


def train_one_epoch(parts: Parts, batches: Iterator, state: TrainState, total: int, stop: Any, progress: Any,
                    monitor: MemoryMonitor, on_step: Callable[[TrainState], None] | None = None,
                    retry_oom: bool = False) -> EpochStats:
    """Train on `batches` until `total` loader batches of this epoch are done, or a stop signal.

    Updates `state` in place. A stop (`stop.requested()`) is honoured after an optimizer step only,
    so the state it leaves is a step boundary's. Raises NonFiniteLoss for a run of non-finite losses
    or skipped steps; CUDA out-of-memory errors propagate unless `retry_oom` (then the batch is split
    in more micro-batches and redone).
    """
    parts.model.train()
    tally = _Tally(parts.device, monitor, progress)
    window = _Window()
    interrupted = False
    while state.batch_in_epoch < total:
        batch = tally.wait_for(batches)
        if batch is None:
            break
        images = batch[0].to(parts.device, non_blocking=True, memory_format=parts.memory_format)
        targets = batch[1].to(parts.device, non_blocking=True)
        window.open(state, total)
        record = monitor if state.batch_in_epoch % CHECK_EVERY == 0 else None
        graphs, t = (compat.compiled_graphs() if parts.eager is not None else None), time.perf_counter()
        loss = _forward_backward(parts, images, targets, state, window, total, record, retry_oom, progress)
        tally.add(loss, images.shape[0])
        if graphs is not None and compat.compiled_graphs() != graphs:  # this micro-batch compiled a graph
            tally.compiled(time.perf_counter() - t, images.shape[0])
        state.batch_in_epoch += 1
        state.position += images.shape[0]
        stepped = window.close_one()
        if stepped:
            _step(parts, state, record, on_step)
        if tally.due(state.batch_in_epoch, total):
            tally.check(state, total)  # reads the loss from the GPU; raises NonFiniteLoss
        if stepped and stop.requested(check_peers=tally.take_vote()):
            interrupted = state.batch_in_epoch < total
            break
    return tally.finish(interrupted)


def _step(parts: Parts, state: TrainState, monitor: MemoryMonitor | None,
          on_step: Callable[[TrainState], None] | None) -> None:
    stepped = optimizer_step(parts)
    if monitor is not None:
        monitor.record_memory("step")
    state.step += 1
    state.skipped_run = 0 if stepped else state.skipped_run + 1
    if on_step is not None:
        on_step(state)


class _Window:
    """Where the loop is in the current accumulation window (the last one of an epoch may be short)."""

    def __init__(self):
        self.size, self.done = 1, 0

    def open(self, state: TrainState, total: int) -> None:
        """At a window's first micro-batch: its size. Its loss is averaged over the batches it has."""
        if self.done == 0:
            self.size = min(state.accum_steps, total - state.batch_in_epoch)

    @property
    def closing(self) -> bool:
        """Whether the coming micro-batch is the window's last (DDP then all-reduces the gradients)."""
        return self.done + 1 == self.size

    def close_one(self) -> bool:
        """Count a micro-batch done; True when that ended the window (time for the optimizer step)."""
        self.done += 1
        if self.done < self.size:
            return False
        self.done = 0
        return True


class _Tally:
    """The epoch's running numbers: loss (kept on the device), images, time, data wait, and the checks
    made every CHECK_EVERY micro-batches (progress, non-finite runs, the cue for a stop vote)."""

    def __init__(self, device: torch.device, monitor: MemoryMonitor, progress: Any):
        self.device, self.monitor, self.progress = device, monitor, progress
        self.total = torch.zeros((), device=device)
        self.finite = torch.zeros((), device=device)
        self.bad_run = torch.zeros((), device=device)
        self.images, self.waited, self.vote_due, self.compile_s = 0, 0.0, False, 0.0
        self.t0 = self.last_check = time.perf_counter()
        self.last_images = 0

    def wait_for(self, batches: Iterator) -> Any:
        """The next batch (None at the end), timing the wait."""
        t = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return None
        self.waited += time.perf_counter() - t
        return batch

    def add(self, loss: torch.Tensor, images: int) -> None:
        """Count a micro-batch's loss without waiting for the GPU."""
        ok = torch.isfinite(loss)
        self.total += torch.where(ok, loss, torch.zeros_like(loss))
        self.finite += ok
        self.bad_run = torch.where(ok, torch.zeros_like(self.bad_run), self.bad_run + 1)
        self.images += images

    def compiled(self, seconds: float, images: int) -> None:
        """Take a micro-batch that compiled out of the speed: compiling is a phase of its own."""
        self.compile_s += seconds
        self.t0 += seconds
        self.last_check += seconds
        self.images -= images
        self.last_images -= images

    def read(self) -> tuple[float, int]:
        """(mean finite loss so far, current run of non-finite losses); waits for the GPU."""
        total, finite, bad = torch.stack([self.total, self.finite, self.bad_run]).tolist()
        return (total / finite if finite else float("nan")), int(bad)

    @staticmethod
    def due(done: int, total: int) -> bool:
        return done % CHECK_EVERY == 0 or done == total

    def check(self, state: TrainState, total: int) -> None:
        """Progress, and NonFiniteLoss after NONFINITE_LIMIT non-finite losses or skipped steps in a row."""
        mean_loss, bad_run = self.read()
        now = time.perf_counter()
        ips = (self.images - self.last_images) / max(now - self.last_check, 1e-9)
        self.last_check, self.last_images = now, self.images
        self.progress.update(state.batch_in_epoch, mean_loss, ips, self.monitor.peak()[0])
        self.vote_due = True
        if bad_run >= NONFINITE_LIMIT or state.skipped_run >= NONFINITE_LIMIT:
            raise NonFiniteLoss(f"{max(bad_run, state.skipped_run)} non-finite losses or skipped "
                                f"steps in a row (epoch {state.epoch + 1}, step {state.step})")

    def take_vote(self) -> bool:
        """Whether the ranks vote on a stop at this step boundary: the first one after each check, a
        point every rank passes in the same order (the vote waits for the GPU, as the check does)."""
        due, self.vote_due = self.vote_due, False
        return due

    def finish(self, interrupted: bool) -> EpochStats:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.t0
        return EpochStats(self.read()[0], self.images, seconds, self.waited, interrupted, self.compile_s)


# ---------------------------------------------------------------------------------------------------
# The step.


def _pieces(images: torch.Tensor, targets: torch.Tensor, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch in `chunks` near-equal pieces of at least two samples each: BatchNorm in train mode
    raises on a single sample (5 images in 4 chunks are 3 + 2, not 2 + 2 + 1)."""
    k = max(1, min(chunks, images.shape[0] // 2))
    return list(zip(images.tensor_split(k), targets.tensor_split(k), strict=True))


def forward_backward(parts: Parts, images: torch.Tensor, targets: torch.Tensor, weight: float, chunks: int,
                     sync: bool, monitor: MemoryMonitor | None = None) -> torch.Tensor:
    """Forward and backward of one loader batch (in `chunks` pieces), gradients scaled by `weight`.

    Returns the batch's loss (detached). `sync=False` skips the DDP gradient all-reduce (accumulation).
    """
    n = images.shape[0]
    total = torch.zeros((), device=images.device)
    pieces = _pieces(images, targets, chunks)
    for i, (x, y) in enumerate(pieces):
        last = sync and i == len(pieces) - 1
        with distributed.no_sync_context(parts.model, last):
            with parts.precision.autocast():
                loss = parts.criterion(parts.model(x), y)
            if monitor is not None:
                monitor.record_memory("forward")
            share = x.shape[0] / n
            scale = weight * share
            parts.precision.backward(loss if scale == 1.0 else loss * scale)
        if monitor is not None:
            monitor.record_memory("backward")
        total = total + loss.detach().float() * share
    return total


def optimizer_step(parts: Parts) -> bool:
    """Unscale, clip, step (or skip on fp16 overflow), then schedule and EMA; True if it stepped."""
    params = parts.bare.parameters() if parts.clip else None
    stepped = parts.precision.step(parts.optimizer, clip=parts.clip, parameters=params)
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.scheduler is not None:
        parts.scheduler.step()
    if parts.ema is not None and stepped is not False:
        parts.ema.update(parts.bare)
    return stepped is not False


def train_step(parts: Parts, images: torch.Tensor, targets: torch.Tensor,
               monitor: MemoryMonitor | None = None) -> tuple[torch.Tensor, bool]:
    """One optimizer step on one batch, the trainer's own (`forward_backward` then `optimizer_step`):
    (the batch's loss, detached; whether the optimizer stepped: False when fp16 skipped it)."""
    loss = forward_backward(parts, images, targets, 1.0, 1, sync=True, monitor=monitor)
    return loss, optimizer_step(parts)


def _forward_backward(parts: Parts, images: torch.Tensor, targets: torch.Tensor, state: TrainState,
                      window: _Window, total: int, monitor: MemoryMonitor | None, retry_oom: bool,
                      progress: Any) -> torch.Tensor:
    """`forward_backward` of a loader batch in its window. With `retry_oom` (--batch-size auto), a CUDA
    out-of-memory error splits every batch into twice as many micro-batches, and the window starts
    again at this batch: the gradients of its earlier micro-batches are dropped (a failed backward
    leaves them partial). The same happens when torch.compile fails (it compiles at the first call,
    and again for a new shape): the run says why in one line and goes on with the eager model."""
    while True:
        try:
            return forward_backward(parts, images, targets, 1.0 / window.size, state.chunks, sync=window.closing,
                                    monitor=monitor)
        except Exception as e:
            oom = retry_oom and compat.is_oom(e) and state.chunks * 2 <= images.shape[0]
            failed_compile = parts.eager is not None and not compat.is_oom(e) and compat.is_compile_error(e)
            if not (oom or failed_compile):
                raise
            reason = first_line(compat.cause_chain(e)[-1])  # the root: compile wraps a backend's error
        # here, outside the except block, the failed step's tensors are already freed
        parts.optimizer.zero_grad(set_to_none=True)
        dropped = f"; {window.done} micro-batch(es) of this window are skipped" if window.done else ""
        progress.update(state.batch_in_epoch, float("nan"), 0.0, 0.0)
        if failed_compile:
            parts.model, parts.eager = parts.eager, None
            print(f"--compile: torch.compile failed ({reason}); training eagerly from here{dropped}", flush=True)
        else:
            torch.cuda.empty_cache()  # give the fragments of the failed step back before the smaller retry
            state.chunks *= 2
            state.oom_retries += 1
            print(f"CUDA out of memory: continuing with micro-batch {math.ceil(state.micro_batch / state.chunks)} x "
                  f"{state.accum_steps * state.chunks} accumulation (same images per step){dropped}", flush=True)
        window.done, window.size = 0, min(state.accum_steps, total - state.batch_in_epoch)


# ---------------------------------------------------------------------------------------------------
# Validation.


@torch.no_grad()
def validate(model: nn.Module, batches: Any, precision: Any, device: torch.device,
             memory_format: torch.memory_format) -> tuple[float, float, float] | None:
    """(loss, top-1 %, top-5 %) over `batches` of every rank (top-5 is top-k for k = min(5, classes));
    None if empty."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros(2, device=device, dtype=torch.int64)
    n = 0
    for images, targets in batches:
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum")
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(targets[:, None])
        correct += torch.stack([hit[:, 0].sum(), hit.any(dim=1).sum()])
        n += targets.shape[0]
    model.train(was_training)
    # sums, not means, over the ranks' shards (uneven ones too): every val image counts once
    t = distributed.reduce_metrics({"loss": loss_sum, "top1": correct[0], "top5": correct[1], "n": n})
    if t["n"] == 0:
        return None
    return t["loss"] / t["n"], 100.0 * t["top1"] / t["n"], 100.0 * t["top5"] / t["n"]
