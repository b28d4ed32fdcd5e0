"""dlenv.train.console: the lines a run says (the epoch line with the run's ETA, the last line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlenv import invocation, progress
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
    clock = iter([0.0, 10.0]).__next__
    eta = progress.RunEta(20, 2, 0, clock=clock)
    eta.trained(0)
    eta.trained(10)  # 1 s a batch, 10 left
    assert console.epoch_line(ROW, 2, True, run_eta=eta).endswith("*best*  run ETA 0:10")
    assert "run ETA" not in console.epoch_line({**ROW, "epoch": 2}, 2, False, run_eta=eta)


def test_the_first_progress_line_has_the_whole_runs_eta(capsys):
    # in a log (captured output is not a terminal) the first line comes right after the first step, and it
    # already says how long the whole run takes, from that step's time: 3 epochs of 10 batches, 2 s each
    clock = iter([0.0, 2.0]).__next__  # the epoch starts, the first step ends
    eta = progress.RunEta(30, 3, 0, clock=clock)
    shown = console.Progress(10, 0, "epoch 1/3", True, run_eta=eta)
    shown.update(1, 2.5, 10.0, 0.0)
    shown.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("epoch 1/3 1/10 (10%)  elapsed ")
    assert lines[0].endswith("  loss 2.5000  10 img/s  0.0 GiB  run ETA 0:58")
