"""best_model.pth: small (weights, classes, config), always the best metric's weights, even after a kill.

A kill -9 between last.pth and best_model.pth of an improving epoch (or in the middle of writing
best_model.pth) is simulated in a subprocess that SIGKILLs itself from inside the checkpoint writer,
leaving a half-written temporary file; the resume writes best_model.pth again from last.pth and removes
the temporary file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from imagedata import make_train_val, train_config

from dlenv import train as train_mod
from dlenv.cli import main as cli_main
from dlenv.files import runstate
from dlenv.train import loop

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    make_train_val(root, per_class=4)
    return root


def cfg(tmp_path, data, **kw):
    return train_config(tmp_path, data, **{"model": "wide", "optimizer": "adamw", **kw})


def metrics(monkeypatch, values):
    """Make validation report top-1 `values` in turn (so which epoch is best is known)."""
    it = iter(values)
    monkeypatch.setattr(loop, "validate", lambda *a, **k: loop.Scores(1.0, float(next(it)), 100.0))


@pytest.mark.parametrize("ema", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_best_is_small_and_every_consumer_uses_it(tmp_path, ds, wide, monkeypatch, capsys, ema):
    metrics(monkeypatch, [10, 20, 5])  # the last for the run from --weights
    run = Path(train_mod.train(cfg(tmp_path, ds, ema=ema))["run_dir"])
    best, last = run / "best_model.pth", run / "last.pth"
    b, full = runstate.load_state(best), runstate.load_state(last)  # weights_only=True inside
    assert set(b) == {"format", "model", "model_name", "model_source", "num_classes", "class_names", "img_size",
                      "config", "world_size", "epoch", "step", "best_metric", "best_epoch", "env"}
    assert b["best_metric"] == 20.0 and b["best_epoch"] == 2 and b["class_names"] == ["cat", "dog"]
    weights = full["ema"]["module"] if ema else full["model"]  # the validated weights
    assert all(torch.equal(b["model"][k], weights[k]) for k in weights)
    # AdamW: last.pth holds the weights, two moments per weight (and the EMA copy); best only the weights
    assert best.stat().st_size < (0.3 if ema else 0.4) * last.stat().st_size
    capsys.readouterr()
    assert cli_main(["val", "--weights", str(best), "--data", str(ds / "val"), "--workers", "0",
                     "--batch-size", "4", "--device", "cpu"]) == 0
    assert cli_main(["export", "--weights", str(best), "--format", "torchscript"]) == 0
    assert best.with_name("best_model.torchscript.pt").is_file()
    assert cli_main(["prune", "--weights", str(best), "--amount", "0.3", "--data", str(ds / "val"),
                     "--workers", "0"]) == 0
    assert runstate.load_state(best.with_name("best_model_pruned.pth"))["class_names"] == ["cat", "dog"]
    again = train_mod.train(cfg(tmp_path, ds, epochs=1, weights=str(best), name="from-best"))
    assert again["exit_code"] == 0


_SCRIPT = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import dlenv.model.models
from dlenv.files import atomic
from dlenv.files import runstate
from dlenv.train import loop
from tinymodels import build_wide
dlenv.model.models.build_model = build_wide
values = iter([10.0, 20.0, 30.0])
loop.validate = lambda *a, **k: loop.Scores(1.0, next(values), 100.0)
KILL_AT = int(os.environ["KILL_AT"])
real = runstate.save_state

def save(state, path):
    path = Path(path)
    if path.name == "best_model.pth" and state["epoch"] == KILL_AT:  # last.pth of this epoch is on disk
        fd, tmp = atomic.temp_beside(path)
        os.write(fd, b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(state, path)

runstate.save_state = save
from dlenv.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("kill_at", [1, 2])  # 1: no best_model.pth yet; 2: epoch 1's is on disk
def test_kill_9_while_best_is_written_then_resume(tmp_path, ds, wide, monkeypatch, capsys, kill_at):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(tests=str(TESTS))))
    args = [sys.executable, str(script), "--data", str(ds), "--project", str(tmp_path / "runs"), "--img-size",
            "16", "--batch-size", "4", "--workers", "0", "--epochs", "3", "--device", "cpu", "--optimizer", "adamw"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KILL_AT": str(kill_at), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -9, proc.stdout + proc.stderr
    run = tmp_path / "runs" / "exp"
    temps = [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(".best_model.pth.")
    (run / "notes.tmp").write_text("the user's file")  # not a name of ours: stays
    last = runstate.load_state(run / "last.pth")
    assert last["epoch"] == kill_at and last["best_metric"] == 10.0 * kill_at
    # the resumed epochs do not improve: only the rebuilt best_model.pth can hold the best metric
    metrics(monkeypatch, [0, 0, 0])
    summary = train_mod.train(cfg(tmp_path, ds, resume=str(run / "last.pth")))
    out = capsys.readouterr().out
    assert summary["exit_code"] == 0 and "wrote " + str(run / "best_model.pth") + " again" in out
    best = runstate.load_state(run / "best_model.pth")
    assert best["best_metric"] == summary["best_metric"] == 10.0 * kill_at and best["epoch"] == kill_at
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])
    assert sorted(p.name for p in run.iterdir() if p.name.endswith(".tmp")) == ["notes.tmp"]
    assert f"weights in {run / 'best_model.pth'}" in out


def test_final_line_never_names_a_missing_best(tmp_path, ds, wide, monkeypatch, capsys):
    metrics(monkeypatch, [20, 10])
    run = Path(train_mod.train(cfg(tmp_path, ds))["run_dir"])
    (run / "best_model.pth").unlink()  # by hand: last.pth (epoch 2) is past the best epoch 1
    capsys.readouterr()
    summary = train_mod.train(cfg(tmp_path, ds, resume=str(run / "last.pth")))
    out = capsys.readouterr().out
    assert summary["best"] is None and "no best_model.pth was written" in out
    assert "does not hold the best metric (20.00)" in out and "weights in" not in out
