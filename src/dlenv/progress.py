"""Progress that reads by time: a tqdm bar on a terminal, a plain line every few seconds in a log.

Both say how far, how fast and how long is left (ETA), so a log file read later tells as much as the
bar did. Plain lines come by the clock, not every N steps: a step takes milliseconds for one model
and minutes for another, and a fixed step count floods one log while it leaves the other silent. The
first comes right after the first step, so a log shows within seconds that the run is moving.
`RunEta` adds the time left in the whole run (every epoch, validation included). Training and
validation both use it. No torch here.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: seconds between plain progress lines when the output is not a terminal (a log file, a pipe)
LOG_INTERVAL_S = 30.0


def clock_text(seconds: float | None) -> str:
    """`seconds` as M:SS or H:MM:SS ("?" when unknown)."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """`update(done, info)` as work advances; `close()` at the end.

    On a terminal (`file.isatty()`, or `tty=True`) a tqdm bar, which shows its own rate and ETA; else a
    line `desc done/total (pct)  elapsed M:SS, ETA M:SS  info` at most every `interval` seconds and at
    the end. `start` is where a resumed count begins: the rate counts only what this process did.
    """

    def __init__(self, total: int | None, desc: str, *, start: int = 0, enabled: bool = True, unit: str = "it",
                 interval: float = LOG_INTERVAL_S, file: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.start, self.enabled = total, desc, start, enabled
        self.interval, self.clock = interval, clock
        self.file = file if file is not None else sys.stdout
        self.t0 = self.last = clock()
        self.printed = False  # the first plain line comes after the first unit of work, whatever the interval
        self.bar: Any = None
        if enabled and (self.file.isatty() if tty is None else tty):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, unit=unit, dynamic_ncols=True, leave=True,
                            file=self.file, mininterval=0.5)

    def update(self, done: int, info: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if info:
                self.bar.set_postfix_str(info, refresh=False)
            self.bar.update(done - self.bar.n)  # tqdm redraws at most every mininterval
            return
        now = self.clock()
        finished = self.total is not None and done >= self.total
        first = not self.printed and done > self.start
        if now - self.last < self.interval and not finished and not first:
            return
        self.last, self.printed = now, True
        self.file.write(self.line(done, now) + (f"  {info}" if info else "") + "\n")
        self.file.flush()

    def line(self, done: int, now: float) -> str:
        """The plain line's head: how far, elapsed, and the time left at this process's rate."""
        elapsed = now - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        if self.total is None:
            return f"{self.desc} {done}  elapsed {clock_text(elapsed)}"
        left = (self.total - done) / rate if rate > 0 else None
        pct = done / self.total if self.total else 1.0
        return (f"{self.desc} {done}/{self.total} ({pct:.0%})  elapsed {clock_text(elapsed)}, "
                f"ETA {clock_text(left)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class RunEta:
    """The time left in a whole run: its training batches still to go at the rate measured so far, plus
    its validations still to run at the cost of the last one (before the first: a third of a training
    batch per validation batch, as a forward pass alone costs about that).

    `start()` at an epoch's start, `trained(n)` after n more training batches, `validated(seconds)`
    after each validation, `pause()` before time that is neither (saving, the epoch's end),
    `seconds_left()` for the estimate, None while there is no honest one.

    The first steps of an epoch are not the run's pace: the workers start and fill their queues, cuDNN
    tries its algorithms, the allocator grows, a compile runs. Taken as the rate they made a first run's
    ETA 5:39:31, then 4:15:20, for a run of 35 minutes. So the rate is the one measured after the first
    WARMUP_BATCHES of each epoch, once it holds MIN_MEASURED batches; until then there is no estimate
    ("after a few steps"), except where epochs are too short for that: once an epoch has ended (or the
    training batches are all done) the whole time per batch, warm-ups included, stands in. The first
    epoch's warm-up is taken as once only (cuDNN's search and a compile are); from the second epoch on, the
    latest epoch's warm-up beyond the rate is added for each epoch still to start (`batches_per_epoch`:
    the workers start again each epoch)."""

    #: batches at the start of each epoch whose time is left out of the rate
    WARMUP_BATCHES = 3
    #: batches measured after the warm-up before the rate gives an estimate
    MIN_MEASURED = 5

    def __init__(self, train_batches: int, validations: int, val_batches: int,
                 clock: Callable[[], float] = time.monotonic, batches_per_epoch: int = 0):
        self.train_left, self.val_left, self.val_batches = train_batches, validations, val_batches
        self.batches_per_epoch = batches_per_epoch
        self.clock = clock
        self.steady_s, self.steady_n = 0.0, 0  # batches past each epoch's warm-up, and their time
        self.whole_s, self.whole_n = 0.0, 0    # every timed batch, warm-ups included
        self.in_epoch = 0                      # batches of this epoch so far
        self.epochs_ended = 0
        self.warm_s = 0.0                      # this epoch's warm-up time so far
        self.rewarm_s: float | None = None     # the latest warm-up of an epoch after the first
        self.val_s: float | None = None
        self.mark: float | None = None

    def start(self) -> None:
        if self.in_epoch:
            self.epochs_ended += 1
        # the first step's time counts, as part of the warm-up
        self.in_epoch, self.warm_s, self.mark = 0, 0.0, self.clock()

    def trained(self, n: int) -> None:
        now = self.clock()
        if self.mark is not None:  # without start(), the first call only starts the clock
            self.whole_s, self.whole_n = self.whole_s + now - self.mark, self.whole_n + n
            if self.in_epoch >= self.WARMUP_BATCHES:
                self.steady_s, self.steady_n = self.steady_s + now - self.mark, self.steady_n + n
            else:
                self.warm_s += now - self.mark
                if self.in_epoch + n >= self.WARMUP_BATCHES and self.epochs_ended:
                    self.rewarm_s = self.warm_s
        self.in_epoch += n
        self.mark = now
        self.train_left = max(0, self.train_left - n)

    def pause(self) -> None:
        self.mark = None

    def validated(self, seconds: float) -> None:
        self.val_s, self.val_left = seconds, max(0, self.val_left - 1)
        self.mark = None

    def per_batch(self) -> float | None:
        """Seconds per training batch, as measured so far (see the class); None while it is not known."""
        if self.steady_n >= self.MIN_MEASURED:
            return self.steady_s / self.steady_n
        if self.whole_n and (self.epochs_ended or self.train_left == 0):
            return self.whole_s / self.whole_n
        return None

    def seconds_left(self) -> float | None:
        per_batch = self.per_batch()
        if per_batch is None:
            if self.train_left == 0 and (self.val_left == 0 or self.val_s is not None):
                return self.val_left * (self.val_s or 0.0)
            return None
        # validation before the first one is measured: a share of the training time (see the class)
        per_val = self.val_s if self.val_s is not None else per_batch * self.val_batches / 3
        return self.train_left * per_batch + self.val_left * per_val + self._rewarms(per_batch)

    def _rewarms(self, per_batch: float) -> float:
        """The warm-ups of the epochs still to start, beyond the rate: the latest seen after the first."""
        if self.rewarm_s is None or not self.batches_per_epoch:
            return 0.0
        in_this = max(0, self.batches_per_epoch - self.in_epoch)
        to_start = math.ceil(max(0, self.train_left - in_this) / self.batches_per_epoch)
        return to_start * max(0.0, self.rewarm_s - self.WARMUP_BATCHES * per_batch)

    def text(self) -> str:
        """'run ETA M:SS', or 'run ETA after a few steps' while `seconds_left()` has no estimate."""
        left = self.seconds_left()
        return "run ETA after a few steps" if left is None else f"run ETA {clock_text(left)}"
