"""The batch split: an effective batch as micro-batch x accumulation x GPUs, and the batch options read that way.

`plan_accumulation` turns an effective batch into micro-batch x accumulation x GPUs; `resolve_batch`
reads --batch-size, --accum-steps and --effective-batch that way (a measured batch from
dlenv.engine.autobatch), `plan_for_world` keeps an effective batch on another number of GPUs, and
`resume_split` keeps a run's effective batch when it resumes on another number of GPUs. Pure arithmetic:
no torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from dlenv.errors import UserError

log = logging.getLogger(__name__)


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
