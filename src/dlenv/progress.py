"""Progress that reads by time: a tqdm bar on a terminal, a plain line every few seconds in a log.

Both say how far, how fast and how long is left (ETA), so a log file read later tells as much as the
bar did. Plain lines come by the clock, not every N steps: a step takes milliseconds for one model
and minutes for another, and a fixed step count floods one log while it leaves the other silent. The
first comes right after the first step, so a log shows within seconds that the run is moving.
`RunEta` adds the time left in the whole run (every epoch, validation included). Training and
validation both use it. No torch here.
"""

from __future__ import annotations

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
    `seconds_left()` for the estimate. Before a rate is measured (two calls of `trained` apart), the
    first step's time since `start()` stands in for it, so the first progress line already has an
    estimate; None only before any batch (or without `start()`)."""

    def __init__(self, train_batches: int, validations: int, val_batches: int,
                 clock: Callable[[], float] = time.monotonic):
        self.train_left, self.val_left, self.val_batches = train_batches, validations, val_batches
        self.clock = clock
        self.train_s, self.done = 0.0, 0
        self.val_s: float | None = None
        self.mark: float | None = None
        self.begun: float | None = None  # when the epoch started, until its first batch is counted
        self.first_s: float | None = None  # a batch's time from the first step alone, until one is measured

    def start(self) -> None:
        self.begun, self.mark = self.clock(), None

    def trained(self, n: int) -> None:
        now = self.clock()
        if self.mark is not None:
            self.train_s += now - self.mark
            self.done += n
        elif self.begun is not None and n > 0:
            # the first step's time, the workers' start-up and the first batch's wait included: a first
            # guess, rather high than low, which the rate measured from here on replaces at the next call
            self.first_s, self.begun = (now - self.begun) / n, None
        self.mark = now  # the first call only starts the clock: it follows the workers' start-up
        self.train_left = max(0, self.train_left - n)

    def pause(self) -> None:
        self.mark = None

    def validated(self, seconds: float) -> None:
        self.val_s, self.val_left = seconds, max(0, self.val_left - 1)
        self.mark = None

    def seconds_left(self) -> float | None:
        if self.done:
            per_batch = self.train_s / self.done
        elif self.first_s is not None:
            per_batch = self.first_s
        else:
            return None
        # validation before the first one is measured: a share of the training time (see the class)
        per_val = self.val_s if self.val_s is not None else per_batch * self.val_batches / 3
        return self.train_left * per_batch + self.val_left * per_val

    def text(self) -> str:
        """'run ETA M:SS' ('?' while `seconds_left()` has no estimate)."""
        return f"run ETA {clock_text(self.seconds_left())}"
