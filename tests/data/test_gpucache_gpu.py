"""--cache-mode gpu on a real GPU: the engines fill it with the pixels they decode while streaming, a CPU fill
gives the ram cache's pixels, the order is the sampler's, bad files are replaced as on the CPU path, and a
training run through it keeps its memory flat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from imagedata import make_photo_layout

from dlenv.data import hwdecode
from dlenv.data.decode import stored_size
from dlenv.data.folder import find_layout
from dlenv.data.gpucache import build_device_cache
from dlenv.data.pipeline import make_loaders
from dlenv.data.plan import InputPlan, engine_backends
from dlenv.data.sampler import ResumableSampler
from dlenv.data.sources import GPU_SOURCES, NvimgcodecSource

pytestmark = pytest.mark.gpu
IMG = 32
engines = pytest.mark.skipif(hwdecode.unavailable("cuda") is not None,
                             reason=f"nvImageCodec: {hwdecode.unavailable('cuda')}")


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 26, 6, 3, lambda i: (60 + 4 * (i % 5), 48)))


def plan(tmp_path, mode: str, decoder: str = "pil", **kw) -> InputPlan:
    backends = engine_backends("cuda") if decoder == "nvimgcodec" else ()
    return InputPlan(IMG, 8, on_device=True, decoder=decoder, cpu_decoder="pil", workers=0, cache_mode=mode,
                     cache_dir=str(tmp_path / "c"), gpu_backends=backends, **kw)


def batches(layout, the_plan, epoch: int = 1):
    sampler = ResumableSampler(len(layout.train), seed=5, batch_size=8)
    sampler.set_epoch(epoch, 0)
    train, _ = make_loaders(layout, the_plan, "cuda", dtype=torch.bfloat16, memory_format=torch.channels_last,
                            train_sampler=sampler, say=lambda m: None)
    xs, ys = zip(*train, strict=True)
    return torch.cat(xs), torch.cat(ys), train


def test_a_cpu_filled_gpu_cache_gives_the_ram_caches_batches(layout, tmp_path):
    x, y, train = batches(layout, plan(tmp_path, "gpu"))
    rx, ry, _ = batches(layout, plan(tmp_path, "ram"))
    assert x.device.type == "cuda" and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, ry) and torch.equal(x, rx)
    assert train.source.cache.images.device.type == "cuda"


@engines
def test_the_engines_fill_it_with_what_they_decode_while_streaming(layout, tmp_path):
    size = stored_size(IMG)
    the_plan = plan(tmp_path, "gpu", "nvimgcodec")
    cache = build_device_cache(layout.train, size, the_plan, "cuda", 2, say=lambda m: None,
                               gpu_source=GPU_SOURCES["nvimgcodec"])
    src = NvimgcodecSource(layout.train, None, 8, size, "skip", "cuda", engine_backends("cuda"))
    at = 0
    for chunk in src:
        images, sizes, labels = src.upload(chunk, torch.device("cuda"))
        k = images.shape[0]
        assert torch.equal(cache.images[at:at + k], images) and torch.equal(cache.sizes[at:at + k], sizes)
        assert torch.equal(cache.labels[at:at + k], labels)
        at += k
    assert at == len(layout.train) == len(cache)


@engines
@pytest.mark.parametrize("decoder", ["nvimgcodec", "pil"])
def test_bad_files_are_replaced_as_on_the_cpu_path(layout, tmp_path, decoder):
    Path(layout.train[3][0]).write_bytes(b"\xff\xd8\xff broken")
    Path(layout.train[9][0]).write_bytes(b"")
    _, y, train = batches(layout, plan(tmp_path, "gpu", decoder))
    _, ry, ram = batches(layout, plan(tmp_path, "ram"))
    assert torch.equal(y, ry)  # the substitutes' labels, in the sampler's order
    assert sorted(train.bad_paths) == sorted(ram.bad_paths) == sorted([layout.train[3][0], layout.train[9][0]])


def test_memory_stays_flat_over_epochs(layout, tmp_path):
    sampler = ResumableSampler(len(layout.train), seed=5, batch_size=8)
    train, _ = make_loaders(layout, plan(tmp_path, "gpu"), "cuda", train_sampler=sampler, say=lambda m: None)
    reserved = []
    for e in range(6):
        sampler.set_epoch(e, 0)
        for x, _ in train:
            x.sum().item()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[1], reserved
