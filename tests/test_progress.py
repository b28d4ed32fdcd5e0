"""dlenv.progress: plain lines by the clock with an ETA in logs, a tqdm bar on a terminal."""

from __future__ import annotations

import io

import pytest

from dlenv.progress import Progress, clock_text


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("seconds,text", [(0, "0:00"), (65, "1:05"), (3725, "1:02:05"), (None, "?")])
def test_clock_text(seconds, text):
    assert clock_text(seconds) == text


def test_plain_lines_come_by_time_with_an_eta():
    clock, out = Clock(), io.StringIO()
    p = Progress(100, "epoch 1/3", start=20, interval=10, file=out, tty=False, clock=clock)
    for done, t in [(30, 5), (40, 10), (50, 12), (60, 20), (100, 21)]:  # (batches done, seconds since start)
        clock.t = 100 + t
        p.update(done, "loss 0.5")
    lines = out.getvalue().splitlines()
    # at 10 s (20 batches at 2/s, 60 left -> 0:30), at 20 s (40 at 2/s, 40 left -> 0:20), and at the end
    assert lines == ["epoch 1/3 40/100 (40%)  elapsed 0:10, ETA 0:30  loss 0.5",
                     "epoch 1/3 60/100 (60%)  elapsed 0:20, ETA 0:20  loss 0.5",
                     "epoch 1/3 100/100 (100%)  elapsed 0:21, ETA 0:00  loss 0.5"]


def test_terminal_gets_a_tqdm_bar_with_eta():
    out = io.StringIO()
    p = Progress(50, "validating", unit="batch", file=out, tty=True)
    p.update(25, "x")
    p.close()
    text = out.getvalue()
    assert "validating" in text and "50/50" not in text and "25/50" in text and "<" in text  # tqdm: elapsed<left


def test_disabled_says_nothing():
    out = io.StringIO()
    p = Progress(5, "x", enabled=False, file=out, tty=False)
    p.update(5)
    assert out.getvalue() == ""
