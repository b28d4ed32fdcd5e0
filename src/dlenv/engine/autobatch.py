"""The batch size and the checkpointing that fit: searches, and the micro-batch x accumulation x GPUs arithmetic.

`--batch-size auto` asks `fastest_batch` for the batch that trains fastest per image among those that
fit: the batch doubles, each try timing real training steps (forward, backward, optimizer step, at the
run's precision and checkpointing), and the doubling stops when img/s rises by less than `GAIN`; on a
big card the largest batch is no faster per image and a different optimisation regime (an H200 trained
ResNet-50 at 0.52-0.60x of batch 256's speed at the 3,032 that filled it). Where memory binds first
(a small card) it is the largest batch that fits. `--batch-size max` asks `find_max_batch` for that
largest batch: the batch doubles until a step runs out of memory, then the gap is bisected, and a
safety margin is taken off because a long run meets a fuller, more fragmented allocator than the
probe did.
`--checkpoint-ratio auto` asks `fewest_checkpoint_blocks` the opposite question: at a given batch, the
fewest repeated blocks whose activation checkpointing makes a real training step fit, since every
checkpointed block is recomputed in backward for nothing when memory is not short.
`plan_accumulation` turns an effective batch into micro-batch x accumulation x GPUs; `resolve_batch`
reads the batch options that way, and `resume_split` keeps a run's effective batch when it resumes
on another number of GPUs.

The search and the arithmetic are pure functions (tested on a CPU against a fake memory limit);
`make_train_step_probe` is the real `try_step` for a model on a device, and `fewest_checkpoint_blocks` the
real checkpoint search.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlenv.errors import UserError

log = logging.getLogger(__name__)

_OOM_ADVICE = ("use --amp, --checkpoint, a smaller --img-size or a smaller model, or free the GPU "
               "(nvidia-smi shows what else holds its memory)")


def _is_oom(exc: BaseException) -> bool:
    from dlenv.compat import is_oom  # imports torch; the pure logic here does not need it

    return is_oom(exc)


@dataclass
class SearchResult:
    """What `search_max_batch` found: the largest batch that ran, the smallest that did not, and each try."""

    largest_fit: int
    smallest_fail: int | None
    tries: list[tuple[int, bool]] = field(default_factory=list)
    seconds: float = 0.0


def _try(step: Callable[[int], Any], batch: int) -> Any:
    """One try: what `step(batch)` returned, or False when it raised an out-of-memory error."""
    try:
        return step(batch)
    except Exception as e:  # only OOM means "too big"; any other error is a real bug and propagates
        if _is_oom(e):
            return False
        raise


def _fits(try_step: Callable[[int], Any], batch: int) -> bool:
    """One try: True when the step ran; False when it returned False or raised an out-of-memory error."""
    return _try(try_step, batch) is not False


def search_max_batch(try_step: Callable[[int], Any], start: int = 1, upper: int | None = None,
                     tolerance: float = 0.0, what: str = "this model") -> SearchResult:
    """Largest batch for which `try_step(batch)` succeeds: doubling from `start`, then bisection.

    `try_step` returns True/None when the batch fits, False (or raises an out-of-memory error) when
    it does not; other exceptions propagate. `upper` caps the search (returned when it fits).
    Bisection stops once the gap is at most `tolerance` x the fitting batch (0: exact).
    Raises UserError when even a batch of 1 does not fit (naming `what`), and ValueError for bad
    arguments.
    """
    if start < 1 or (upper is not None and upper < 1) or tolerance < 0:
        raise ValueError(f"bad search bounds: start={start}, upper={upper}, tolerance={tolerance}")
    t0 = time.perf_counter()
    tries: list[tuple[int, bool]] = []

    def attempt(b: int) -> bool:
        ok = _fits(try_step, b)
        tries.append((b, ok))
        log.debug("batch %d: %s", b, "fits" if ok else "out of memory")
        return ok

    b = min(start, upper) if upper else start
    lo, hi = 0, None  # lo: largest known to fit; hi: smallest known to fail
    while hi is None:
        if attempt(b):
            lo = b
            if upper is not None and b >= upper:
                break
            b = min(b * 2, upper) if upper else b * 2
        else:
            hi = b
    if lo == 0:
        # the first try failed: walk down to 1 by halving before giving up
        while hi > 1:
            b = hi // 2
            if attempt(b):
                lo = b
                break
            hi = b
        if lo == 0:
            raise UserError(f"even a batch of 1 does not fit in GPU memory for {what}; {_OOM_ADVICE}")
    while hi is not None and hi - lo > max(1, int(lo * tolerance)):
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, hi, tries, time.perf_counter() - t0)


def find_max_batch(try_step: Callable[[int], Any], start: int = 1, upper: int | None = None,
                   safety: float = 0.92, tolerance: float = 0.01, what: str = "this model") -> int:
    """The largest batch that fits (see `search_max_batch`) times `safety`, rounded down, at least 1.

    The margin leaves room for what one probe does not meet: fragmentation over a long run, a
    validation pass. 0.92 with a 1% search tolerance lands within 10% of the true largest batch (the
    target of scripts/bench_autobatch.py); an OOM that still happens makes the trainer re-plan at half
    the micro-batch (dlenv.train.fit). Raises UserError when a batch of 1 does not fit.
    """
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety}")
    res = search_max_batch(try_step, start=start, upper=upper, tolerance=tolerance, what=what)
    return max(1, int(res.largest_fit * safety))


GAIN = 0.05  # a doubling that raises img/s by less than this is not worth twice the memory


@dataclass
class BatchChoice:
    """What `fastest_batch` chose: `batch`, why (one line), and each (batch, img/s or None for OOM) tried."""

    batch: int
    why: str
    tries: list[tuple[int, float | None]] = field(default_factory=list)


def fastest_batch(rate: Callable[[int], Any], start: int = 8, upper: int | None = None, gain: float = GAIN,
                  safety: float = 0.92, tolerance: float = 0.01, what: str = "this model") -> BatchChoice:
    """The batch that trains fastest per image among those that fit (`--batch-size auto`).

    `rate(batch)` runs real training steps and returns their img/s, or False / raises an out-of-memory
    error when they do not fit. The batch doubles from `start`; once a doubling raises img/s by less
    than `gain`, the smaller batch is chosen (as fast per image, half the memory). When memory runs out
    first, it is the largest batch that fits, found as `find_max_batch` finds it (bisection, `safety`).
    `upper` caps the batch (a dataset smaller than the batch). Raises UserError when a batch of 1 does
    not fit.
    """
    if start < 1 or (upper is not None and upper < 1) or gain < 0:
        raise ValueError(f"bad search bounds: start={start}, upper={upper}, gain={gain}")
    tries: list[tuple[int, float | None]] = []

    def attempt(b: int) -> float | None:
        r = _try(rate, b)
        got = None if r is False or r is None else float(r)
        tries.append((b, got))
        return got

    b = min(start, upper) if upper else start
    prev: tuple[int, float] | None = None
    while True:
        r = attempt(b)
        if r is None:
            break  # memory binds before speed stops rising
        if prev is not None and r < prev[1] * (1 + gain):
            return BatchChoice(prev[0], f"img/s rose {r / prev[1] - 1:+.0%} from batch {prev[0]} to {b}: "
                                        f"{prev[0]} trains as fast per image in half the memory", tries)
        prev = (b, r)
        if upper is not None and b >= upper:
            return BatchChoice(b, f"the whole training set ({upper} images) in one batch", tries)
        b = min(b * 2, upper) if upper else b * 2
    # out of memory while img/s still rose: the largest batch that fits, as --batch-size max finds it
    lo = prev[0] if prev is not None else 1
    known = {t: ok is not None for t, ok in tries}
    found = search_max_batch(lambda t: known[t] if t in known else attempt(t) is not None,
                             start=lo, upper=b, tolerance=tolerance, what=what)
    n = max(1, int(found.largest_fit * safety))
    return BatchChoice(n, f"memory binds first: {n}, the largest that fits less {1 - safety:.0%}, "
                          "while img/s still rose", tries)


@dataclass
class CheckpointSearch:
    """What `search_checkpoint_blocks` found: checkpoint the first `blocks` of `n_blocks` repeated blocks.

    `fits_all` is False when not even checkpointing every block fitted (`blocks` is then `n_blocks`,
    the least memory checkpointing can give). `tries` lists each (blocks, fitted) in the order tried.
    """

    blocks: int
    n_blocks: int
    fits_all: bool
    tries: list[tuple[int, bool]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """blocks / n_blocks, the `apply_checkpointing` ratio (0.0 for a model without blocks)."""
        return self.blocks / self.n_blocks if self.n_blocks else 0.0


def search_checkpoint_blocks(fits: Callable[[int], Any], n_blocks: int) -> CheckpointSearch:
    """The fewest of `n_blocks` blocks to checkpoint for `fits(k)` to succeed.

    Memory falls as more blocks are checkpointed, so the answer is the smallest k that fits: k=0 is
    tried first (on a large card one try settles it, and then nothing is recomputed), then k=n (when
    that fails too, k=n is returned with fits_all False), then the gap is bisected. `fits(k)` returns
    True/None when it fits, False or raises an out-of-memory error when not; other errors propagate.
    Raises ValueError for a negative `n_blocks`.
    """
    if n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    t0 = time.perf_counter()
    tries: list[tuple[int, bool]] = []

    def attempt(k: int) -> bool:
        ok = _fits(fits, k)
        tries.append((k, ok))
        log.debug("%d of %d blocks checkpointed: %s", k, n_blocks, "fits" if ok else "out of memory")
        return ok

    def done(k: int, fits_all: bool = True) -> CheckpointSearch:
        return CheckpointSearch(k, n_blocks, fits_all, tries, time.perf_counter() - t0)

    if n_blocks == 0 or attempt(0):
        return done(0)
    if not attempt(n_blocks):
        return done(n_blocks, fits_all=False)
    lo, hi = 0, n_blocks  # lo: known not to fit; hi: known to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    return done(hi)


def _split(effective_batch: int, micro_batch: int, world_size: int) -> tuple[int, int]:
    """(micro-batch, accumulation) for `plan_accumulation`, without its warning."""
    if effective_batch < 1 or micro_batch < 1 or world_size < 1:
        raise ValueError(f"need positive sizes, got effective={effective_batch}, micro={micro_batch}, "
                         f"world={world_size}")
    if effective_batch < world_size:
        raise UserError(f"--effective-batch {effective_batch} is smaller than the {world_size} GPUs; "
                        f"use at least {world_size} (one image per GPU)")
    accum = math.ceil(effective_batch / (micro_batch * world_size))
    if effective_batch % world_size == 0:
        per_gpu = effective_batch // world_size
        # the smallest accumulation >= accum that divides the per-GPU batch, unless it would more than
        # double the steps (a prime effective batch would otherwise mean micro-batches of 1)
        exact = next(a for a in range(accum, per_gpu + 1) if per_gpu % a == 0)
        if exact <= 2 * accum:
            return per_gpu // exact, exact
    return min(micro_batch, max(1, round(effective_batch / (accum * world_size)))), accum


def plan_accumulation(effective_batch: int, micro_batch: int, world_size: int = 1) -> tuple[int, int]:
    """Split an effective batch into (micro-batch per GPU, accumulation steps) for `world_size` GPUs.

    accumulation = ceil(effective / (micro x world)); the micro-batch is then lowered (never raised)
    so that micro x accumulation x world == effective exactly. When that would need more than twice
    the accumulation steps (or the GPUs don't divide the effective batch), the nearest inexact split
    is used and a warning names the effective batch actually trained. Raises UserError when the
    effective batch is smaller than the number of GPUs, and ValueError for non-positive arguments.
    """
    micro, accum = _split(effective_batch, micro_batch, world_size)
    actual = micro * accum * world_size
    if actual != effective_batch:
        log.warning("effective batch %d cannot be split exactly into micro-batch x %d accumulation x %d GPUs "
                    "with a micro-batch of at most %d; training with %d x %d x %d = %d",
                    effective_batch, accum, world_size, micro_batch, micro, accum, world_size, actual)
    return micro, accum


def resolve_batch(batch_size: int | str, accum_steps: int, effective_batch: int | None, world_size: int,
                  find_max: Callable[[], int]) -> tuple[int, int]:
    """(micro-batch per GPU, accumulation steps) from --batch-size, --accum-steps, --effective-batch.

    `find_max` measures the micro-batch for 'auto' and 'max'. Raises UserError when --effective-batch is not a
    multiple of micro-batch x GPUs.
    """
    measured = batch_size in ("auto", "max")
    micro = find_max() if measured else int(batch_size)
    if not effective_batch:
        return micro, accum_steps
    if measured:
        return plan_accumulation(effective_batch, micro, world_size)
    per_step = micro * world_size
    if effective_batch % per_step:
        near = max(1, round(effective_batch / per_step)) * per_step
        raise UserError(f"--effective-batch {effective_batch} is not a multiple of --batch-size {micro} x "
                        f"{world_size} GPU(s) = {per_step}; use --effective-batch {near} or another "
                        "--batch-size")
    return micro, effective_batch // per_step


def plan_for_world(effective_batch: int, micro_batch: int, world: int) -> tuple[int, int, str | None]:
    """(micro-batch per GPU, accumulation, note) that keep `effective_batch` images per step on `world` GPUs.

    The micro-batch is never raised (it is what fits in memory) and is lowered where that makes the
    split exact (`plan_accumulation`). `note` is None when the effective batch is kept and otherwise
    one line saying what is trained instead (said once, by the caller, rather than logged on every
    rank). Raises UserError when the effective batch is smaller than the number of GPUs.
    """
    micro, accum = _split(effective_batch, micro_batch, world)
    actual = micro * accum * world
    if actual == effective_batch:
        return micro, accum, None
    return micro, accum, (f"the effective batch {effective_batch} cannot be split exactly over {world} GPU(s) "
                          f"with micro-batches of at most {micro_batch}; training with {micro} x {accum} "
                          f"accumulation x {world} = {actual} images per step")


def resume_split(micro_batch: int, accum_steps: int, saved_world: int, world: int) -> tuple[int, int, str | None]:
    """(micro-batch, accumulation, note) to resume a run of `saved_world` GPUs on `world` GPUs.

    The same world keeps the split (note None). Another keeps the effective batch through
    accumulation where it divides (`plan_for_world`), and the note says what changed, or that the
    effective batch could not be kept.
    """
    if saved_world == world:
        return micro_batch, accum_steps, None
    effective = micro_batch * accum_steps * saved_world
    micro, accum, inexact = plan_for_world(effective, micro_batch, world)
    head = f"resuming a run of {saved_world} GPU(s) on {world}"
    if inexact:
        return micro, accum, f"{head}: {inexact}"
    return micro, accum, (f"{head}: micro-batch {micro} x {accum} accumulation x {world} keeps the "
                          f"effective batch {effective}")


class TrainStepProbe:
    """A `try_step` for `find_max_batch`: real training steps on random data at a given batch size.

    Call it with a batch size: it runs `steps` of the trainer's own training step
    (dlenv.engine.step.train_step: forward, backward, optimizer step) and returns True, or False on CUDA
    out of memory; other errors propagate. The optimizer's state (momentum; AdamW's two moments) is
    made by the first step that succeeds and then kept, as in training, so one step per try meets the
    same peak as a training step. After each call the
    gradients and the cached blocks are freed and the peak statistics reset, so a failed try does
    not weigh on the next.

    cuDNN autotuning is off during tries (`autotune=False`): it would benchmark every new batch
    shape, seconds per try, and where memory is short it only picks kernels with smaller workspaces.
    The probe trains its own model (from `model_factory`); call `close()` before building the real
    one so its memory is returned.
    """

    def __init__(self, model_factory: Callable[[], Any], precision_mode: str, checkpoint: bool | float,
                 img_size: int, num_classes: int, device: Any, channels_last: bool = False,
                 steps: int = 1, optimizer: str = "sgd", autotune: bool = False):
        import torch

        from dlenv.engine.optim import probe_optimizer
        from dlenv.engine.precision import Precision
        from dlenv.engine.step import Parts
        from dlenv.model.checkpointing import apply_checkpointing

        self.device = torch.device(device)
        self.img_size, self.num_classes, self.steps, self.autotune = img_size, num_classes, steps, autotune
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        model = model_factory()
        if checkpoint:
            apply_checkpointing(model, ratio=1.0 if checkpoint is True else float(checkpoint))
        model = model.to(self.device, memory_format=self.memory_format).train()
        opt = probe_optimizer(model.parameters(), optimizer)
        self.parts = Parts.plain(model, opt, Precision(precision_mode, self.device), self.memory_format)

    def _train(self, batch: int) -> None:
        import torch

        from dlenv.engine.step import train_step

        # every tensor of a try is local to this frame, so an OOM's traceback frees them with it;
        # until the optimizer has state, one more step makes it (its memory is part of every later peak)
        for _ in range(self.steps + (0 if self.parts.optimizer.state else 1)):
            x = torch.randn(batch, 3, self.img_size, self.img_size, device=self.device)
            x = x.contiguous(memory_format=self.memory_format)
            y = torch.randint(0, self.num_classes, (batch,), device=self.device)
            train_step(self.parts, x, y)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, batch: int) -> bool:
        import torch

        ok = True
        autotune = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.autotune
        try:
            self._train(batch)
        except Exception as e:
            if not _is_oom(e):
                raise
            ok = False
        finally:
            torch.backends.cudnn.benchmark = autotune
        # outside the except block: the exception and its frames (activations, grads) are gone now
        self.free()
        return ok

    def rate(self, batch: int, timed: int = 3) -> float | bool:
        """img/s of `timed` training steps at `batch` after one untimed step (the first pays for new
        shapes), or False on out of memory; what `fastest_batch` compares."""
        import torch

        autotune = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.autotune
        steps, self.steps = self.steps, 1
        try:
            self._train(batch)
            self.steps = timed
            t = time.perf_counter()
            self._train(batch)  # ends with a synchronize on CUDA
            return batch * timed / max(time.perf_counter() - t, 1e-9)
        except Exception as e:
            if not _is_oom(e):
                raise
            return False
        finally:
            self.steps = steps
            torch.backends.cudnn.benchmark = autotune
            self.free()

    def free(self) -> None:
        """Drop gradients and cached blocks; reset peak statistics."""
        import torch

        self.parts.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        """Release the probe's model, optimizer state and their GPU memory."""
        self.parts = None
        if self.device.type == "cuda":
            from dlenv.engine import memory

            memory.release_cached()


def make_train_step_probe(model_factory: Callable[[], Any], precision_mode: str, checkpoint: bool | float,
                          img_size: int, num_classes: int, device: Any, channels_last: bool = False,
                          steps: int = 1, optimizer: str = "sgd") -> TrainStepProbe:
    """A callable(batch) -> bool that runs real training steps and returns False on out of memory.

    `checkpoint` is False, True or a ratio of blocks to checkpoint; `precision_mode` is "fp32",
    "fp16" or "bf16" (see dlenv.engine.precision). See `TrainStepProbe`.
    """
    return TrainStepProbe(model_factory, precision_mode, checkpoint, img_size, num_classes, device,
                          channels_last=channels_last, steps=steps, optimizer=optimizer)


def fewest_checkpoint_blocks(model_factory: Callable[[], Any], precision_mode: str, img_size: int,
                             num_classes: int, device: Any, batch: int, channels_last: bool = False,
                             safety: float = 0.92) -> CheckpointSearch:
    """The fewest repeated blocks to checkpoint for training steps of `batch` images to fit (`--checkpoint-ratio auto`).

    One probe model (see `TrainStepProbe`) is re-checkpointed for each k of `search_checkpoint_blocks`
    and tried at ceil(batch / safety) images: the margin `find_max_batch` keeps, here as headroom
    above the batch rather than a cut below it, because a long run meets a fuller, more fragmented
    allocator than the probe does. The probe is closed before returning. Apply the answer with
    `apply_checkpointing(model, result.ratio)`. Raises ValueError for a bad `batch` or `safety`.
    """
    from dlenv.model.checkpointing import apply_checkpointing, find_blocks

    if batch < 1 or not 0 < safety <= 1:
        raise ValueError(f"need batch >= 1 and safety in (0, 1], got batch={batch}, safety={safety}")
    trial = math.ceil(batch / safety)
    probe = TrainStepProbe(model_factory, precision_mode, False, img_size, num_classes, device,
                           channels_last=channels_last)
    try:
        n = len(find_blocks(probe.parts.model))

        def fits(k: int) -> bool:
            apply_checkpointing(probe.parts.model, k / n)  # re-wraps: exactly the first k blocks
            return probe(trial)

        res = search_checkpoint_blocks(fits, n)
    finally:
        probe.close()
    log.info("checkpointing %d of %d blocks fits a batch of %d (tried at %d)%s", res.blocks, n, batch, trial,
             "" if res.fits_all else "; not even all of them fitted")
    return res
