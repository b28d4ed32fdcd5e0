"""dlenv.data.fastpath on the CPU (built through the pipeline): the same batches from workers and cache,
seeding, resume, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from imagedata import make_photo_layout

from dlenv.data.fastpath import DeviceLoader
from dlenv.data.folder import find_layout
from dlenv.data.loaders import BadImageError
from dlenv.data.pipeline import InputPlan, make_loaders
from dlenv.data.sampler import ResumableSampler
from dlenv.errors import UserError

IMG = 16


@pytest.fixture
def layout(tmp_path):
    return find_layout(make_photo_layout(tmp_path / "ds", 10, 4, 2, lambda i: (30 + 2 * i, 24)))


def _build(layout, tmp_path, decoder="pil", **kw):
    sampler = ResumableSampler(len(layout.train), seed=3)
    plan = InputPlan(IMG, 4, on_device=True, decoder=decoder, cpu_decoder="pil", workers=kw.pop("workers", 0),
                     cache_dir=str(tmp_path / "cache"), **kw)
    train, val = make_loaders(layout, plan, "cpu", seed=5, train_sampler=sampler, say=lambda m: None)
    return sampler, train, val


def _epoch(loader):
    xs, ys = zip(*list(loader), strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_workers_and_cache_give_the_same_batches(layout, tmp_path):
    _, by_workers, val_w = _build(layout, tmp_path, workers=2)
    _, by_cache, val_c = _build(layout, tmp_path, cache=True, cache_mode="ram")
    x1, y1 = _epoch(by_workers)
    x2, y2 = _epoch(by_cache)
    assert x1.shape == (10, 3, IMG, IMG) and len(by_workers) == len(by_cache) == 3
    assert torch.equal(y1, y2) and torch.equal(x1, x2)
    xv, yv = _epoch(val_c)
    assert yv.tolist() == [y for _, y in layout.val]  # val in sample order
    assert torch.equal(xv, _epoch(val_w)[0])


def test_epochs_differ_and_repeat_and_resume_mid_epoch(layout, tmp_path):
    sampler, train, _ = _build(layout, tmp_path, cache=True, cache_mode="ram")
    sampler.set_epoch(0)
    e0, y0 = _epoch(train)
    assert torch.equal(_epoch(train)[0], e0)  # the same epoch again: the same crops
    sampler.set_epoch(1)
    assert not torch.equal(_epoch(train)[0], e0)
    sampler.set_epoch(0, start=4)  # a resume after the first batch of 4 samples
    x, y = _epoch(train)
    assert torch.equal(x, e0[4:]) and torch.equal(y, y0[4:])


def test_leaving_early_stops_the_producer_thread(layout, tmp_path):
    _, train, _ = _build(layout, tmp_path, cache=True, cache_mode="ram")
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


def test_nvjpeg_needs_a_gpu(layout, tmp_path):
    with pytest.raises(UserError, match="--decoder nvjpeg"):
        _build(layout, tmp_path, decoder="nvjpeg")


def test_batch_seed_depends_on_seed_epoch_and_position():
    a = DeviceLoader(None, None, "cpu", 4, seed=0)
    b = DeviceLoader(None, None, "cpu", 4, seed=1)
    seeds = {a.batch_seed(0, 0), a.batch_seed(0, 4), a.batch_seed(1, 0), b.batch_seed(0, 0)}
    assert len(seeds) == 4


# --------------------------------------------------------------------------- workers across epochs


def test_epoch_stream_follows_the_samplers_order_epoch_after_epoch():
    from dlenv.data.fastpath import EpochStream

    sampler = ResumableSampler(10, seed=7, batch_size=4)
    sampler.set_epoch(5)
    stream = EpochStream(sampler, 4)
    stream.begin(1, 6)
    it = iter(stream)
    got = [next(it) for _ in range(1 + 3 + 3)]  # the rest of epoch 1, then epochs 2 and 3
    want = []
    for epoch, start in ((1, 6), (2, 0), (3, 0)):
        ref = ResumableSampler(10, seed=7, batch_size=4)
        ref.set_epoch(epoch, start)
        order = list(ref)
        want += [order[k:k + 4] for k in range(0, len(order), 4)]
    assert got == want and sum(len(b) for b in got) == 4 + 10 + 10
    assert (sampler.epoch, sampler.start) == (5, 0)  # the caller's sampler is left alone
    assert list(EpochStream(ResumableSampler(0), 4)) == []  # no samples: the stream ends


def test_worker_passes_carry_on_the_stream_and_restart_where_asked(layout, tmp_path, monkeypatch):
    from dlenv.data import loaders

    starts = []
    real = loaders.SafeLoader.__iter__
    monkeypatch.setattr(loaders.SafeLoader, "__iter__", lambda self: starts.append(1) or real(self))
    sampler, train, _ = _build(layout, tmp_path, workers=2)
    _, cached, _ = _build(layout, tmp_path, cache=True, cache_mode="ram")  # the reference batches
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


class _Logged(torch.utils.data.Dataset):
    """Records each index as a worker loads it (an appended line per load, visible across processes)."""

    def __init__(self, n, log):
        self.n, self.log = n, str(log)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return (torch.zeros(2, 2, 3, dtype=torch.uint8), torch.tensor([2, 2], dtype=torch.int32)), i


def test_workers_decode_the_next_epoch_before_it_is_asked_for(tmp_path):
    """The point of the stream: when an epoch ends, the workers are already on the next one."""
    import time

    from dlenv.data.fastpath import WorkerSource

    log = tmp_path / "loads"
    sampler = ResumableSampler(12, seed=1, batch_size=4)
    source = WorkerSource(_Logged(12, log), sampler, 4, workers=2, pin=False)
    sampler.set_epoch(0)
    assert [b[2].tolist() for b in source] == [list(sampler)[k:k + 4] for k in (0, 4, 8)]
    nxt = ResumableSampler(12, seed=1, batch_size=4)
    nxt.set_epoch(1)
    first = set(list(nxt)[:4])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loads = [int(v) for v in log.read_text().split()]
        if len(loads) > 12 and first <= set(loads[12:]):
            break
        time.sleep(0.05)
    assert first <= set(loads[12:]), "epoch 1's first batch was not loaded ahead"
    sampler.set_epoch(1)
    assert next(iter(source))[2].tolist() == list(nxt)[:4]


def test_epoch_stream_ends_after_the_runs_last_epoch():
    from dlenv.data.fastpath import EpochStream

    stream = EpochStream(ResumableSampler(10, seed=2, batch_size=4), 4, last_epoch=1)
    stream.begin(0, 8)
    assert [len(b) for b in stream] == [2, 4, 4, 2]  # the rest of epoch 0, then epoch 1, then the end
    stream.begin(3, 0)  # past the last: a caller other than the trainer, so no end
    it = iter(stream)
    assert [len(next(it)) for _ in range(6)] == [4, 4, 2, 4, 4, 2]


def test_workers_stop_decoding_after_the_last_epoch(tmp_path):
    import time

    from dlenv.data.fastpath import WorkerSource

    log = tmp_path / "loads"
    sampler = ResumableSampler(12, seed=1, batch_size=4)
    source = WorkerSource(_Logged(12, log), sampler, 4, workers=2, pin=False, last_epoch=0)
    sampler.set_epoch(0)
    assert sum(len(b[2]) for b in source) == 12
    time.sleep(1.0)  # unbounded, the workers load the next epoch's first batches well within this
    assert sorted(int(v) for v in log.read_text().split()) == list(range(12))
