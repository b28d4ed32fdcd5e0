"""workspace/: the script entry points work from a fresh copy of the template."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dlenv.runfolder.trainstate import read_config_notes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_py_amp_checkpoint_from_a_fresh_copy(tmp_path):
    ws = tmp_path / "workspace"
    shutil.copytree(ROOT / "workspace", ws, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    shutil.rmtree(ws / "data" / "demo", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # the demo data is generated on first use; a short run keeps the test in seconds
    r = subprocess.run([sys.executable, "train.py", "--amp", "--checkpoint", "--epochs", "1", "--max-steps", "2",
                        "--batch-size", "4", "--workers", "0", "--img-size", "32"],
                       cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    run = ws / "runs" / "exp"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    # --amp is what was asked; the file keeps what was decided (a CPU without bf16 trains fp32, and says why)
    decided = read_config_notes(run / "config.yaml")["precision"]
    assert cfg["amp"] is (decided != "fp32") and cfg["checkpoint"] is True and cfg["data"] is None
    assert (run / "last.pth").is_file() and (run / "results.csv").read_text().count("\n") == 2
    assert (ws / "data" / "demo" / "train").is_dir()


@pytest.mark.slow
def test_readme_trains_and_validates_the_example_model_of_ones_own(tmp_path):
    """workspace/README.md's two commands for models/tiny_resnet.py, as written (invoke's tasks are
    `dlenv VERB`), with flags appended that keep the run to seconds (a tiny dataset, not the demo)."""
    import shlex

    from imagedata import make_train_val

    ws = tmp_path / "workspace"
    shutil.copytree(ROOT / "workspace", ws, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    make_train_val(ws / "data" / "tiny", per_class=8, val_per_class=4, size=(32, 32))
    readme = (ws / "README.md").read_text()
    train = next(line for line in readme.splitlines() if line.startswith("invoke train --model models/"))
    val = next(line for line in readme.splitlines() if line.startswith("invoke val --weights"))
    assert "--amp --checkpoint" in train and "models/tiny_resnet.py:build" in train
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    quick = {"train": ["--data", "data/tiny", "--epochs", "1", "--batch-size", "4", "--workers", "0",
                       "--img-size", "32", "--model-args", "width=8"],
             "val": ["--workers", "0"]}
    for line in (train, val):
        verb = shlex.split(line)[1]
        r = subprocess.run([sys.executable, "-m", "dlenv", *shlex.split(line)[1:], *quick[verb]], cwd=ws, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = ws / "runs" / "exp"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    decided = read_config_notes(run / "config.yaml")["precision"]
    assert cfg["model"] == "models/tiny_resnet.py:build" and cfg["amp"] is (decided != "fp32") and cfg["checkpoint"]
    assert "8 images, 2 classes" in r.stdout and (run / "val" / "metrics.json").is_file()


def test_val_py_writes_its_reports_into_the_run_folder_not_the_folder_it_runs_in(tmp_path, monkeypatch, capsys):
    """`python val.py` in the workspace, as its docstring and README show, twice (the run's data, then
    other data): val/ and val-digits/ land in runs/exp/, and the workspace itself gains nothing. The
    script runs in this process (runpy) to spare a second PyTorch start-up."""
    import runpy

    import torch
    from imagedata import make_train_val
    from tinymodels import Tiny

    from dlenv.files.runstate import FORMAT, save_state

    ws = tmp_path / "workspace"
    shutil.copytree(ROOT / "workspace", ws, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    make_train_val(ws / "data" / "digits", per_class=2, val_per_class=2)
    make_train_val(ws / "data" / "tiny", per_class=2, val_per_class=2)
    torch.manual_seed(0)
    run = ws / "runs" / "exp"
    save_state({"format": FORMAT, "model": Tiny(2).state_dict(), "model_name": "tiny",
                     "num_classes": 2, "class_names": ["cat", "dog"], "img_size": 16, "epoch": 1,
                     "config": {"data": "data/tiny", "val_split": 0.2, "seed": 0}}, run / "best_model.pth")
    monkeypatch.setattr("dlenv.model.models.architecture", lambda name, num_classes, *a, **kw: Tiny(num_classes))
    before = sorted(p.name for p in ws.iterdir())
    monkeypatch.chdir(ws)
    for data in (["--data", "data/tiny/val"], ["--data", "data/digits/val"]):
        monkeypatch.setattr(sys, "argv", ["val.py", "--weights", "runs/exp/best_model.pth", *data,
                                          "--workers", "0", "--device", "cpu"])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(ws / "val.py"), run_name="__main__")
        assert done.value.code == 0, capsys.readouterr()
    assert sorted(p.name for p in ws.iterdir()) == before  # no val/ or val-digits/ where it ran
    assert sorted(p.name for p in run.iterdir()) == ["best_model.pth", "val", "val-digits"]
    assert yaml.safe_load((run / "val-digits" / "metrics.json").read_text())["data"] == "data/digits/val"
