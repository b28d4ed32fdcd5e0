"""The device input path on a real GPU: same crops as on the CPU, device batches, nvJPEG, nvImageCodec, training."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from imagedata import make_photo_layout

from dlenv import compat
from dlenv.data import hwdecode
from dlenv.data.badimages import BadImageError
from dlenv.data.decode import decode_stored
from dlenv.data.folder import find_layout
from dlenv.data.gpu_aug import GpuAugment
from dlenv.data.pipeline import make_loaders
from dlenv.data.plan import InputOptions, InputPlan, engine_backends
from dlenv.data.sampler import ResumableSampler
from dlenv.data.sources import NvimgcodecSource, NvjpegSource
from dlenv.options import config

pytestmark = pytest.mark.gpu
IMG = 32


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 24, 8, 3, lambda i: (60 + 4 * (i % 5), 48)))


def test_gpu_augment_matches_cpu():
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 255, (8, 40, 40, 3), dtype=np.uint8))
    sizes = torch.tensor([[80, 60]] * 8, dtype=torch.int32)
    aug = GpuAugment(IMG, True)
    cpu = aug(images, sizes, seed=11)
    gpu = aug(images.cuda(), sizes, seed=11)
    assert gpu.device.type == "cuda" and torch.allclose(gpu.cpu(), cpu, atol=1e-3)
    half = GpuAugment(IMG, True, torch.bfloat16, torch.channels_last)(images.cuda(), sizes, seed=11)
    assert half.dtype == torch.bfloat16 and half.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(half.float().cpu(), cpu, atol=0.05)


@pytest.mark.parametrize("kw", [dict(cache_mode="ram"), dict(cache_mode="disk"), dict(decoder="pil", workers=2)])
def test_device_loader_on_cuda_matches_cpu(layout, tmp_path, kw):
    kw = dict(kw)
    plan = InputPlan(IMG, 8, on_device=True, decoder=kw.pop("decoder", "pil"), cpu_decoder="pil",
                     workers=kw.pop("workers", 0), cache_dir=str(tmp_path / "c"), **kw)

    def epoch(device, dtype):
        sampler = ResumableSampler(len(layout.train), seed=1)
        fmt = torch.channels_last if device == "cuda" else torch.contiguous_format
        train, val = make_loaders(layout, plan, device, dtype=dtype, memory_format=fmt, train_sampler=sampler,
                                  say=lambda m: None)
        xs, ys = zip(*train, strict=True)
        return torch.cat(xs), torch.cat(ys), next(iter(val))[0]

    x, y, v = epoch("cuda", torch.bfloat16)
    assert x.device.type == "cuda" and x.dtype == torch.bfloat16 and y.device.type == "cuda"
    assert x.is_contiguous(memory_format=torch.channels_last) and x.shape == (24, 3, IMG, IMG)
    x2, y2, _ = epoch("cuda", torch.bfloat16)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # seeded: the same run twice
    xc, yc, vc = epoch("cpu", torch.float32)
    assert torch.equal(y.cpu(), yc) and torch.allclose(x.float().cpu(), xc, atol=0.05)
    assert torch.allclose(v.float().cpu(), vc, atol=0.05)


def test_leaving_early_on_cuda_releases_the_thread(layout, tmp_path):
    plan = InputPlan(IMG, 8, on_device=True, decoder="pil", cpu_decoder="pil", workers=0, cache_mode="ram",
                     cache_dir=str(tmp_path / "c"))
    train, _ = make_loaders(layout, plan, "cuda", say=lambda m: None)
    before = threading.active_count()
    for _ in range(3):
        for x, _ in train:
            x.sum().item()
            break
    assert threading.active_count() == before


nvjpeg = pytest.mark.skipif(compat.cuda_jpeg_unavailable("cuda") is not None,
                            reason=f"nvJPEG: {compat.cuda_jpeg_unavailable('cuda')}")


@nvjpeg
def test_nvjpeg_decodes_like_pillow(layout):
    samples = layout.train[:6]
    src = NvjpegSource(samples, None, 6, 40, "skip")
    images, sizes, labels = src.upload(next(iter(src)), torch.device("cuda"))
    assert images.shape == (6, 40, 40, 3) and images.device.type == "cuda"
    for k, (path, label) in enumerate(samples):
        ref, wh = decode_stored(path, 40, "pil")
        assert tuple(sizes[k].tolist()) == wh and labels[k].item() == label
        assert np.abs(images[k].cpu().numpy().astype(int) - ref).mean() < 4


@nvjpeg
def test_nvjpeg_bad_file_skip_and_error(layout):
    samples = layout.train[:4]
    Path(samples[1][0]).write_bytes(b"\xff\xd8\xff broken")
    src = NvjpegSource(samples, None, 4, 40, "skip")
    images, _, _ = src.upload(next(iter(src)), torch.device("cuda"))
    assert torch.equal(images[1], images[2]) and list(src.bad_paths) == [samples[1][0]]
    src = NvjpegSource(samples, None, 4, 40, "error")
    with pytest.raises(BadImageError, match=samples[1][0]):
        src.upload(next(iter(src)), torch.device("cuda"))


@nvjpeg
def test_nvjpeg_loader_trains(layout, tmp_path):
    from dlenv.train import train

    cfg = config.build(config.TrainConfig, data=str(layout.root), model="resnet18", img_size=IMG,
                       batch_size=8, epochs=1, decoder="nvjpeg", amp=True, project=str(tmp_path / "runs"))
    assert train(cfg)["status"] == "done"


engines = pytest.mark.skipif(hwdecode.unavailable("cuda") is not None,
                             reason=f"nvImageCodec: {hwdecode.unavailable('cuda')}")


@engines
def test_nvimgcodec_decodes_like_pillow(layout):
    """Same pixels, sizes and labels as Pillow's stored form, within JPEG decoder tolerance."""
    samples = layout.train[:6]
    src = NvimgcodecSource(samples, None, 6, 40, "skip", "cuda", engine_backends("cuda"))
    images, sizes, labels = src.upload(next(iter(src)), torch.device("cuda"))
    assert images.shape == (6, 40, 40, 3) and images.dtype == torch.uint8 and images.device.type == "cuda"
    for k, (path, label) in enumerate(samples):
        ref, wh = decode_stored(path, 40, "pil")
        assert tuple(sizes[k].tolist()) == wh and labels[k].item() == label
        assert np.abs(images[k].cpu().numpy().astype(int) - ref).mean() < 4


@engines
def test_nvimgcodec_turns_exif_rotated_photos_upright(tmp_path):
    from PIL import Image

    arr = np.zeros((30, 60, 3), np.uint8)
    arr[:, :20] = 255  # white on the left third: after orientation 6 (turn 90 clockwise) it is on top
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "side.jpg"
    Image.fromarray(arr).save(path, quality=95, exif=exif.tobytes())
    src = NvimgcodecSource([(str(path), 0)], None, 1, 40, "skip", "cuda", engine_backends("cuda"))
    images, sizes, _ = src.upload(next(iter(src)), torch.device("cuda"))
    ref, wh = decode_stored(str(path), 40, "pil")
    assert tuple(sizes[0].tolist()) == wh == (30, 60)
    assert np.abs(images[0].cpu().numpy().astype(int) - ref).mean() < 6


@engines
def test_nvimgcodec_bad_file_skip_and_error_and_pngs(layout, tmp_path):
    from PIL import Image

    samples = layout.train[:4]
    Path(samples[1][0]).write_bytes(b"\xff\xd8\xff broken")
    png = tmp_path / "p.png"
    Image.new("RGB", (50, 30), (200, 10, 10)).save(png)
    samples = samples + [(str(png), 1)]
    src = NvimgcodecSource(samples, None, 5, 40, "skip", "cuda", engine_backends("cuda"))
    images, sizes, _ = src.upload(next(iter(src)), torch.device("cuda"))
    assert torch.equal(images[1], images[2]) and list(src.bad_paths) == [samples[1][0]]
    assert tuple(sizes[4].tolist()) == (50, 30) and images[4, 20, 20].tolist() == [200, 10, 10]
    src = NvimgcodecSource(samples, None, 5, 40, "error", "cuda", engine_backends("cuda"))
    with pytest.raises(BadImageError, match=samples[1][0]):
        src.upload(next(iter(src)), torch.device("cuda"))


@engines
def test_nvimgcodec_loader_trains_and_auto_picks_it_with_few_workers(layout, tmp_path):
    from dlenv.data import pipeline
    from dlenv.train import train

    located = pipeline.locate(str(layout.root))
    plan = InputOptions(cache="off", workers=2).decide(located, "cuda", 8, IMG)
    assert plan.decoder == ("nvimgcodec" if hwdecode.has_engines("cuda") else plan.decoder)
    assert plan.gpu_backends == (engine_backends("cuda") if plan.decoder == "nvimgcodec" else ())
    cfg = config.build(config.TrainConfig, data=str(layout.root), model="resnet18", img_size=IMG,
                       batch_size=8, epochs=1, decoder="nvimgcodec", amp=True, project=str(tmp_path / "runs"))
    assert train(cfg)["status"] == "done"


@pytest.mark.parametrize("opts", [dict(cache=True), dict(gpu_augment="on", cache="off"), dict(gpu_augment="off")])
def test_train_on_each_path(layout, tmp_path, opts):
    from dlenv.train import train

    cfg = config.build(config.TrainConfig, data=str(layout.root), model="resnet18", img_size=IMG,
                       batch_size=8, epochs=2, amp=True, workers=2, project=str(tmp_path / "runs"),
                       cache_dir=str(tmp_path / "c"), **opts)
    out = train(cfg)
    assert out["status"] == "done" and out["img_per_s"] > 0
