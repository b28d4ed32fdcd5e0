"""The upload-your-project flow as README's quick start prints it: a copy of workspace/ with the user's
dataset in data/, then `python train.py --amp --checkpoint`, `python val.py --weights best_model.pth`,
`python plot_results.py --log-dir ./runs`, exactly as typed (a tiny dataset, on the CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from imagedata import make_train_val

ROOT = Path(__file__).resolve().parents[1]
#: README's quick start, "Your own project" (test_readme-style: the commands as printed there)
SEED_COMMANDS = ("python train.py --amp --checkpoint", "python val.py --weights best_model.pth",
                 "python plot_results.py --log-dir ./runs")


def _run(ws: Path, line: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, *line.split()[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(argv, cwd=ws, capture_output=True, text=True, env=env, timeout=900)


def test_readme_prints_the_seed_commands():
    readme = (ROOT / "README.md").read_text()
    assert all(line in readme for line in SEED_COMMANDS)


@pytest.mark.slow
def test_the_three_seed_commands_on_an_uploaded_dataset(tmp_path):
    ws = tmp_path / "workspace"
    shutil.copytree(ROOT / "workspace", ws, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    make_train_val(ws / "data" / "digits", per_class=12, val_per_class=4, size=(16, 16))

    train = _run(ws, SEED_COMMANDS[0])
    assert train.returncode == 0, train.stderr[-2000:]
    assert "data: data/digits (the one dataset under data/; --data to choose)" in train.stdout
    assert "training small_cnn on data/digits (2 classes" in train.stdout
    assert not (ws / "data" / "demo").exists()  # the demo was not written beside the user's data
    # what to do next names the project's scripts, not invoke
    assert "Next: python val.py --weights runs/exp/best_model.pth" in train.stdout, train.stdout[-600:]
    assert "data_rule: the one dataset under data/" in (ws / "runs" / "exp" / "config.yaml").read_text()

    val = _run(ws, SEED_COMMANDS[1])
    assert val.returncode == 0, val.stderr[-2000:]
    assert "--weights best_model.pth: runs/exp/best_model.pth (the newest run's)" in val.stdout
    assert (ws / "runs" / "exp" / "val" / "metrics.json").is_file()

    plot = _run(ws, SEED_COMMANDS[2])
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert (ws / "runs" / "exp" / "results.png").is_file()


def test_plot_before_any_epoch_names_the_projects_train_script(tmp_path):
    """`python plot_results.py --log-dir ./runs` while the first epoch runs: one line that names
    `python train.py`, the command the user typed, not invoke's."""
    ws = tmp_path / "workspace"
    shutil.copytree(ROOT / "workspace", ws, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    (ws / "runs" / "exp").mkdir(parents=True)  # a run that has not ended an epoch: no results.csv yet
    r = _run(ws, SEED_COMMANDS[2])
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "no results.csv" in line and "yet" in line
    assert "train a run first (python train.py)" in line and "invoke" not in line
