"""dlenv.progress: plain lines by the clock with an ETA in logs, a tqdm bar on a terminal."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from dlenv.progress import Progress, RunEta, clock_text


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
    # at once after the first work (10 batches in 5 s, 70 left -> 0:35), then 10 s later (40 at 2/s, 40
    # left -> 0:20), and at the end
    assert lines == ["epoch 1/3 30/100 (30%)  elapsed 0:05, ETA 0:35  loss 0.5",
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


def test_the_first_line_comes_after_the_first_step_however_long_the_interval():
    clock, out = Clock(), io.StringIO()
    p = Progress(1000, "epoch 1/1", interval=30, file=out, tty=False, clock=clock)
    clock.t += 1.5
    p.update(1)
    assert out.getvalue().startswith("epoch 1/1 1/1000")
    clock.t += 2
    p.update(2)
    assert len(out.getvalue().splitlines()) == 1  # then by the clock again


def test_run_eta_counts_every_epoch_left_and_its_validations():
    clock = Clock()
    eta = RunEta(train_batches=30, validations=3, val_batches=6, clock=clock)  # 3 epochs of 10
    eta.trained(1)  # the first batch only starts the clock (it waited for the workers)
    assert eta.seconds_left() is None and eta.text() == "run ETA ?"
    clock.t += 9
    eta.trained(9)  # 1 s a batch; 20 left; a validation batch estimated at a third of that: 2 s each
    assert eta.seconds_left() == pytest.approx(20 * 1 + 3 * 2)
    eta.validated(5.0)  # measured: 5 s a validation from now on
    assert eta.seconds_left() == pytest.approx(20 + 2 * 5)
    clock.t += 100  # saving and the epoch's end are not counted as training time
    eta.trained(1)
    clock.t += 9
    eta.trained(9)
    assert eta.seconds_left() == pytest.approx(10 + 2 * 5) and eta.text() == "run ETA 0:20"


def test_run_eta_has_an_estimate_from_the_first_step_then_the_measured_rate():
    clock = Clock()
    eta = RunEta(train_batches=30, validations=3, val_batches=6, clock=clock)  # 3 epochs of 10
    eta.start()
    assert eta.text() == "run ETA ?"  # nothing known before the first step
    clock.t += 2
    eta.trained(1)  # the first step took 2 s (start-up included): 29 batches left at 2 s, validations a third
    assert eta.seconds_left() == pytest.approx(29 * 2 + 3 * 6 * 2 / 3) and eta.text() == "run ETA 1:10"
    clock.t += 9
    eta.trained(9)  # now measured: 1 s a batch
    assert eta.seconds_left() == pytest.approx(20 * 1 + 3 * 2)


# ---------------------------------------------------------------------------------------------------
# The trainer's img/s: the bar's last number is the epoch line's and results.csv's (one definition).


def test_the_bar_and_the_epoch_line_give_one_img_per_s(tmp_path, data, tiny, monkeypatch, capsys):
    """A first step 0.3 s slower than the rest (as a warm-up, the workers' start or a first allocation
    makes it) used to leave the bar at the later batches' rate and the epoch line at the epoch's: two
    numbers for one epoch. Both (and results.csv) are now the epoch's images over its training time."""
    import re

    import tinymodels
    from tinymodels import tiny_config

    from dlenv import train as train_mod
    from dlenv.runfolder import results

    forward, calls = tinymodels.Tiny.forward, []

    def slow_first(self, x):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.3)
        return forward(self, x)

    monkeypatch.setattr(tinymodels.Tiny, "forward", slow_first)
    summary = train_mod.train(tiny_config(tmp_path, data, epochs=1))
    out = capsys.readouterr().out
    speed = r"  ([\d,]+) img/s  "
    bar = [ln for ln in out.splitlines() if ln.startswith("epoch 1/1 4/4 (100%)")]
    line = [ln for ln in out.splitlines() if ln.startswith("epoch 1/1: ")]
    assert len(bar) == 1 and len(line) == 1, out
    shown = {what: float(re.search(speed, text[0]).group(1).replace(",", "")) for what, text in
             (("bar", bar), ("epoch line", line))}
    csv_ips = float(results.read_results(Path(summary["run_dir"]) / "results.csv")["img_per_s"].iloc[0])
    # 16 images in a bit over 0.3 s: about 50 img/s; the later batches alone ran at thousands
    assert shown["epoch line"] < 60 and shown["epoch line"] == pytest.approx(shown["bar"], abs=1.5), shown
    assert round(csv_ips) == pytest.approx(shown["epoch line"], abs=1), (csv_ips, shown)
