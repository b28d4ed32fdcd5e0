"""dlenv.data.cache: decoded once, equal to a direct decode, reused, invalidated, never half-written."""

from __future__ import annotations

import logging
import os
from collections import namedtuple

import numpy as np
import pytest
from imagedata import photo

from dlenv.data import cache as cache_mod
from dlenv.data.cache import build_cache, choose_mode, nbytes
from dlenv.data.decode import decode_stored
from dlenv.data.loaders import BadImageError
from dlenv.errors import UserError

SIZE = 20


@pytest.fixture
def samples(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    return [(str(photo(d / f"{i}.jpg", 40 + 4 * i, 30, seed=i)), i % 2) for i in range(5)]


def _quiet(msg):
    pass


@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_cache_equals_direct_decode(samples, tmp_path, mode):
    c = build_cache(samples, SIZE, "pil", mode, tmp_path / "c", workers=2, say=_quiet)
    assert c.images.shape == (5, SIZE, SIZE, 3) and c.images.dtype == np.uint8
    assert isinstance(c.images, np.memmap) == (mode == "disk")
    for i, (path, label) in enumerate(samples):
        arr, wh = decode_stored(path, SIZE, "pil")
        assert np.array_equal(c.images[i], arr) and tuple(c.sizes[i]) == wh and c.labels[i] == label
    assert c.source.tolist() == list(range(5)) and not c.bad


def test_disk_cache_is_reused_without_decoding(samples, tmp_path, monkeypatch):
    first = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert not first.reused
    monkeypatch.setattr(cache_mod, "decode_stored", lambda *a: pytest.fail("decoded again"))
    said = []
    again = build_cache(samples, SIZE, "pil", "auto", tmp_path / "c", say=said.append)  # auto finds it
    assert again.reused and again.where == first.where and "reusing" in said[0]
    assert np.array_equal(np.asarray(again.images), np.asarray(first.images))
    assert sorted(p.suffix for p in (tmp_path / "c").iterdir()) == [".json", ".npy", ".u8"]


def test_changed_file_or_size_rebuilds(samples, tmp_path):
    first = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    st = os.stat(samples[1][0])
    os.utime(samples[1][0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert not touched.reused and touched.where != first.where
    resized = build_cache(samples, SIZE + 2, "pil", "disk", tmp_path / "c", say=_quiet)
    assert not resized.reused and resized.images.shape[1] == SIZE + 2
    fewer = build_cache(samples[:4], SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert not fewer.reused


def test_bad_file_skip_substitutes_next_and_logs_once(samples, tmp_path, caplog):
    with open(samples[2][0], "wb") as f:
        f.write(b"\xff\xd8\xff garbage")
    caplog.set_level(logging.WARNING, "dlenv.data")
    for _ in range(2):  # built, then reused: the bad file is reported each run, once
        c = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert c.source.tolist() == [0, 1, 3, 3, 4] and list(c.bad) == [samples[2][0]]
    assert sum(samples[2][0] in r.getMessage() for r in caplog.records) == 2


def test_bad_file_error_keeps_nothing(samples, tmp_path):
    with open(samples[3][0], "wb") as f:
        f.write(b"")
    with pytest.raises(BadImageError) as e:
        build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", bad_images="error", say=_quiet)
    assert samples[3][0] in str(e.value)
    assert list((tmp_path / "c").iterdir()) == []  # no partial file, no meta


def test_all_bad_is_an_error(tmp_path):
    paths = []
    for i in range(2):
        (tmp_path / f"{i}.jpg").write_bytes(b"x")
        paths.append((str(tmp_path / f"{i}.jpg"), 0))
    with pytest.raises(BadImageError, match="no other image"):
        build_cache(paths, SIZE, mode="ram", say=_quiet)


Usage = namedtuple("Usage", "total used free")


def test_too_big_for_memory_or_disk_says_what_to_do(samples, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "available_memory", lambda: 1000)
    with pytest.raises(UserError, match="--cache-mode disk"):
        build_cache(samples, SIZE, mode="ram", cache_dir=tmp_path / "c", say=_quiet)
    assert choose_mode("auto", 5, SIZE, tmp_path / "c", "k") == "disk"
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda p: Usage(10, 10, 0))
    with pytest.raises(UserError, match="--cache-mode ram"):
        build_cache(samples, SIZE, mode="disk", cache_dir=tmp_path / "c", say=_quiet)
    monkeypatch.setattr(cache_mod, "available_memory", lambda: 10 * nbytes(5, SIZE))
    assert choose_mode("auto", 5, SIZE, tmp_path / "c", "k") == "ram"


def test_unwritable_cache_dir_is_a_user_error(samples, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--cache-dir"):
        build_cache(samples, SIZE, mode="disk", cache_dir=blocker / "sub", say=_quiet)
