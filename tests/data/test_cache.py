"""dlenv.data.cache: decoded once, equal to a direct decode, reused, invalidated, never half-written."""

from __future__ import annotations

import logging
import os
from collections import namedtuple

import numpy as np
import pytest
from imagedata import photo

from dlenv.data import cache as cache_mod
from dlenv.data.badimages import BadImageError
from dlenv.data.cache import build_cache, on_disk
from dlenv.data.decode import decode_stored
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
    assert not on_disk(samples, SIZE, tmp_path / "c")
    first = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert not first.reused
    # what --cache-mode auto reads when planning (dlenv.data.plan): this data's disk cache is there
    assert on_disk(samples, SIZE, tmp_path / "c") and not on_disk(samples[:4], SIZE, tmp_path / "c")
    monkeypatch.setattr(cache_mod, "decode_stored", lambda *a: pytest.fail("decoded again"))
    said = []
    again = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=said.append)
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
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda p: Usage(10, 10, 0))
    with pytest.raises(UserError, match="--cache-mode ram"):
        build_cache(samples, SIZE, mode="disk", cache_dir=tmp_path / "c", say=_quiet)
    with pytest.raises(UserError, match="--cache-mode 'auto' is not one of: ram, disk"):  # the plan decides it
        build_cache(samples, SIZE, mode="auto", cache_dir=tmp_path / "c", say=_quiet)


def test_unwritable_cache_dir_is_a_user_error(samples, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="--cache-dir"):
        build_cache(samples, SIZE, mode="disk", cache_dir=blocker / "sub", say=_quiet)


# ------------------------------------------------------------------------- the cache's own files, tampered

N = 5  # images in `samples`


def _npy(header: dict, body: bytes = b"", version=(1, 0)) -> bytes:
    import io

    f = io.BytesIO()
    (np.lib.format.write_array_header_1_0 if version == (1, 0) else np.lib.format.write_array_header_2_0)(f, header)
    return f.getvalue() + body


def _npy_raw(header: bytes) -> bytes:
    """A 1.0 .npy header of these bytes exactly, padded as numpy pads (a dict literal, or not)."""
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


def _saved(arr, **kw) -> bytes:
    import io

    f = io.BytesIO()
    np.save(f, arr, **kw)
    return f.getvalue()


class _Touch:
    """Unpickled, it creates the marker file: what an object array in the sizes file would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


GOOD = np.full((N, 2), 40, np.int32)
SIZES_FILES = {  # sizes-file content -> what the one line says of it
    "object array": (lambda marker: _saved(np.array([_Touch(marker)] * N, dtype=object), allow_pickle=True),
                     "object"),
    "wrong shape": (lambda m: _saved(np.zeros((N + 1, 2), np.int32)), "6x2 int32 array, not the 5x2"),
    "one column": (lambda m: _saved(np.zeros((N, 1), np.int32)), "5x1 int32"),
    "flat": (lambda m: _saved(np.zeros(2 * N, np.int32)), "10 int32"),
    "scalar": (lambda m: _saved(np.int32(7)), "scalar int32"),
    "float64": (lambda m: _saved(GOOD.astype(np.float64)), "float64"),
    "int64": (lambda m: _saved(GOOD.astype(np.int64)), "int64"),
    "big-endian": (lambda m: _saved(GOOD.astype(">i4")), ">i4"),
    "fortran order": (lambda m: _saved(np.asfortranarray(np.zeros((2, N), np.int32).T)), "Fortran order"),
    "7 TiB header": (lambda m: _npy({"descr": "<i4", "fortran_order": False, "shape": (2**40, 2)}, b"\0" * 40),
                     "1099511627776x2"),
    "7 TiB in 2.0": (lambda m: _npy({"descr": "<i4", "fortran_order": False, "shape": (2**40, 2)}, b"", (2, 0)),
                     "1099511627776x2"),
    "cut short": (lambda m: _saved(GOOD)[:-4], "bytes, not the"),
    "trailing bytes": (lambda m: _saved(GOOD) + b"\0" * 8, "bytes, not the"),
    "zero width": (lambda m: _saved(np.zeros((N, 2), np.int32)), "image sizes that no decoded image has"),
    "negative": (lambda m: _saved(-GOOD), "image sizes that no decoded image has"),
    "huge side": (lambda m: _saved(GOOD * 2**25), "image sizes that no decoded image has"),
    "not npy": (lambda m: b"width,height\n40,30\n", "not a sizes file"),
    "empty": (lambda m: b"", "not a sizes file"),
    "npy 3.0": (lambda m: b"\x93NUMPY\x03\x00" + _saved(GOOD)[8:], "format 3.0"),
    "bad header": (lambda m: b"\x93NUMPY\x01\x00\x10\x00{'descr': __imp" + b" " * 10 + b"\n", "not a sizes file"),
    "nested header": (lambda m: _npy_raw(b"{'descr': " + b"(" * 3000 + b")" * 3000 + b"}"), "not a sizes file"),
    "header of code": (lambda m: _npy_raw(f"{{'descr': __import__('os').system('touch {m}')}}".encode()),
                       "not a sizes file"),
}
OTHER_FILES = {  # (which file, its new content) -> what the one line says
    "data cut": (".u8", lambda old: old[:-100], "bytes, not the"),
    "data longer": (".u8", lambda old: old + b"\0", "bytes, not the"),
    "data empty": (".u8", lambda old: b"", "0 bytes, not the"),
    "meta other n": (".json", lambda old: old.replace(b'"n": 5', b'"n": 6'), "describes other data"),
    "meta a list": (".json", lambda old: b"[1, 2]", "is not a cache's meta file"),
    "meta not json": (".json", lambda old: b"\xff\xfe garbage", "cannot be read"),
}


def _tampered(samples, tmp_path, which, content, capsys=None):
    """Build a disk cache, replace one of its files by `content(old bytes)`, build again: (the second
    cache, what it said)."""
    build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    path = next((tmp_path / "c").glob(f"*{which}"))
    new = content(path.read_bytes())
    path.unlink()
    path.write_bytes(new)
    said = []
    assert on_disk(samples, SIZE, tmp_path / "c")  # a damaged one counts: --cache-mode auto rebuilds it there
    again = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=said.append)
    return again, said


def _equals_direct(c, samples):
    for i, (path, _) in enumerate(samples):
        arr, wh = decode_stored(path, SIZE, "pil")
        assert np.array_equal(c.images[i], arr) and tuple(c.sizes[i]) == wh


@pytest.mark.parametrize("case", list(SIZES_FILES))
def test_a_tampered_sizes_file_is_rebuilt_in_one_line(samples, tmp_path, case):
    marker = tmp_path / "RAN"
    content, expect = SIZES_FILES[case]
    again, said = _tampered(samples, tmp_path, ".sizes.npy", lambda old: content(marker))
    stale = [s for s in said if "decoding again" in s]
    assert len(stale) == 1 and expect in stale[0] and "\n" not in stale[0], said
    assert not again.reused and not marker.exists()  # never unpickled
    _equals_direct(again, samples)
    assert build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet).reused  # the rebuilt one holds


@pytest.mark.parametrize("case", list(OTHER_FILES))
def test_a_tampered_data_or_meta_file_is_rebuilt_in_one_line(samples, tmp_path, case):
    which, content, expect = OTHER_FILES[case]
    again, said = _tampered(samples, tmp_path, which, content)
    stale = [s for s in said if "decoding again" in s]
    assert len(stale) == 1 and expect in stale[0], said
    assert not again.reused
    _equals_direct(again, samples)


def test_a_fifo_as_the_sizes_file_is_rebuilt_and_a_folder_refused(samples, tmp_path):
    build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    sizes = next((tmp_path / "c").glob("*.sizes.npy"))
    sizes.unlink()
    os.mkfifo(sizes)  # opening it to read would wait for a writer forever
    said = []
    again = build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=said.append)
    assert not again.reused and any("a named pipe" in s and "decoding again" in s for s in said), said
    sizes.unlink()
    sizes.mkdir()
    with pytest.raises(UserError, match="is a folder, and dlenv keeps a cache file under that name"):
        build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)


def test_a_bad_row_of_zeros_is_not_a_mismatch(samples, tmp_path):
    with open(samples[2][0], "wb") as f:  # a file that fails to decode keeps a (0, 0) row
        f.write(b"")
    build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet)
    assert build_cache(samples, SIZE, "pil", "disk", tmp_path / "c", say=_quiet).reused


@pytest.mark.parametrize(("n_bad", "expect"), [
    (1, "skipping 1 unreadable image: "),
    (3, "skipping 3 unreadable images: "),
    (30, "skipping 30 unreadable images: "),
])
def test_unreadable_files_are_one_line_however_many(tmp_path, n_bad, expect, caplog):
    samples = [(str(photo(tmp_path / f"ok{i}.jpg", 40, 30, seed=i)), i % 2) for i in range(2)]
    for i in range(n_bad):
        (tmp_path / f"empty{i:03d}.jpg").write_bytes(b"")
        samples.append((str(tmp_path / f"empty{i:03d}.jpg"), i % 2))
    caplog.set_level(logging.WARNING, "dlenv.data")
    c = build_cache(samples, SIZE, "pil", "ram", say=_quiet)
    assert len(c.bad) == n_bad
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(expect) and "\n" not in lines[0]
    assert "empty000.jpg" in lines[0]
    assert (f"and {n_bad - 3} more" in lines[0]) == (n_bad > 3)
