"""The epoch: `train_one_epoch` (forward and backward of each batch, the optimizer step at the end of
each accumulation window) and `validate`.

Each micro-batch is an autocast forward and a backward of loss / (micro-batches in the accumulation
window); at the window's end the optimizer steps through the one `Precision` object (unscale, clip,
step or skip on fp16 overflow), then the schedule and the EMA. The step itself is dlenv.engine.step's, the
one the --batch-size auto probe, bench-memory, bench-data and prune's fine-tuning train with too.
The loop reads the GPU's numbers (loss, finiteness) only every CHECK_EVERY micro-batches, so the CPU
stays ahead of the GPU as in a plain loop.

The machinery around the step lives in named helpers: `_Tally` (the running numbers and their
checks), `_Window` (the accumulation window), `Rescue` (the rare paths: CUDA out of memory under
--batch-size auto, handed up as `Replan` from the last optimizer step, and the fall back to eager
mode when torch.compile fails), `_CompileWatch` (the time of a step that compiled, taken out of
img/s; only looked at for a batch shape not seen yet) and the stop signal, which is only looked at
after an optimizer step (`Stop.at_step`: a flag alone, a vote of the ranks about every second in a run
of several): a stop saves the state of a step boundary as it is, so nothing has to be rolled back and a
resume continues bit for bit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dlenv import compat
from dlenv.cluster import distributed
from dlenv.engine.memory import MemoryMonitor
from dlenv.engine.step import NonFiniteLoss, Parts, forward_backward, optimizer_step
from dlenv.errors import first_line
from dlenv.runfolder.trainstate import TrainState

#: consecutive non-finite losses (or skipped fp16 steps) that stop a run
NONFINITE_LIMIT = 20
#: micro-batches between reads of the loss from the GPU (each read waits for the GPU)
CHECK_EVERY = 10


class Replan(Exception):
    """CUDA out of memory under --batch-size auto: the state is back at the last optimizer step, for the
    trainer to go on from there at half the micro-batch (dlenv.train.fit). `dropped`: the micro-batches of
    the window that are trained again."""

    def __init__(self, reason: str, dropped: int):
        super().__init__(reason)
        self.reason, self.dropped = reason, dropped


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


@dataclass
class Epoch:
    """What one epoch's training goes over and reports to: its batches (until `total` of the epoch's are
    done), the stop signal, the progress line, the memory monitor, and a hook after each optimizer step."""

    batches: Iterator
    total: int
    stop: Any
    progress: Any
    monitor: MemoryMonitor
    on_step: Callable[[TrainState], None] | None = None


def train_one_epoch(parts: Parts, state: TrainState, epoch: Epoch, rescue: Rescue) -> EpochStats:
    """Train on `epoch.batches` until `epoch.total` loader batches of this epoch are done, or a stop signal.

    Updates `state` in place. A stop (`stop.at_step()`) is honoured after an optimizer step only,
    so the state it leaves is a step boundary's. Raises NonFiniteLoss for a run of non-finite losses
    or skipped steps, and Replan for an out-of-memory error `rescue` takes (the state then back at the
    last optimizer step); other out-of-memory and compile errors propagate unless `rescue` takes them.
    """
    batches, total, stop, monitor = epoch.batches, epoch.total, epoch.stop, epoch.monitor
    parts.model.train()
    tally = _Tally(parts.device, monitor, epoch.progress, state.epoch_loss)
    window = _Window()
    watch = _CompileWatch(parts, tally)
    interrupted = False
    while state.batch_in_epoch < total:
        batch = tally.wait_for(batches)
        if batch is None:
            break
        images, targets = batch
        images = images.to(parts.device, non_blocking=True, memory_format=parts.memory_format)
        targets = targets.to(parts.device, non_blocking=True)
        n = images.shape[0]
        window.open(state, total)
        record = monitor if state.batch_in_epoch % CHECK_EVERY == 0 else None
        # forward and backward of loss / window size; after a failed compile once more eagerly, and a CUDA
        # out of memory under --batch-size auto raises Replan (Rescue.run)
        with watch(images.shape):
            loss = rescue.run(forward_backward, images, targets, window, total, record)
        tally.add(loss, n)
        state.batch_in_epoch += 1
        state.position += n
        # the optimizer step, at the end of the accumulation window
        stepped = window.close_one(n)
        if stepped:
            _step(parts, state, record, epoch.on_step)
        if tally.due(state.batch_in_epoch, total):
            tally.check(state, total)  # reads the loss from the GPU; raises NonFiniteLoss
        if stepped and stop.at_step():
            interrupted = state.batch_in_epoch < total
            break
    stats = tally.finish(interrupted)
    # a stop mid-epoch keeps the epoch's loss so far for the run file: the resume continues the same mean
    state.epoch_loss = tally.sums() if interrupted else (0.0, 0)
    return stats


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
        self.size, self.done, self.images = 1, 0, 0

    def open(self, state: TrainState, total: int) -> None:
        """At a window's first micro-batch: its size. Its loss is averaged over the batches it has."""
        if self.done == 0:
            self.size = min(state.accum_steps, total - state.batch_in_epoch)

    @property
    def closing(self) -> bool:
        """Whether the coming micro-batch is the window's last (DDP then all-reduces the gradients)."""
        return self.done + 1 == self.size

    def restart(self, state: TrainState, total: int) -> None:
        """Start the window again at the current batch (its earlier micro-batches' gradients are gone)."""
        self.done, self.images, self.size = 0, 0, min(state.accum_steps, total - state.batch_in_epoch)

    def rewind(self, state: TrainState) -> int:
        """Put `state` back at the window's start, the last optimizer step; returns the micro-batches undone."""
        done = self.done
        state.batch_in_epoch -= done
        state.position -= self.images
        self.done, self.images = 0, 0
        return done

    def close_one(self, images: int) -> bool:
        """Count a micro-batch of `images` done; True when that ended the window (time for the optimizer
        step)."""
        self.done += 1
        self.images += images
        if self.done < self.size:
            return False
        self.done, self.images = 0, 0
        return True


class _Tally:
    """The epoch's running numbers: loss (kept on the device), images, time, data wait, and the checks
    made every CHECK_EVERY micro-batches (progress, non-finite runs)."""

    def __init__(self, device: torch.device, monitor: MemoryMonitor, progress: Any,
                 carried: tuple[float, int] = (0.0, 0)):
        self.device, self.monitor, self.progress = device, monitor, progress
        # a resumed epoch goes on from the saved sum and count: the same float32 additions as without the stop
        self.total = torch.full((), float(carried[0]), device=device)
        self.finite = torch.full((), float(carried[1]), device=device)
        self.bad_run = torch.zeros((), device=device)
        self.images, self.waited, self.compile_s = 0, 0.0, 0.0
        self.t0 = time.perf_counter()

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
        self.images -= images

    def read(self) -> tuple[float, int]:
        """(mean finite loss so far, current run of non-finite losses); waits for the GPU."""
        total, finite, bad = torch.stack([self.total, self.finite, self.bad_run]).tolist()
        return (total / finite if finite else float("nan")), int(bad)

    def sums(self) -> tuple[float, int]:
        """(sum, count) of the epoch's finite losses so far, the resumed epoch's before this process included."""
        total, finite = torch.stack([self.total, self.finite]).tolist()
        return float(total), int(finite)

    @staticmethod
    def due(done: int, total: int) -> bool:
        return done % CHECK_EVERY == 0 or done == total or done == 1  # 1: a first line within seconds

    def check(self, state: TrainState, total: int) -> None:
        """Progress, and NonFiniteLoss after NONFINITE_LIMIT non-finite losses or skipped steps in a row."""
        mean_loss, bad_run = self.read()
        # img/s so far, as the epoch line and results.csv count it (`finish`: from the epoch's start, its
        # data wait and first step included, compiling left out), so the bar's last number is the
        # epoch line's; a rate over the last few batches only was another number for the same thing
        ips = self.images / max(time.perf_counter() - self.t0, 1e-9)
        self.progress.update(state.batch_in_epoch, mean_loss, ips, self.monitor.peak()[0])
        if bad_run >= NONFINITE_LIMIT or state.skipped_run >= NONFINITE_LIMIT:
            raise NonFiniteLoss(f"{max(bad_run, state.skipped_run)} non-finite losses or skipped "
                                f"steps in a row (epoch {state.epoch + 1}, step {state.step})")

    def finish(self, interrupted: bool) -> EpochStats:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.t0
        return EpochStats(self.read()[0], self.images, seconds, self.waited, interrupted, self.compile_s)


# ---------------------------------------------------------------------------------------------------
# The rare paths around the step.


class _CompileWatch:
    """Takes the time of a micro-batch in which torch.compile compiled a graph out of the speed. A graph
    is compiled at the first call and again for a new input shape (the short last batch, the smaller
    micro-batch after an OOM), so only a shape this epoch has not seen yet is watched; the rest pass
    untouched."""

    _nothing = contextlib.nullcontext()

    def __init__(self, parts: Parts, tally: _Tally):
        self.parts, self.tally, self.seen = parts, tally, set()

    def __call__(self, shape: torch.Size) -> Any:
        if self.parts.eager is None or shape in self.seen:
            return self._nothing
        self.seen.add(shape)
        return self._timed(shape[0])

    @contextlib.contextmanager
    def _timed(self, images: int):
        graphs, t = compat.compiled_graphs(), time.perf_counter()
        yield
        if compat.compiled_graphs() != graphs:  # this micro-batch compiled a graph
            self.tally.compiled(time.perf_counter() - t, images)


class Rescue:
    """What a batch's failed forward and backward can be rescued from; anything else propagates.

    With `retry_oom` (--batch-size auto on one GPU, a micro-batch that halves), a CUDA out-of-memory error
    puts the state back at the last optimizer step and raises Replan: the trainer goes on from there at
    half the micro-batch with twice the accumulation, the same images per step. When torch.compile fails
    (it compiles at the first call, and again for a new shape), the run says why in one line and goes on
    with the eager model, the window starting again at this batch: the gradients of its earlier
    micro-batches are dropped (a failed backward leaves them partial). Only the main process says so (`say`).
    """

    def __init__(self, parts: Parts, state: TrainState, progress: Any, say: Callable[[str], None],
                 retry_oom: bool = False):
        self.parts, self.state, self.progress, self.say, self.retry_oom = parts, state, progress, say, retry_oom

    def run(self, step: Callable[..., torch.Tensor], images: torch.Tensor, targets: torch.Tensor,
            window: _Window, total: int, monitor: MemoryMonitor | None) -> torch.Tensor:
        """`step(parts, images, targets, 1 / window size, sync=, monitor=)` (dlenv.engine.step.forward_backward),
        and its loss: once, and after a failed compile once more with the eager model. Raises Replan for an
        out-of-memory error it takes; any other error propagates."""
        parts, state = self.parts, self.state
        while True:  # at most twice: the eager model's compile errors are not taken (parts.eager is None then)
            try:
                return step(parts, images, targets, 1.0 / window.size, sync=window.closing, monitor=monitor)
            except Exception as e:  # a stop signal is a BaseException: on its way out, never taken
                oom = self.retry_oom and compat.is_oom(e)
                failed_compile = parts.eager is not None and not compat.is_oom(e) and compat.is_compile_error(e)
                if not (oom or failed_compile):
                    raise
                reason = first_line(compat.cause_chain(e)[-1])  # the root: compile wraps a backend's error
            # here, out of the except block, the error is gone and with it the failed step's frames and tensors:
            # only its line is kept
            parts.optimizer.zero_grad(set_to_none=True)
            self.progress.update(state.batch_in_epoch, float("nan"), 0.0, 0.0)
            if oom:
                torch.cuda.empty_cache()  # give the fragments of the failed step back before the smaller plan
                raise Replan(reason, window.rewind(state))
            dropped = f"; {window.done} micro-batch(es) of this window are skipped" if window.done else ""
            parts.model, parts.eager = parts.eager, None
            self.say(f"--compile: torch.compile failed ({reason}); training eagerly from here{dropped}")
            window.restart(state, total)


# ---------------------------------------------------------------------------------------------------
# Validation.


class Scores(NamedTuple):
    """Validation over every rank's shard: mean loss, top-1 and top-5 accuracy in %."""

    loss: float
    top1: float
    top5: float


@torch.no_grad()
def validate(model: nn.Module, batches: Any, precision: Any, device: torch.device,
             memory_format: torch.memory_format) -> Scores | None:
    """The Scores over `batches` of every rank (top-5 is top-k for k = min(5, classes)); None if empty."""
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
    return Scores(t["loss"] / t["n"], 100.0 * t["top1"] / t["n"], 100.0 * t["top5"] / t["n"])
