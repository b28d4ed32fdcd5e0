"""dlenv.data.sources: the table the plan's name picks from, the one bad-image rule on every source (the GPU
decoders with torchvision's CPU decode and a stand-in for nvImageCodec; the real ones on a GPU:
tests/data/test_fastpath_gpu.py), and the DataLoader workers' stream across epochs (through the device loader:
tests/data/test_fastpath.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from imagedata import photo
from PIL import Image

from dlenv.data import hwdecode, sources
from dlenv.data.badimages import BadImageError
from dlenv.data.decode import decode_stored
from dlenv.data.plan import ENGINE_BACKENDS, GPU_DECODERS, InputPlan
from dlenv.data.sampler import ResumableSampler
from dlenv.data.sources import EpochStream, WorkerSource

IMG = 16
SIZE = 40  # the stored square of the sources' own tests


def test_every_source_the_plan_can_name_is_in_the_table():
    names = {InputPlan(IMG, 4, True, d, "pil", 0, cache_mode=m).source
             for d in ("pil", "cv2", "tvio", *GPU_DECODERS) for m in ("off", "ram", "disk")}
    assert names == set(sources.SOURCES) == {"workers", "cache", *GPU_DECODERS}


class _Engines:
    """nvImageCodec's Decoder as the source calls it (read(): (H, W, 3) uint8 or None per path), on the CPU."""

    made: list = []

    def __init__(self, device, threads=2, backends=()):
        _Engines.made.append(tuple(backends))

    def read(self, paths):
        out = []
        for p in paths:
            try:
                out.append(torch.from_numpy(np.array(Image.open(p).convert("RGB"))))
            except Exception:
                out.append(None)
        return out


@pytest.fixture
def engines(monkeypatch):
    """nvImageCodec: the stand-in."""
    _Engines.made = []
    monkeypatch.setattr(hwdecode, "HwJpegDecoder", _Engines)
    return _Engines


@pytest.fixture
def photos(tmp_path, engines):
    """Five JPEGs of three sizes and labels 0-4; the second is broken. nvImageCodec: the stand-in."""
    samples = [(str(photo(tmp_path / f"{i}.jpg", w=48 + 8 * (i % 3), h=40, seed=i)), i) for i in range(5)]
    Path(samples[1][0]).write_bytes(b"\xff\xd8\xff broken")
    return samples


def _first_batch(name, samples, bad_images, tmp_path, batch=5):
    plan = InputPlan(SIZE, batch, True, name if name in GPU_DECODERS else "pil", "pil", 0,
                     cache_mode="ram" if name == "cache" else "off", cache_dir=str(tmp_path / "c"),
                     bad_images=bad_images)
    src = sources.SOURCES[plan.source](samples, None, plan, torch.device("cpu"), lambda m: None)
    return src, src.upload(next(iter(src)), torch.device("cpu"))


@pytest.mark.parametrize("name", ["workers", "cache", "nvjpeg", "nvimgcodec"])
def test_every_source_replaces_a_bad_image_by_the_next_readable_sample_image_and_label(name, photos, tmp_path):
    """The one rule (badimages.first_readable): the same substitute, pixels, size and label, on every source."""
    from dlenv.data.decode import stored_size

    size = stored_size(SIZE)
    src, (images, sizes, labels) = _first_batch(name, photos, "skip", tmp_path)
    assert labels.tolist() == [0, 2, 2, 3, 4] and list(src.bad_paths) == [photos[1][0]]
    assert torch.equal(images[1], images[2]) and torch.equal(sizes[1], sizes[2])
    ref, wh = decode_stored(photos[2][0], size, "pil")
    assert tuple(sizes[1].tolist()) == wh and np.abs(images[1].numpy().astype(int) - ref).mean() < 4


@pytest.mark.parametrize("name", ["workers", "cache", "nvjpeg", "nvimgcodec"])
def test_a_substitute_comes_from_beyond_the_batch_and_round_the_end(name, photos, tmp_path):
    """Batches of two: the second sample's substitute is in the next batch, the last one's is the first."""
    from dlenv.data.decode import stored_size

    Path(photos[4][0]).write_bytes(b"")
    src, _ = _first_batch(name, photos, "skip", tmp_path, batch=2)
    batches = [src.upload(b, torch.device("cpu")) for b in src]
    assert [labels.tolist() for _, _, labels in batches] == [[0, 2], [2, 3], [0]]
    assert list(src.bad_paths) == [photos[1][0], photos[4][0]]
    ref, wh = decode_stored(photos[2][0], stored_size(SIZE), "pil")
    assert tuple(batches[0][1][1].tolist()) == wh and np.abs(batches[0][0][1].numpy().astype(int) - ref).mean() < 4


@pytest.mark.parametrize("name", ["workers", "cache", "nvjpeg", "nvimgcodec"])
def test_every_source_stops_on_a_bad_image_or_none_readable_in_one_line(name, photos, tmp_path):
    with pytest.raises(BadImageError, match="1.jpg could not be decoded .*--bad-images skip"):
        _first_batch(name, photos, "error", tmp_path)
    for path, _ in photos:
        Path(path).write_bytes(b"not an image")
    with pytest.raises(BadImageError, match="0.jpg could not be decoded .*no other image in the dataset decodes"):
        _first_batch(name, photos, "skip", tmp_path)


def test_the_nvimgcodec_source_takes_the_plans_backends(photos, tmp_path):
    plan = InputPlan(SIZE, 5, True, "nvimgcodec", "pil", 0, gpu_backends=("HW_GPU_ONLY", "CPU_ONLY"))
    sources.SOURCES[plan.source](photos, None, plan, torch.device("cpu"), print)
    sources.SOURCES[plan.source](photos, None, InputPlan(SIZE, 5, True, "nvimgcodec", "pil", 0),
                                 torch.device("cpu"), print)
    assert _Engines.made == [("HW_GPU_ONLY", "CPU_ONLY"), ()]


def _engines_source(samples, bad_images="skip"):
    return sources.NvimgcodecSource(samples, None, len(samples), 40, bad_images, "cpu", ENGINE_BACKENDS)


def test_the_nvimgcodec_source_matches_pillows_stored_form(tmp_path, engines):
    samples = [(str(photo(tmp_path / f"{i}.jpg", w=60 + 10 * i, h=48, seed=i)), i % 2) for i in range(4)]
    src = _engines_source(samples)
    assert engines.made == [("HW_GPU_ONLY", "CPU_ONLY")]  # the plan's backends (engines: never the SMs' decoder)
    images, sizes, labels = src.upload(next(iter(src)), torch.device("cpu"))
    assert images.shape == (4, 40, 40, 3) and images.dtype == torch.uint8
    for k, (path, label) in enumerate(samples):
        ref, wh = decode_stored(path, 40, "pil")
        assert tuple(sizes[k].tolist()) == wh and labels[k].item() == label
        assert np.abs(images[k].numpy().astype(int) - ref).mean() < 2


@pytest.mark.parametrize("bad", [b"\xff\xd8\xff broken", b"", b"not an image at all"])
def test_the_nvimgcodec_source_skips_or_stops_on_bad_files_and_pngs_go_to_pillow(tmp_path, engines, bad):
    samples = [(str(photo(tmp_path / f"{i}.jpg", seed=i)), 0) for i in range(3)]
    Path(samples[1][0]).write_bytes(bad)
    Image.new("RGB", (50, 30), (200, 10, 10)).save(tmp_path / "p.png")
    samples.append((str(tmp_path / "p.png"), 1))
    src = _engines_source(samples)
    images, sizes, _ = src.upload(next(iter(src)), torch.device("cpu"))
    assert torch.equal(images[1], images[2]) and list(src.bad_paths) == [samples[1][0]]
    assert tuple(sizes[3].tolist()) == (50, 30) and images[3, 20, 20].tolist() == [200, 10, 10]
    with pytest.raises(BadImageError, match="1.jpg"):
        src = _engines_source(samples, "error")
        src.upload(next(iter(src)), torch.device("cpu"))


def test_epoch_stream_follows_the_samplers_order_epoch_after_epoch():
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
    stream = EpochStream(ResumableSampler(10, seed=2, batch_size=4), 4, last_epoch=1)
    stream.begin(0, 8)
    assert [len(b) for b in stream] == [2, 4, 4, 2]  # the rest of epoch 0, then epoch 1, then the end
    stream.begin(3, 0)  # past the last: a caller other than the trainer, so no end
    it = iter(stream)
    assert [len(next(it)) for _ in range(6)] == [4, 4, 2, 4, 4, 2]


def test_workers_stop_decoding_after_the_last_epoch(tmp_path):
    import time

    log = tmp_path / "loads"
    sampler = ResumableSampler(12, seed=1, batch_size=4)
    source = WorkerSource(_Logged(12, log), sampler, 4, workers=2, pin=False, last_epoch=0)
    sampler.set_epoch(0)
    assert sum(len(b[2]) for b in source) == 12
    time.sleep(1.0)  # unbounded, the workers load the next epoch's first batches well within this
    assert sorted(int(v) for v in log.read_text().split()) == list(range(12))
