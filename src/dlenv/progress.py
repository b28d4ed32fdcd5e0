"""Progress that reads by time: a tqdm bar on a terminal, a plain line every few seconds in a log.

Both say how far, how fast and how long is left (ETA), so a log file read later tells as much as the
bar did. Plain lines come by the clock, not every N steps: a step takes milliseconds for one model
and minutes for another, and a fixed step count floods one log while it leaves the other silent.
Training and validation both use it. No torch here.
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
        if now - self.last < self.interval and not finished:
            return
        self.last = now
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
