"""GPU memory of the default input path over a long run: flat, and no dearer than the CPU path.

The GPU-augmentation path once took a new CUDA stream for every pass over the data; the caching
allocator keeps freed blocks per stream, so each epoch stranded its blocks and reserved memory grew
for ~16 epochs (until PyTorch's ring of 32 streams came round). These tests train 20 short epochs on
real PNG and JPEG folders of small and large images and read the per-epoch peaks from results.csv.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from imagedata import make_photo_layout, make_train_val

from dlenv.options import config

pytestmark = pytest.mark.gpu
EPOCHS = 20


def _small_png(root: Path) -> Path:
    """32x32 PNGs (like the 1,797-digit set the defect was found on)."""
    classes = tuple(f"c{i}" for i in range(4))
    make_train_val(root, per_class=24, val_per_class=8, size=(32, 32), classes=classes)
    return root


def _large_jpeg(root: Path) -> Path:
    return make_photo_layout(root, 96, 32, 4, lambda i: (500 - 8 * (i % 6), 375))


def _peaks(data: Path, tmp: Path, name: str, gpu_augment: str, **opts) -> list[float]:
    from dlenv.train import train

    cfg = config.build(config.TrainConfig, data=str(data), model="resnet18", img_size=224, batch_size=32,
                       epochs=EPOCHS, amp=True, workers=2, gpu_augment=gpu_augment, name=name,
                       project=str(tmp / "runs"), **opts)
    out = train(cfg)
    assert out["status"] == "done"
    with open(tmp / "runs" / name / "results.csv", newline="") as f:
        return [float(r["mem_reserved_gib"]) for r in csv.DictReader(f)]


@pytest.mark.parametrize("make", [_small_png, _large_jpeg], ids=["png-32px", "jpeg-500px"])
def test_gpu_augment_memory_is_flat_and_no_dearer_than_cpu(tmp_path, make):
    data = make(tmp_path / "ds")
    gpu = _peaks(data, tmp_path, "gpu", "auto")
    cpu = _peaks(data, tmp_path, "cpu", "off")
    assert len(gpu) == EPOCHS and len(cpu) == EPOCHS
    steady = gpu[1:]
    assert max(steady) <= 1.05 * min(steady), f"reserved GiB by epoch (GPU path): {gpu}"
    assert max(gpu) <= 1.25 * max(cpu), f"GPU path {max(gpu):.3f} GiB vs CPU path {max(cpu):.3f} GiB"


@pytest.mark.parametrize("opts", [dict(cache="off"), dict(cache="off", decoder="nvimgcodec")],
                         ids=["workers", "nvimgcodec"])
def test_streaming_paths_memory_is_flat(tmp_path, opts):
    """The paths that decode every epoch (small datasets are decoded once by default): flat as well."""
    from dlenv.data import hwdecode

    if opts.get("decoder") == "nvimgcodec" and hwdecode.unavailable("cuda"):
        pytest.skip(f"nvImageCodec: {hwdecode.unavailable('cuda')}")
    peaks = _peaks(_large_jpeg(tmp_path / "ds"), tmp_path, "run", "on", **opts)
    steady = peaks[1:]
    assert len(peaks) == EPOCHS and max(steady) <= 1.05 * min(steady), f"reserved GiB by epoch: {peaks}"
