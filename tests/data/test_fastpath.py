"""dlenv.data.fastpath on the CPU (built through the pipeline): the same batches from workers and cache,
seeding, resume, errors (the sources themselves: tests/data/test_sources.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from imagedata import make_photo_layout

from dlenv.data.badimages import BadImageError
from dlenv.data.fastpath import DeviceLoader
from dlenv.data.folder import find_layout
from dlenv.data.pipeline import make_loaders
from dlenv.data.plan import InputPlan
from dlenv.data.sampler import ResumableSampler

IMG = 16


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 10, 4, 2, lambda i: (30 + 2 * i, 24)))


def _build(layout, tmp_path, decoder="pil", **kw):
    sampler = ResumableSampler(len(layout.train), seed=3)
    plan = InputPlan(IMG, 4, on_device=True, decoder=decoder, cpu_decoder="pil", workers=kw.pop("workers", 0),
                     cache_dir=str(tmp_path / "cache"), seed=5, **kw)
    train, val = make_loaders(layout, plan, "cpu", train_sampler=sampler, say=lambda m: None)
    return sampler, train, val


def _epoch(loader):
    xs, ys = zip(*list(loader), strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_workers_and_cache_give_the_same_batches(layout, tmp_path):
    _, by_workers, val_w = _build(layout, tmp_path, workers=2)
    _, by_cache, val_c = _build(layout, tmp_path, cache_mode="ram")
    x1, y1 = _epoch(by_workers)
    x2, y2 = _epoch(by_cache)
    assert x1.shape == (10, 3, IMG, IMG) and len(by_workers) == len(by_cache) == 3
    assert torch.equal(y1, y2) and torch.equal(x1, x2)
    xv, yv = _epoch(val_c)
    assert yv.tolist() == [y for _, y in layout.val]  # val in sample order
    assert torch.equal(xv, _epoch(val_w)[0])


def test_epochs_differ_and_repeat_and_resume_mid_epoch(layout, tmp_path):
    sampler, train, _ = _build(layout, tmp_path, cache_mode="ram")
    sampler.set_epoch(0)
    e0, y0 = _epoch(train)
    assert torch.equal(_epoch(train)[0], e0)  # the same epoch again: the same crops
    sampler.set_epoch(1)
    assert not torch.equal(_epoch(train)[0], e0)
    sampler.set_epoch(0, start=4)  # a resume after the first batch of 4 samples
    x, y = _epoch(train)
    assert torch.equal(x, e0[4:]) and torch.equal(y, y0[4:])


def test_leaving_early_stops_the_producer_thread(layout, tmp_path):
    _, train, _ = _build(layout, tmp_path, cache_mode="ram")
    before = threading.active_count()
    for _ in range(3):
        for _ in train:
            break
    assert threading.active_count() == before


def test_bad_file_error_is_raised_in_the_training_thread(layout, tmp_path):
    Path(layout.train[3][0]).write_bytes(b"\xff\xd8\xff broken")
    _, train, _ = _build(layout, tmp_path, bad_images="error", workers=0)
    with pytest.raises(BadImageError, match=layout.train[3][0]):
        _epoch(train)
    _, train, _ = _build(layout, tmp_path, bad_images="skip", workers=0)
    assert len(_epoch(train)[0]) == 10 and list(train.bad_paths) == [layout.train[3][0]]


def test_the_plans_seed_and_epochs_reach_the_device_loader_and_its_workers(layout, tmp_path):
    """The seed fixes the crops; the run's epochs are where the workers' stream ends (sources.EpochStream)."""
    _, train, val = _build(layout, tmp_path, workers=2, epochs=3)
    assert train.seed == val.seed == 5 and train.source.stream.last_epoch == 2
    _, open_ended, _ = _build(layout, tmp_path, workers=2)
    assert open_ended.source.stream.last_epoch is None
    train.close()
    open_ended.close()


def test_batch_seed_depends_on_seed_epoch_and_position():
    a = DeviceLoader(None, None, "cpu", 4, seed=0)
    b = DeviceLoader(None, None, "cpu", 4, seed=1)
    seeds = {a.batch_seed(0, 0), a.batch_seed(0, 4), a.batch_seed(1, 0), b.batch_seed(0, 0)}
    assert len(seeds) == 4


def test_worker_passes_carry_on_the_stream_and_restart_where_asked(layout, tmp_path, monkeypatch):
    from dlenv.data import loaders

    starts = []
    real = loaders.SafeLoader.__iter__
    monkeypatch.setattr(loaders.SafeLoader, "__iter__", lambda self: starts.append(1) or real(self))
    sampler, train, _ = _build(layout, tmp_path, workers=2)
    _, cached, _ = _build(layout, tmp_path, cache_mode="ram")  # the reference batches
    refs = {}
    for epoch, start in ((0, 0), (1, 0), (2, 0), (1, 4), (2, 0)):
        sampler.set_epoch(epoch, start)
        cached.sampler.set_epoch(epoch, start)
        refs[epoch, start] = _epoch(cached)
        x, y = _epoch(train)
        assert torch.equal(x, refs[epoch, start][0]) and torch.equal(y, refs[epoch, start][1]), (epoch, start)
    # epochs 0, 1, 2 in a row: one stream; the resume at (1, 4) starts a second, which (2, 0) continues
    assert len(starts) == 2
    # a pass cut short: the next one cannot continue the stream (the source's own pass, not the device
    # loader's: its producer thread may take an epoch this short to the end before the break)
    sampler.set_epoch(3)
    for _ in train.source:
        break
    sampler.set_epoch(4)
    cached.sampler.set_epoch(4)
    assert torch.equal(_epoch(train)[0], _epoch(cached)[0]) and len(starts) == 3
    assert (sampler.epoch, sampler.start) == (4, 0) and len(train) == 3


# ---------------------------------------------------------------------------------------------------
# Overlapped: the source's upload (a GPU decoder's decode) in a thread of its own, a batch ahead. The plan
# takes it on CUDA only; the same code runs on CPU tensors, so its batches, order and failures are held here.


def _sources(layout, bad_images="skip"):
    """Two DeviceLoaders over the nvJPEG source (decode_jpeg on the CPU here), serial and overlapped."""
    from dlenv.data.gpu_aug import GpuAugment
    from dlenv.data.sources import NvjpegSource

    out = []
    for overlap in (False, True):
        sampler = ResumableSampler(len(layout.train), seed=3)
        src = NvjpegSource(layout.train, sampler, 4, 20, bad_images)
        out.append(DeviceLoader(src, GpuAugment(IMG, True), "cpu", 4, sampler, seed=5, overlap=overlap))
    return out


def test_overlapped_loader_gives_the_serial_batches_in_order(layout):
    serial, overlapped = _sources(layout)
    for epoch, start in ((0, 0), (1, 0), (1, 4)):
        for loader in (serial, overlapped):
            loader.sampler.set_epoch(epoch, start)
        x1, y1 = _epoch(serial)
        x2, y2 = _epoch(overlapped)
        assert torch.equal(x1, x2) and torch.equal(y1, y2), (epoch, start)
        assert len(y2) == 10 - start


def test_overlapped_loader_skips_bad_files_as_the_serial_one_and_raises_their_error(layout):
    Path(layout.train[3][0]).write_bytes(b"\xff\xd8\xff broken")
    serial, overlapped = _sources(layout)
    x1, y1 = _epoch(serial)
    x2, y2 = _epoch(overlapped)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and len(y2) == 10
    assert list(overlapped.bad_paths) == list(serial.bad_paths) == [layout.train[3][0]]
    _, overlapped = _sources(layout, bad_images="error")
    before = threading.active_count()
    with pytest.raises(BadImageError, match=layout.train[3][0]):  # raised in the decoding thread
        _epoch(overlapped)
    assert threading.active_count() == before


def test_leaving_an_overlapped_loader_early_stops_both_threads(layout):
    _, overlapped = _sources(layout)
    before = threading.active_count()
    for _ in range(3):
        for _ in overlapped:
            break
    assert threading.active_count() == before


def test_a_source_failing_mid_epoch_reaches_the_training_thread_through_both_threads(layout):
    _, overlapped = _sources(layout)
    real = overlapped.source.upload
    calls = []

    def upload(batch, device):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk gone")
        return real(batch, device)

    overlapped.source.upload = upload
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for x, _ in overlapped:
            got.append(x)
    assert len(got) == 1  # the first batch arrived; the failure came in its place after it
