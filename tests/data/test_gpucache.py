"""dlenv.data.gpucache and sources.DeviceCacheSource on a CPU device (the same code that runs on the GPU): the
batches of a ram cache, in the sampler's order from where it starts, bad files replaced as there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from imagedata import make_photo_layout

from dlenv.data.badimages import BadImageError
from dlenv.data.decode import stored_size
from dlenv.data.folder import find_layout
from dlenv.data.gpucache import build_device_cache
from dlenv.data.pipeline import make_loaders
from dlenv.data.plan import InputPlan
from dlenv.data.sampler import ResumableSampler
from dlenv.data.sources import DeviceCacheSource

IMG = 24


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 21, 6, 3, lambda i: (40 + 4 * (i % 3), 30)))


def plan(tmp_path, mode: str, **kw) -> InputPlan:
    return InputPlan(IMG, 8, on_device=True, decoder="pil", cpu_decoder="pil", workers=0, cache_mode=mode,
                     cache_dir=str(tmp_path / "c"), **kw)


def epoch(layout, the_plan, epoch_no: int = 0, start: int = 0):
    sampler = ResumableSampler(len(layout.train), seed=3, batch_size=8)
    sampler.set_epoch(epoch_no, start)
    train, val = make_loaders(layout, the_plan, "cpu", train_sampler=sampler, say=lambda m: None)
    xs, ys = zip(*train, strict=True)
    vx, vy = zip(*val, strict=True)
    return torch.cat(xs), torch.cat(ys), torch.cat(vx), torch.cat(vy), train


@pytest.mark.parametrize("epoch_no,start", [(0, 0), (1, 0), (2, 8)])  # a later epoch, a resume mid-epoch
def test_gpu_mode_gives_the_ram_caches_batches(layout, tmp_path, epoch_no, start):
    x, y, vx, vy, _ = epoch(layout, plan(tmp_path, "gpu"), epoch_no, start)
    rx, ry, rvx, rvy, _ = epoch(layout, plan(tmp_path, "ram"), epoch_no, start)
    assert x.shape[0] == len(layout.train) - start
    assert torch.equal(y, ry) and torch.equal(x, rx) and torch.equal(vx, rvx) and torch.equal(vy, rvy)


@pytest.mark.parametrize("broken", [b"", b"\xff\xd8\xff not a jpeg", b"GIF89a"])
def test_a_bad_file_is_replaced_as_in_the_ram_cache(layout, tmp_path, broken):
    Path(layout.train[4][0]).write_bytes(broken)
    x, y, _, _, train = epoch(layout, plan(tmp_path, "gpu"))
    rx, ry, _, _, ram = epoch(layout, plan(tmp_path, "ram"))
    assert torch.equal(y, ry) and torch.equal(x, rx)
    assert list(train.bad_paths) == list(ram.bad_paths) == [layout.train[4][0]]


def test_bad_images_error_names_the_file(layout, tmp_path):
    Path(layout.train[2][0]).write_bytes(b"broken")
    with pytest.raises(BadImageError, match=Path(layout.train[2][0]).name):
        build_device_cache(layout.train, stored_size(IMG), plan(tmp_path, "gpu", bad_images="error"), "cpu", 2,
                           say=lambda m: None)


def test_the_fill_goes_chunk_by_chunk_and_says_what_it_decoded(layout, tmp_path, monkeypatch):
    from dlenv.data import gpucache

    monkeypatch.setattr(gpucache, "CPU_CHUNK", 5)  # 21 images: chunks of 5 and a last one of 1
    said: list[str] = []
    cache = build_device_cache(layout.train, stored_size(IMG), plan(tmp_path, "gpu"), "cpu", 2, say=said.append)
    whole = build_device_cache(layout.train, stored_size(IMG), plan(tmp_path, "gpu"), "cpu", 2, say=lambda m: None)
    monkeypatch.undo()
    assert torch.equal(cache.images, whole.images) and torch.equal(cache.sizes, whole.sizes)
    assert cache.labels.tolist() == [y for _, y in layout.train] and len(cache) == 21
    assert "decoding 21 images once" in said[0] and "21 images decoded in" in said[1]


def test_an_empty_split_and_an_empty_rank_are_handled(layout, tmp_path):
    from dlenv.errors import UserError

    with pytest.raises(UserError, match="no images"):
        build_device_cache([], stored_size(IMG), plan(tmp_path, "gpu"), "cpu", 1, say=lambda m: None)
    cache = build_device_cache(layout.train[:3], stored_size(IMG), plan(tmp_path, "gpu"), "cpu", 1,
                               say=lambda m: None)
    assert list(DeviceCacheSource(cache, [], 8)) == []  # a sampler with nothing for this rank: no batch


def test_a_gpu_plan_says_where_the_images_are_kept(tmp_path):
    line = dataclasses.replace(plan(tmp_path, "gpu"), decoder="nvimgcodec", cache_why="13,000 images take").describe(
        "cuda")
    assert line.startswith("input: decoded once into GPU memory by nvimgcodec, augmentation on cuda")
    assert "13,000 images" in line and "workers" not in line
