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
    eta = RunEta(train_batches=60, validations=3, val_batches=6, clock=clock)  # 3 epochs of 20
    eta.start()
    for _ in range(RunEta.WARMUP_BATCHES):  # the warm-up: slow, and not the run's pace
        clock.t += 30
        eta.trained(1)
    assert eta.seconds_left() is None and eta.text() == "run ETA after a few steps"
    clock.t += 7
    eta.trained(7)  # 1 s a batch; 50 left; a validation batch estimated at a third of that: 2 s each
    assert eta.seconds_left() == pytest.approx(50 * 1 + 3 * 2)
    eta.validated(5.0)  # measured: 5 s a validation from now on
    assert eta.seconds_left() == pytest.approx(50 + 2 * 5)
    clock.t += 100  # saving and the epoch's end are not counted as training time
    eta.start()
    for _ in range(3):
        clock.t += 1
        eta.trained(1)
    clock.t += 37
    eta.trained(37)
    assert eta.seconds_left() == pytest.approx(10 + 2 * 5) and eta.text() == "run ETA 0:20"


def _reported_run(first_s: float, warm_s: float, rewarm_s: float, step_s: float, batches: int, epochs: int):
    """(each estimate a log would show with the true seconds left then, the run's time): a run whose first
    step takes `first_s` (workers, cuDNN's search, a compile), the next WARMUP_BATCHES - 1 `warm_s`, then
    `step_s` each; every later epoch's first step `rewarm_s` (its workers start again)."""
    clock = Clock()
    eta = RunEta(train_batches=batches * epochs, validations=epochs, val_batches=batches // 10, clock=clock,
                 batches_per_epoch=batches)
    durations = []
    for e in range(epochs):
        durations += ([first_s] + [warm_s] * (RunEta.WARMUP_BATCHES - 1) if e == 0 else
                      [rewarm_s] + [step_s] * (RunEta.WARMUP_BATCHES - 1))
        durations += [step_s] * (batches - RunEta.WARMUP_BATCHES)
    val_s = step_s * batches // 10 / 3
    total = sum(durations) + epochs * val_s
    seen, elapsed = [], 0.0
    for e in range(epochs):
        eta.start()
        for i in range(batches):
            d = durations[e * batches + i]
            clock.t += d
            elapsed += d
            eta.trained(1)
            seen.append((eta.seconds_left(), total - elapsed))
        clock.t += val_s
        elapsed += val_s
        eta.validated(val_s)
    return seen, total


@pytest.mark.parametrize("first_s, warm_s, rewarm_s", [
    (300.0, 20.0, 3.0),   # a long first step (cuDNN's search, a compile), workers restarting each epoch
    (60.0, 5.0, 1.0),
    (1.0, 1.0, 0.5),      # no warm-up to speak of
    (30.0, 5.0, 30.0),    # slow workers' start every epoch
])
def test_the_first_run_eta_is_within_2x_of_the_truth_or_not_given(first_s, warm_s, rewarm_s):
    """The issue's run: about 35 minutes of 0.5 s steps (10 epochs of 420 batches) after a slow start (its
    ETA said 5:39:31, then 4:15:20). Every estimate shown is within 2x of the time really left; the first
    steps show none."""
    seen, total = _reported_run(first_s, warm_s, rewarm_s, 0.5, batches=420, epochs=10)
    shown = [(est, true) for est, true in seen if est is not None]
    assert seen[0][0] is None  # the first step's line: "after a few steps"
    assert len(shown) >= len(seen) - 10 * (RunEta.WARMUP_BATCHES + RunEta.MIN_MEASURED)
    for est, true in shown:
        if true > 60:  # the last minute: seconds either way
            assert true / 2 <= est <= 2 * true, (est, true)


def test_short_epochs_take_the_whole_time_per_batch_once_one_has_ended():
    clock = Clock()
    eta = RunEta(train_batches=6, validations=3, val_batches=0, clock=clock)  # 3 epochs of 2 batches
    eta.start()
    clock.t += 4
    eta.trained(1)
    clock.t += 2
    eta.trained(1)
    assert eta.seconds_left() is None  # two batches: no rate yet
    eta.validated(1.0)
    eta.start()  # the first epoch has ended: 3 s a batch, its start included
    assert eta.seconds_left() == pytest.approx(4 * 3 + 2 * 1.0)


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
