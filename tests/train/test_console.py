"""dlenv.train.console: the lines a run says (the epoch line with the run's ETA, the last line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlenv import errors, invocation, progress
from dlenv.train import console

ROW = {"epoch": 1, "train_loss": 1.0, "val_loss": 0.5, "top1": 90.0, "top5": 99.0, "lr": 1e-3, "img_per_s": 100.0,
       "data_wait": 0.01, "epoch_s": 10.0, "mem_alloc_gib": 0.0, "mem_reserved_gib": 0.0}


@pytest.mark.parametrize("epochs,word", [(1, "1 epoch "), (3, "3 epochs ")])
def test_done_line_counts_right_and_says_where_to_look_next(monkeypatch, epochs, word):
    monkeypatch.setenv(invocation.ENV, "dlenv train")
    line = console.done_line(epochs, 83, "top-1", 98.5, Path("runs/exp/best_model.pth"), Path("runs/exp"))
    assert line.startswith(f"done: {word}in 1:23; best top-1 98.50; weights in runs/exp/best_model.pth")
    assert "dlenv val --weights runs/exp/best_model.pth" in line and "dlenv plot --log-dir runs/exp" in line
    assert "epochs" not in console.done_line(1, 1, "top-1", None, None, None)


def test_epoch_line_has_the_run_eta_until_the_last_epoch():
    clock = iter([0.0, 3.0, 13.0]).__next__
    eta = progress.RunEta(23, 2, 0, clock=clock)
    eta.start()
    eta.trained(3)  # the warm-up: not measured
    eta.trained(10)  # 1 s a batch, 10 left
    assert console.epoch_line(ROW, 2, True, run_eta=eta).endswith("*best*  run ETA 0:10")
    assert "run ETA" not in console.epoch_line({**ROW, "epoch": 2}, 2, False, run_eta=eta)


def test_the_first_progress_line_says_the_run_eta_comes_after_a_few_steps(capsys):
    # in a log (captured output is not a terminal) the first line comes right after the first step; that
    # step's time (workers starting, cuDNN's search) is not the run's pace, so no run ETA yet
    clock = iter([0.0, 2.0]).__next__  # the epoch starts, the first step ends
    eta = progress.RunEta(30, 3, 0, clock=clock)
    shown = console.Progress(10, 0, "epoch 1/3", True, run_eta=eta)
    shown.update(1, 2.5, 10.0, 0.0)
    shown.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("epoch 1/3 1/10 (10%)  elapsed ")
    assert lines[0].endswith("  loss 2.5000  10 img/s  0.0 GiB  run ETA after a few steps")


# ---------------------------------------------------------------------------------------------------
# The stop signals (issue 34 item 7; the real process-group cases are in tests/train/test_signals.py).


def test_sighup_stops_like_sigterm_with_its_own_exit_status():
    import signal

    assert console.SIGNAL_EXIT[signal.SIGHUP] == 129
    assert console.SIGNAL_EXIT[signal.SIGTERM] == 143 and console.SIGNAL_EXIT[signal.SIGINT] == 130


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_is_noted_once_and_the_same_one_again_at_once_is_the_same_request(name, monkeypatch):
    import signal

    said = []
    signum = getattr(signal, name)
    with console.Stop(said.append) as stop:
        stop.moment = "this epoch's validation"
        signal.raise_signal(signum)
        signal.raise_signal(signum)  # a shell passing the hangup on, a launcher forwarding the stop
        assert stop.requested() and stop.signum == signum
    assert said == [f"\n{name}: saving last.pth at the end of this epoch's validation (send it again to stop at once)"]
    assert signal.getsignal(signum) is not stop._handle  # the previous handler is back


def test_a_second_signal_later_stops_at_once():
    import signal

    with console.Stop(lambda msg: None) as stop:
        signal.raise_signal(signal.SIGINT)
        stop._at -= console.DUPLICATE_S  # a second later: a person who means it
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_while_starting_ends_the_run_at_once_in_one_line(name, monkeypatch):
    import signal

    monkeypatch.setenv(invocation.ENV, "dlenv train")
    with pytest.raises(errors.Stopped) as caught, console.StartUp():
        signal.raise_signal(getattr(signal, name))
    assert caught.value.signum == getattr(signal, name)
    assert not isinstance(caught.value, Exception)  # no `except Exception` on the way takes it
    assert console.stopped_early_line(caught.value.signum, None) == (
        f"stopped by {name} while starting, before the first step; nothing was trained or saved")
    assert console.stopped_early_line(caught.value.signum, "runs/exp/last.pth").endswith(
        "the run to resume is as it was. Resume with: dlenv train --resume runs/exp/last.pth")


def test_a_console_that_is_gone_is_silenced_not_a_crash(monkeypatch):
    import errno
    import sys

    silenced = []
    monkeypatch.setattr(console, "silence_console", lambda: silenced.append(True))

    class Gone:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Gone())
    console.printer(True)("SIGHUP: saving last.pth ...")  # the terminal hung up: no exception
    assert silenced == [True]

    class Full(Gone):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(OSError):  # a log on a full disk is still the disk's fault, said as such
        console.printer(True)("x")


@pytest.mark.parametrize("at", ["before the first is counted", "after it is counted"])
def test_a_signal_arriving_inside_the_first_ones_handler_is_one_request(at):
    """Python runs a pending signal's handler at any bytecode, also inside the handler of the first: a
    group SIGTERM sent twice printed 'saving last.pth' twice. Either order is one request, one line."""
    import itertools
    import signal

    said = []
    stop = console.Stop(said.append)
    inner = itertools.count()

    class Interrupted:  # the counter the handler draws from, with the second signal landing at `at`
        fired = False

        def __next__(self):
            if at == "before the first is counted" and not Interrupted.fired:
                Interrupted.fired = True
                stop._order = inner
                stop._handle(signal.SIGTERM, None)
            n = next(inner)
            if at == "after it is counted" and not Interrupted.fired:
                Interrupted.fired = True
                stop._handle(signal.SIGTERM, None)
            return n

    stop._order = Interrupted()
    stop._handle(signal.SIGTERM, None)
    assert stop.signum == signal.SIGTERM and len(said) == 1, said
