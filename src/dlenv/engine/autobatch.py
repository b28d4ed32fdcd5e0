"""The batch that fits: the searches of `--batch-size auto` and `--batch-size max`, each try a real training step.

`--batch-size auto` asks `fastest_batch` for the batch that trains fastest per image among those that
fit: the batch doubles, each try timing real training steps (forward, backward, optimizer step, at the
run's precision and checkpointing), and the doubling stops when img/s rises by less than `GAIN`; on a
big card the largest batch is no faster per image and a different optimisation regime (an H200 trained
ResNet-50 at 0.52-0.60x of batch 256's speed at the 3,032 that filled it). Where memory binds first
(a small card) it is the largest batch that fits. `--batch-size max` asks `find_max_batch` for that
largest batch: the batch doubles until a step runs out of memory, then the gap is bisected, and a
safety margin is taken off because a long run meets a fuller, more fragmented allocator than the
probe did.

The searches are pure functions of a `try_step` (tested on a CPU against a fake memory limit); the real
one, training steps of a model on a device, is dlenv.engine.stepprobe's. The batch found becomes
micro-batch x accumulation x GPUs in dlenv.engine.batchsplit; the fewest checkpointed blocks that fit a
batch are dlenv.engine.checkpointsearch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlenv.compat import is_oom
from dlenv.errors import UserError

log = logging.getLogger(__name__)

_OOM_ADVICE = ("use --amp, --checkpoint, a smaller --img-size or a smaller model, or free the GPU "
               "(nvidia-smi shows what else holds its memory)")


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
        if is_oom(e):
            return False
        raise


def fits(try_step: Callable[[int], Any], size: int) -> bool:
    """One try of a search (this one's, and dlenv.engine.checkpointsearch's): True when `try_step(size)` ran;
    False when it returned False or raised an out-of-memory error; any other error propagates."""
    return _try(try_step, size) is not False


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
        ok = fits(try_step, b)
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
