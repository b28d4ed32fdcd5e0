"""Decoding overlapped with augmentation on a real GPU (issue 49): the GPU decoders' batches, overlapped, are
the serial ones (same pixels, same order, the same files skipped), within the decoder's tolerance of the CPU
path's, and memory stays flat over passes. The decisions themselves: tests/data/test_plan.py (CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from imagedata import make_photo_layout

from dlenv import compat
from dlenv.data import hwdecode
from dlenv.data.badimages import BadImageError
from dlenv.data.folder import find_layout
from dlenv.data.pipeline import make_loaders
from dlenv.data.plan import InputPlan, decide_overlap, engine_backends
from dlenv.data.sampler import ResumableSampler
from dlenv.options import config

pytestmark = pytest.mark.gpu
IMG = 32

engines = hwdecode.unavailable("cuda") if torch.cuda.is_available() else "no CUDA"
nvjpeg = compat.cuda_jpeg_unavailable("cuda") or compat.cuda_jpeg_overlap_unavailable() \
    if torch.cuda.is_available() else "no CUDA"
DECODERS = [pytest.param("nvimgcodec", marks=pytest.mark.skipif(bool(engines), reason=f"nvImageCodec: {engines}")),
            pytest.param("nvjpeg", marks=pytest.mark.skipif(bool(nvjpeg), reason=f"nvJPEG: {nvjpeg}"))]


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 24, 8, 3, lambda i: (60 + 4 * (i % 5), 48)))


def _same(x1: torch.Tensor, x2: torch.Tensor) -> bool:
    """The same batch: equal, or as near as one image decoded by nvImageCodec's CPU fallback instead of the
    engines could make it (a batch in another order or with other crops is off by about 0.5 on average)."""
    return x1.shape == x2.shape and (torch.equal(x1, x2) or (x1 - x2).abs().mean().item() < 0.01)


def _plan(decoder: str, overlap: bool, **kw) -> InputPlan:
    backends = engine_backends("cuda") if decoder == "nvimgcodec" else ()
    return InputPlan(IMG, 8, on_device=True, decoder=decoder, cpu_decoder="pil", workers=0, gpu_backends=backends,
                     overlap=overlap, seed=7, **kw)


def _epochs(layout, plan, device, epochs=((0, 0), (1, 0), (1, 8))):
    """(images, labels) of each (epoch, start) of the train loader, and the val batches, on the CPU."""
    sampler = ResumableSampler(len(layout.train), seed=1, batch_size=8)
    dtype, fmt = (torch.bfloat16, torch.channels_last) if device == "cuda" else (torch.float32, torch.contiguous_format)
    train, val = make_loaders(layout, plan, device, dtype=dtype, memory_format=fmt, train_sampler=sampler,
                              say=lambda m: None)
    out = []
    for epoch, start in epochs:
        sampler.set_epoch(epoch, start)
        xs, ys = zip(*train, strict=True)
        out.append((torch.cat(xs).float().cpu(), torch.cat(ys).cpu()))
    xv, yv = zip(*val, strict=True)
    return out, (torch.cat(xv).float().cpu(), torch.cat(yv).cpu()), train


@pytest.mark.parametrize("decoder", DECODERS)
def test_overlapped_gives_the_serial_batches_in_the_samplers_order(layout, decoder):
    assert decide_overlap("on", decoder, "cuda", False)[0]  # what the plan says here under --decode-overlap on
    serial, serial_val, _ = _epochs(layout, _plan(decoder, False), "cuda")
    overlapped, overlapped_val, loader = _epochs(layout, _plan(decoder, True), "cuda")
    assert loader.overlap
    for (x1, y1), (x2, y2) in zip(serial, overlapped, strict=True):
        assert torch.equal(y1, y2) and _same(x1, x2)  # the same decoder, crops and order
    assert torch.equal(serial_val[1], overlapped_val[1]) and _same(serial_val[0], overlapped_val[0])
    sampler = ResumableSampler(len(layout.train), seed=1, batch_size=8)
    sampler.set_epoch(1, 8)
    assert overlapped[2][1].tolist() == [layout.train[i][1] for i in sampler]  # the sampler's order, resumed
    assert overlapped_val[1].tolist() == [y for _, y in layout.val]


@pytest.mark.parametrize("decoder", DECODERS)
def test_overlapped_pixels_are_the_cpu_paths_within_the_decoders_tolerance(layout, decoder):
    gpu, gpu_val, _ = _epochs(layout, _plan(decoder, True), "cuda")
    cpu, cpu_val, _ = _epochs(layout, dataclasses.replace(_plan("pil", False), gpu_backends=()), "cpu")
    for (xg, yg), (xc, yc) in zip(gpu, cpu, strict=True):
        assert torch.equal(yg, yc)
        # JPEG decoders differ by rounding (a few levels of 255: tests/data/test_fastpath_gpu.py holds the stored
        # squares to a mean of 4); normalized, one level is about 0.017 (0.1: under 6 levels); bf16 adds its
        # own rounding; another order or other crops would be off by about 0.5
        assert (xg - xc).abs().mean() < 0.1, (xg - xc).abs().mean()
    assert torch.equal(gpu_val[1], cpu_val[1]) and (gpu_val[0] - cpu_val[0]).abs().mean() < 0.1


@pytest.mark.parametrize("decoder", DECODERS)
def test_overlapped_skips_bad_files_as_the_serial_path_and_names_them_on_error(layout, tmp_path, decoder):
    from PIL import Image

    Path(layout.train[5][0]).write_bytes(b"\xff\xd8\xff broken")
    png = Path(layout.train[9][0]).with_suffix(".png")  # a PNG among JPEGs: decoded by Pillow instead
    Image.new("RGB", (50, 30), (200, 10, 10)).save(png)
    train = list(layout.train)
    train[9] = (str(png), train[9][1])
    layout = type(layout)(layout.root, layout.classes, train, layout.val)
    serial, _, serial_loader = _epochs(layout, _plan(decoder, False), "cuda", ((0, 0),))
    overlapped, _, loader = _epochs(layout, _plan(decoder, True), "cuda", ((0, 0),))
    assert torch.equal(serial[0][1], overlapped[0][1]) and _same(serial[0][0], overlapped[0][0])
    assert len(overlapped[0][1]) == 24 and list(loader.bad_paths) == list(serial_loader.bad_paths) == [train[5][0]]
    with pytest.raises(BadImageError, match=train[5][0]):
        _epochs(layout, _plan(decoder, True, bad_images="error"), "cuda", ((0, 0),))


def test_overlapped_passes_keep_gpu_memory_flat(layout):
    """Train and val passes each epoch, as the trainer makes them: the decode stream is one per device (as the
    augment stream), so its freed blocks serve the next pass and reserved memory stops growing."""
    decoder = "nvimgcodec" if not engines else "nvjpeg" if not nvjpeg else None
    if decoder is None:
        pytest.skip(f"no GPU decoder: {engines}; {nvjpeg}")
    sampler = ResumableSampler(len(layout.train), seed=1, batch_size=8)
    train, val = make_loaders(layout, _plan(decoder, True), "cuda", train_sampler=sampler, say=lambda m: None)
    reserved = []
    for epoch in range(12):
        sampler.set_epoch(epoch)
        for loader in (train, val):
            for x, _ in loader:
                x.sum().item()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    # a pool stranded per pass (a new stream each) grows every epoch; the batches in flight are bounded by the
    # queues, so whenever the blocks they need were reserved, the later epochs reserve no more
    assert max(reserved[6:]) <= max(reserved[:6]), [r / 2**20 for r in reserved]


@pytest.mark.parametrize("choice, says", [
    ("on", "overlapped (--decode-overlap on): the GPU decodes the next batch"),
    ("auto", "decoding and augmentation in series: overlapping them (--decode-overlap on) measured slower"),
])
def test_training_at_two_workers_takes_the_engines_overlapped_only_when_asked(layout, tmp_path, choice, says):
    from dlenv.train import train

    if engines and nvjpeg:
        pytest.skip(f"no GPU decoder: {engines}; {nvjpeg}")
    cfg = config.build(config.TrainConfig, data=str(layout.root), model="resnet18", img_size=IMG, batch_size=8,
                       epochs=2, amp=True, workers=2, cache="off", decode_overlap=choice,
                       project=str(tmp_path / "runs"))
    out = train(cfg)
    assert out["status"] == "done"
    saved = (Path(out["run_dir"]) / "config.yaml").read_text()
    assert says in saved and ("overlapped" in saved) is (choice == "on")  # said once, and kept with the run
