"""dlenv watch and train's gpu_busy column on a real CUDA GPU: NVML sees the kernels a watched command runs,
and a training epoch records the share of its time a kernel ran."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dlenv import train as train_mod  # noqa: E402
from dlenv.options import config  # noqa: E402
from dlenv.options.config import TrainConfig  # noqa: E402
from dlenv.runfolder import results  # noqa: E402
from dlenv.watch import run as watch_run  # noqa: E402

# The busy and memory figures are the card's: tests beside these can only raise them, and the checks are floors
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("watch_gpu")]

BUSY = """
import time, torch
x = torch.randn(8192, 8192, device="cuda")
t = time.monotonic()
while time.monotonic() - t < 6:
    y = x @ x
torch.cuda.synchronize()
"""


def test_watch_sees_a_busy_gpu_and_its_memory(tmp_path):
    lines = []
    status = watch_run.watch([sys.executable, "-c", BUSY], tmp_path, interval=0.5, say=lines.append)
    assert status == 0
    with (tmp_path / "watch.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    utils = [float(r["gpu0_util_pct"]) for r in rows if r["gpu0_util_pct"]]
    assert max(utils) >= 90  # back-to-back 8192^2 matmuls keep a kernel running
    assert max(float(r["gpu0_mem_used_mib"]) for r in rows) > 256  # the tensors (and the context) were seen
    text = "\n".join(lines)
    assert "was busy" in text and "memory peaked at" in text
    assert (tmp_path / "watch.png").stat().st_size > 10_000


def test_train_records_gpu_busy_per_epoch(tmp_path):
    out = train_mod.train(config.build(TrainConfig, synthetic=True, device="cuda", project=str(tmp_path / "runs"),
                                       workers=0, epochs=2, max_steps=40, img_size=64, batch_size=64,
                                       model="resnet18"))
    df = results.read_results(Path(out["run_dir"]) / "results.csv")
    busy = df["gpu_busy"].tolist()
    assert len(busy) == 2 and all(0 < b <= 1 for b in busy)  # on synthetic data the GPU is rarely idle
