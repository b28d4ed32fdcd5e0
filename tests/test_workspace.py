"""workspace/: the script entry points work from a fresh copy of the template."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    assert cfg["amp"] is True and cfg["checkpoint"] is True and cfg["data"] is None
    assert (run / "last.pth").is_file() and (run / "results.csv").read_text().count("\n") == 2
    assert (ws / "data" / "demo" / "train").is_dir()
