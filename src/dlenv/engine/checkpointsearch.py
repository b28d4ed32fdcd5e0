"""The fewest checkpointed blocks that fit: the search of `--checkpoint-ratio auto`, each try a real training step.

`fewest_checkpoint_blocks` asks the opposite question of dlenv.engine.autobatch: at a given batch, the
fewest repeated blocks whose activation checkpointing makes a real training step fit, since every
checkpointed block is recomputed in backward for nothing when memory is not short. The search itself,
`search_checkpoint_blocks`, is a pure function of a `fits(k)` (tested on a CPU against a fake memory
limit); `fewest_checkpoint_blocks` runs it with a probe model (dlenv.engine.stepprobe) re-checkpointed
for each k.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlenv.engine import autobatch
from dlenv.engine.stepprobe import TrainStepProbe
from dlenv.model.checkpointing import apply_checkpointing, find_blocks

log = logging.getLogger(__name__)


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
        ok = autobatch.fits(fits, k)
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
