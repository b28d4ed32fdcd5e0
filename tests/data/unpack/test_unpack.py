"""dlenv.data.unpack: every kind of archive, real-world quirks, hostile members, nothing lost."""

from __future__ import annotations

import gzip
import hashlib
import os
import signal
import stat
import struct
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
import zlib
from pathlib import Path

import pytest
from archivemaker import dataset_members, make_tar, make_zip, snapshot, tar_entry, zip_link

from dlenv import archives, cli
from dlenv.archives import ARCHIVE_SUFFIXES, FORMATS
from dlenv.data import unpack as archive
from dlenv.data.unpack import MARKER, formats, guard
from dlenv.errors import UserError
from dlenv.options import config

SRC = Path(__file__).resolve().parents[3] / "src"


# ---------------------------------------------------------------------------------------------------
# Helpers: build archives, snapshot folders.


def unmarked(snap: dict[str, str], root: str = "") -> dict[str, str]:
    """`snap` without the marker unpack leaves in the folder it made (`root` within the snapshot),
    asserting it is there as a file of unpack's own."""
    key = f"{root}/{MARKER}" if root else MARKER
    assert snap.get(key) not in (None, "dir") and not snap[key].startswith("link:"), sorted(snap)
    return {k: v for k, v in snap.items() if k != key}


class _LegacyName(zipfile.ZipInfo):
    """A ZipInfo written with raw code-page bytes and no UTF-8 flag, as Windows tools do."""

    def __init__(self, raw: bytes, **kw):
        super().__init__(raw.decode("cp437"), **kw)

    def _encodeFilenameFlags(self):  # noqa: N802 (zipfile's own name)
        return self.filename.encode("cp437"), self.flag_bits & ~0x800


@pytest.fixture
def work(tmp_path):
    """tmp_path/in for archives, tmp_path/out/ds: an existing destination the tests must never lose."""
    (tmp_path / "in").mkdir()
    dest = tmp_path / "out" / "ds"
    dest.mkdir(parents=True)
    (dest / "keep.txt").write_text("the user's data")
    return tmp_path


def unpack(src, dest, **kw):
    return archive.unpack(src, dest, progress=False, **kw)


def assert_refused(work: Path, src: Path, match: str, **kw) -> None:
    """Refused with one line naming the problem; the whole tree (dest, its parent) exactly as before."""
    before = snapshot(work)
    with pytest.raises(UserError, match=match) as e:
        unpack(src, work / "out" / "ds", overwrite=True, **kw)
    assert "\n" not in str(e.value)
    assert snapshot(work) == before


# ---------------------------------------------------------------------------------------------------
# Formats.


@pytest.mark.parametrize("fmt", ["zip", "tar", "tar.gz", "tgz", "tar.bz2", "tar.xz"])
def test_each_format_unpacks_and_flattens_single_top_folder(tmp_path, fmt):
    members = dataset_members()
    src = tmp_path / f"pets.{fmt}"
    if fmt == "zip":
        make_zip(src, members)
    else:
        mode = {"tar": "w", "tgz": "w:gz"}.get(fmt, "w:" + fmt.split(".")[-1])
        make_tar(src, members, mode)
    assert archive.detect_format(src).startswith("zip" if fmt == "zip" else "tar")
    r = unpack(src, tmp_path / "data" / "pets")
    out = tmp_path / "data" / "pets"
    assert r.flattened == "ds" and r.files == 4
    for name, data in members:
        assert (out / name.removeprefix("ds/")).read_bytes() == data
    assert sorted(os.listdir(tmp_path / "data")) == ["pets"]  # no temporary folder left beside it


def test_7z(tmp_path):
    py7zr = pytest.importorskip("py7zr")
    src = tmp_path / "set.7z"
    with py7zr.SevenZipFile(src, "w") as z:
        z.writestr(b"abc" * 100, "set/train/猫/1.jpg")
        z.writestr(b"", "set/train/猫/empty.jpg")
        z.writestr(b"x", "set/.DS_Store")
        z.writestr(b"def" * 100, "set/val/狗/2.jpg")
    r = unpack(src, tmp_path / "out")
    assert r.format == "7z" and r.flattened == "set" and r.junk == 1
    assert (tmp_path / "out/train/猫/1.jpg").read_bytes() == b"abc" * 100
    assert (tmp_path / "out/train/猫/empty.jpg").read_bytes() == b""
    assert (tmp_path / "out/val/狗/2.jpg").read_bytes() == b"def" * 100
    assert not (tmp_path / "out/.DS_Store").exists()


def test_format_is_read_from_content_not_suffix(tmp_path):
    src = make_zip(tmp_path / "really-a-zip.tar.gz", [("a/x.jpg", b"1"), ("b/y.jpg", b"2")])
    r = unpack(src, tmp_path / "out")
    assert r.format == "zip" and (tmp_path / "out/a/x.jpg").read_bytes() == b"1"


@pytest.mark.parametrize("name, stem", [("pets.tar.gz", "pets"), ("a.b.tgz", "a.b"), ("x.zip", "x"),
                                        ("c.7z", "c"), ("d.tar.xz", "d"), ("noext", "noext")])
def test_archive_stem(name, stem):
    assert archive.archive_stem(Path(name)) == stem


# ---------------------------------------------------------------------------------------------------
# The one table of formats (dlenv.archives.FORMATS): detection, the dispatch and the suffixes read it.


def test_every_row_names_a_reader_and_suffixes_that_never_overlap():
    for fmt in FORMATS:
        assert callable(getattr(formats, fmt.reader)), fmt.name
        assert fmt.magic or fmt.sniff, f"{fmt.name}: nothing tells it"
    # no suffix ends with another: the order of ARCHIVE_SUFFIXES never decides a name
    assert not [(a, b) for a in ARCHIVE_SUFFIXES for b in ARCHIVE_SUFFIXES if a != b and a.endswith(b)]
    assert {n for n in dir(formats) if n.startswith("unpack_")} == {f.reader for f in FORMATS}


def test_the_tables_lines_read_as_before():
    assert archives.names_said() == "zip, tar, tar.gz, tar.bz2, tar.xz or 7z"
    assert archives.suffixes_said() == ".zip, .tar(.gz/.bz2/.xz) or .7z"
    assert sorted(ARCHIVE_SUFFIXES) == sorted((".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tbz2", ".tbz", ".txz",
                                               ".tar", ".zip", ".7z"))


@pytest.mark.parametrize("head, fmt", [
    (b"BZh" + bytes(254) + b"ustar" + bytes(250), "tar.bz2"),  # a row's magic is tried before tar's mark
    (b"PK\x05\x06" + bytes(508), "zip"),
    (bytes(512), "tar"),                                       # zeros: an empty tar
])
def test_magic_bytes_come_before_a_mark_further_in(tmp_path, head, fmt):
    (tmp_path / "a").write_bytes(head)
    assert archive.detect_format(tmp_path / "a") == fmt


def test_a_file_of_no_format_names_every_row(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"hello, not an archive" * 40)
    with pytest.raises(UserError, match=r"its content is no zip, tar, tar.gz, tar.bz2, tar.xz or 7z\); check"):
        archive.detect_format(tmp_path / "a.bin")


def test_default_destination_is_data_stem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_tar(tmp_path / "flowers.tar.gz", [("a/1.jpg", b"1"), ("b/2.jpg", b"2")], "w:gz")
    r = archive.unpack("flowers.tar.gz", progress=False)
    assert r.dest == Path("data/flowers")
    assert (tmp_path / "data/flowers/a/1.jpg").read_bytes() == b"1"
    assert r.flattened is None  # two top-level folders stay as they are


# ---------------------------------------------------------------------------------------------------
# Real-world archives.


def test_gbk_names_backslashes_and_junk(tmp_path):
    members = [
        (_LegacyName("数据集/训练/猫/1.jpg".encode("gbk")), b"cat"),
        (_LegacyName("数据集\\验证\\狗\\2.jpg".encode("gbk")), b"dog"),  # Windows separators
        (_LegacyName(b"__MACOSX/x/._1.jpg"), b"junk"),
        (_LegacyName("数据集/训练/猫/._1.jpg".encode("gbk")), b"junk"),
        (_LegacyName("数据集/.DS_Store".encode("gbk")), b"junk"),
        (_LegacyName("数据集/训练/Thumbs.db".encode("gbk")), b"junk"),
        (_LegacyName("数据集/desktop.ini".encode("gbk")), b"junk"),
    ]
    src = make_zip(tmp_path / "win.zip", members)
    with zipfile.ZipFile(src) as z:  # the test really made unflagged names that zipfile reads as cp437
        assert all(not i.flag_bits & 0x800 for i in z.infolist())
        assert "训练" not in z.namelist()[0]
    r = unpack(src, tmp_path / "out")
    assert r.name_encoding == "gb18030" and r.junk == 5 and r.flattened == "数据集"
    assert unmarked(snapshot(tmp_path / "out")) == {
        "训练": "dir", "验证": "dir", "训练/猫": "dir", "验证/狗": "dir",
        "训练/猫/1.jpg": hashlib.sha1(b"cat").hexdigest(), "验证/狗/2.jpg": hashlib.sha1(b"dog").hexdigest()}


def test_shift_jis_and_unflagged_utf8_names(tmp_path):
    sjis = make_zip(tmp_path / "jp.zip", [(_LegacyName("ねこ/猫.jpg".encode("cp932")), b"1"),
                                          (_LegacyName("いぬ/犬.jpg".encode("cp932")), b"2")])
    unpack(sjis, tmp_path / "jp")
    assert (tmp_path / "jp/ねこ/猫.jpg").exists() and (tmp_path / "jp/いぬ/犬.jpg").exists()
    mac = make_zip(tmp_path / "mac.zip", [(_LegacyName("café/ü.jpg".encode()), b"1"),
                                          (_LegacyName(b"b/x.jpg"), b"2")])
    r = unpack(mac, tmp_path / "mac")
    assert r.name_encoding == "utf-8" and (tmp_path / "mac/café/ü.jpg").exists()


def test_unicode_path_extra_field_wins(tmp_path):
    raw = "猫/1.jpg".encode("gbk")
    info = _LegacyName(raw)
    utf8 = "猫/1.jpg".encode()
    body = b"\x01" + struct.pack("<I", zlib.crc32(raw)) + utf8
    info.extra = struct.pack("<HH", 0x7075, len(body)) + body
    src = make_zip(tmp_path / "x.zip", [(info, b"1"), ("狗/2.jpg", b"2")])
    unpack(src, tmp_path / "out", name_encoding="cp437")  # the extra field overrides even a wrong code page
    assert (tmp_path / "out/猫/1.jpg").read_bytes() == b"1"


@pytest.mark.parametrize("text, codec, want", [
    ("训练集/猫咪", "gbk", "gb18030"), ("ねこ/いぬ", "cp932", "cp932"), ("猫/犬", "cp932", "cp932"),
    ("plain/ascii", "ascii", "utf-8"), ("données", "utf-8", "utf-8")])
def test_guess_name_codec(text, codec, want):
    assert archive.guess_name_codec([text.encode(codec)]) == want


def test_explicit_name_encoding(tmp_path):
    src = make_zip(tmp_path / "kr.zip", [(_LegacyName("고양이/1.jpg".encode("cp949")), b"1"),
                                         ("b/2.jpg", b"2")])
    unpack(src, tmp_path / "out", name_encoding="cp949")
    assert (tmp_path / "out/고양이/1.jpg").exists()
    with pytest.raises(UserError, match="--name-encoding 'nope'"):
        unpack(src, tmp_path / "out2", name_encoding="nope")


def test_links_inside_are_kept(tmp_path):
    src = make_tar(tmp_path / "l.tar", [("ds/a/1.jpg", b"one"), tar_entry("ds/a/2.jpg", tarfile.SYMTYPE, "1.jpg"),
                                        tar_entry("ds/b/3.jpg", tarfile.LNKTYPE, "ds/a/1.jpg"), ("ds/b/4.jpg", b"x")])
    unpack(src, tmp_path / "out")
    out = tmp_path / "out"
    assert os.readlink(out / "a/2.jpg") == "1.jpg" and (out / "a/2.jpg").read_bytes() == b"one"
    assert (out / "b/3.jpg").read_bytes() == b"one"


# ---------------------------------------------------------------------------------------------------
# The marker: unpack's own record that a folder came out of an archive (dlenv.model.modelsource reads it).

MARKER_CASES = {  # what the archive holds at the marker's name, besides a dataset
    "nothing there": ("zip", []),
    "a file of its own": ("zip", [(f"ds/{MARKER}", b"not unpacked, trust me")]),
    "a folder with files": ("zip", [(f"ds/{MARKER}/x.py", b"print(1)"), (f"ds/{MARKER}/y/", b"")]),
    "an empty folder": ("zip", [(f"ds/{MARKER}/", b"")]),
    "a symlink to a dataset file": ("tar", [tar_entry(f"ds/{MARKER}", tarfile.SYMTYPE, "train/cat/0.jpg")]),
    "a dangling symlink": ("tar", [tar_entry(f"ds/{MARKER}", tarfile.SYMTYPE, "nowhere")]),
    "a hard link to a dataset file": ("tar", [tar_entry(f"ds/{MARKER}", tarfile.LNKTYPE, "ds/train/cat/0.jpg")]),
    "not flattened: at the root": ("zip", [(MARKER, b"x"), ("other/1.jpg", b"y")]),
}


@pytest.mark.parametrize("case", list(MARKER_CASES))
@pytest.mark.parametrize("overwrite", [False, True], ids=["new-dest", "overwrite"])
def test_unpack_marks_its_folder_whatever_the_archive_holds_at_the_name(work, case, overwrite):
    fmt, extra = MARKER_CASES[case]
    members = dataset_members() + extra
    src = make_zip(work / "in" / "a.zip", members) if fmt == "zip" else make_tar(work / "in" / "a.tar", members)
    dest = work / "out" / ("ds" if overwrite else "new")
    unpack(src, dest, overwrite=overwrite)
    marker = dest / MARKER
    # unpack's own file: not the archive's file, folder or link, and no other name's inode
    assert marker.is_file() and not marker.is_symlink() and marker.stat().st_nlink == 1
    assert marker.read_text().startswith(f"written by dlenv unpack from {src.name!r}")
    assert not list(work.glob("out/.*unpack-*"))  # nothing left beside it
    top = "ds/" if case.startswith("not flattened") else ""
    assert (dest / top / "train/cat/0.jpg").read_bytes() == dict(members[:4])["ds/train/cat/0.jpg"]
    assert sorted(p.name for p in dest.iterdir()) == sorted([MARKER, "ds", "other"] if top else
                                                            [MARKER, "train", "val"])


# ---------------------------------------------------------------------------------------------------
# Hostile and broken archives: refused, nothing outside written, the destination untouched.


def _zip_cases(tmp: Path) -> list:
    abs_target = str(tmp / "abs_evil.txt")
    return [
        ("zip-dotdot", lambda p: make_zip(p, [("a/ok.jpg", b"1"), ("../evil.txt", b"x")]), r"outside .*\.\."),
        ("zip-dotdot-backslash", lambda p: make_zip(p, [("a\\..\\..\\evil.txt", b"x")]), r"outside"),
        ("zip-absolute", lambda p: make_zip(p, [(abs_target, b"x")]), "absolute path"),
        ("zip-drive", lambda p: make_zip(p, [("C:\\Windows\\evil.txt", b"x")]), "absolute path"),
        ("zip-link-out", lambda p: make_zip(p, [zip_link("a/l", "../../../etc"), ("a/1.jpg", b"1")]), "outside"),
        ("zip-link-absolute", lambda p: make_zip(p, [zip_link("a/l", "/etc")]), "absolute"),
        ("zip-write-through-link", lambda p: make_zip(p, [("real/1.jpg", b"1"), zip_link("sub", "real"),
                                                          ("sub/evil.jpg", b"x")]), "written through the link"),
    ]


def _tar_cases(tmp: Path) -> list:
    return [
        ("tar-dotdot", lambda p: make_tar(p, [("a/ok.jpg", b"1"), ("a/../../evil.txt", b"x")]), r"\.\."),
        ("tar-absolute", lambda p: make_tar(p, [(str(tmp / "abs_evil.txt"), b"x")]), "absolute path"),
        ("tar-symlink-out", lambda p: make_tar(p, [tar_entry("a/l", tarfile.SYMTYPE, "../../x")]), "outside"),
        ("tar-symlink-absolute", lambda p: make_tar(p, [tar_entry("l", tarfile.SYMTYPE, str(tmp))]), "absolute"),
        ("tar-hardlink-out", lambda p: make_tar(p, [tar_entry("h", tarfile.LNKTYPE, "../ds/keep.txt")]),
         r"\.\."),
        ("tar-hardlink-absolute", lambda p: make_tar(p, [tar_entry("h", tarfile.LNKTYPE, "/etc/passwd")]),
         "absolute"),
        ("tar-write-through-link", lambda p: make_tar(p, [tar_entry("real", tarfile.DIRTYPE),
                                                          tar_entry("sub", tarfile.SYMTYPE, "real"),
                                                          ("sub/evil.jpg", b"x")]), "written through"),
        ("tar-link-chain", lambda p: make_tar(p, [("f.jpg", b"1"), tar_entry("a", tarfile.SYMTYPE, "b/.."),
                                                  tar_entry("b", tarfile.SYMTYPE, ".")]), "through another link"),
        ("tar-link-under-link", lambda p: make_tar(p, [("e/1.jpg", b"1"), tar_entry("d/l", tarfile.SYMTYPE, "x"),
                                                       tar_entry("d", tarfile.SYMTYPE, "e")]), "through the link"),
        ("tar-fifo", lambda p: make_tar(p, [("a.jpg", b"1"), tar_entry("pipe", tarfile.FIFOTYPE)]), "FIFO"),
        ("tar-chardev", lambda p: make_tar(p, [tar_entry("null", tarfile.CHRTYPE)]), "device"),
        ("tar-blockdev", lambda p: make_tar(p, [tar_entry("sda", tarfile.BLKTYPE)]), "device"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_hostile_zip_refused(work, case):
    label, build, match = _zip_cases(work)[case]
    assert_refused(work, build(work / "in" / f"{label}.zip"), match)


@pytest.mark.parametrize("with_filter", [True, False], ids=["tarfile-filter", "own-checks"])
@pytest.mark.parametrize("case", range(12))
def test_hostile_tar_refused(work, case, with_filter, monkeypatch):
    if not with_filter:  # an older Python without tarfile.data_filter: our own checks must hold alone
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    label, build, match = _tar_cases(work)[case]
    assert_refused(work, build(work / "in" / f"{label}.tar"), match)


def test_zip_fifo_member_refused(work):
    info = zipfile.ZipInfo("pipe")
    info.create_system = 3
    info.external_attr = (stat.S_IFIFO | 0o644) << 16
    assert_refused(work, make_zip(work / "in" / "f.zip", [("a.jpg", b"1"), (info, b"")]), "FIFO")


@pytest.mark.parametrize("fmt", ["zip", "tar.gz", "7z"])
def test_bomb_refused(work, fmt, monkeypatch):
    monkeypatch.setattr(guard, "BOMB_MIN_BYTES", 100_000)
    zeros = bytes(400_000)
    src = work / "in" / f"bomb.{fmt}"
    if fmt == "zip":
        make_zip(src, [("a/1.jpg", b"1"), ("a/z.bin", zeros)])
    elif fmt == "tar.gz":
        make_tar(src, [("a/1.jpg", b"1"), ("a/z.bin", zeros)], "w:gz")
    else:
        py7zr = pytest.importorskip("py7zr")
        with py7zr.SevenZipFile(src, "w") as z:
            z.writestr(zeros, "a/z.bin")
    assert_refused(work, src, "decompression bomb")


def test_bomb_limit_can_be_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "BOMB_MIN_BYTES", 100_000)
    src = make_zip(tmp_path / "masks.zip", [("a/z.bin", bytes(400_000))])
    unpack(src, tmp_path / "out", max_ratio=1e6)
    assert (tmp_path / "out/z.bin").stat().st_size == 400_000


@pytest.mark.parametrize("fmt", ["zip", "tar"])
def test_not_enough_disk_refused(work, fmt, monkeypatch):
    monkeypatch.setattr(archive, "_free_bytes", lambda p: guard.DISK_MARGIN + 1000)
    members = [("a/1.jpg", os.urandom(3000))]
    src = work / "in" / f"big.{fmt}"
    make_zip(src, members) if fmt == "zip" else make_tar(src, members)
    assert_refused(work, src, "free")


def _valid_zip(p: Path) -> bytes:
    return make_zip(p, [("a/1.jpg", os.urandom(2000)), ("a/2.jpg", os.urandom(2000))],
                    zipfile.ZIP_STORED).read_bytes()


def _corrupt_zip_crc(p: Path) -> None:
    data = bytearray(_valid_zip(p))
    data[100] ^= 0xFF  # inside the first member's stored bytes
    p.write_bytes(bytes(data))


def _corrupt_tar_header(p: Path) -> None:
    data = bytearray(make_tar(p, [("a/1.jpg", b"1" * 600), ("a/2.jpg", b"2" * 10)]).read_bytes())
    data[512 * 3: 512 * 3 + 100] = b"\xff" * 100  # the second member's header
    p.write_bytes(bytes(data))


def _tar_cut_at_member_boundary(p: Path) -> None:
    data = make_tar(p, [("a/1.jpg", b"1" * 512), ("a/2.jpg", b"2" * 512)]).read_bytes()
    p.write_bytes(data[: 512 * 2])  # header + data of the first member, then nothing


BROKEN = {
    "zip-truncated": (lambda p: p.write_bytes(_valid_zip(p)[:3000]), "damaged or truncated"),
    "zip-crc": (_corrupt_zip_crc, "damaged or truncated"),
    "targz-truncated": (lambda p: p.write_bytes(
        make_tar(p, [("a/1.jpg", os.urandom(5000))], "w:gz").read_bytes()[:3000]), "damaged or truncated"),
    "tarxz-truncated": (lambda p: p.write_bytes(
        make_tar(p, [("a/1.jpg", os.urandom(5000))], "w:xz").read_bytes()[:3000]), "damaged or truncated"),
    "tar-truncated-data": (lambda p: p.write_bytes(
        make_tar(p, [("a/1.jpg", b"1" * 5000)]).read_bytes()[:2048]), "damaged or truncated"),
    "tar-truncated-boundary": (_tar_cut_at_member_boundary, "ends early"),
    "tar-bad-header": (_corrupt_tar_header, "damaged header"),
    "gz-not-tar": (lambda p: p.write_bytes(gzip.compress(b"just some text\n" * 100)), "holds no tar"),
    "not-an-archive": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(2000)), "not an archive"),
    "text-file": (lambda p: p.write_text("hello\n" * 200), "not an archive"),
    "zero-bytes": (lambda p: p.write_bytes(b""), "empty"),
    "empty-zip": (lambda p: make_zip(p, []), "no files"),
    "empty-tar": (lambda p: make_tar(p, []), "no files"),
    "only-folders": (lambda p: make_tar(p, [tar_entry("a", tarfile.DIRTYPE)]), "no files"),
    "only-junk": (lambda p: make_zip(p, [("__MACOSX/._a.jpg", b"1"), (".DS_Store", b"2")]), "only macOS"),
    "rar": (lambda p: p.write_bytes(b"Rar!\x1a\x07\x01\x00" + os.urandom(100)), "RAR"),
}


@pytest.mark.parametrize("label", sorted(BROKEN))
def test_broken_refused(work, label):
    build, match = BROKEN[label]
    src = work / "in" / f"{label}.zip"
    build(src)
    assert_refused(work, src, match)


def test_7z_truncated_refused(work):
    py7zr = pytest.importorskip("py7zr")
    src = work / "in" / "t.7z"
    with py7zr.SevenZipFile(src, "w") as z:
        z.writestr(os.urandom(20000), "a/1.jpg")
    src.write_bytes(src.read_bytes()[:10000])
    assert_refused(work, src, "damaged")


def test_missing_archive(tmp_path):
    with pytest.raises(UserError, match="not found"):
        unpack(tmp_path / "nope.zip", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# Nothing lost: existing destinations, --overwrite, interruptions.


def test_existing_destination_needs_overwrite(work):
    src = make_zip(work / "in" / "d.zip", [("x/1.jpg", b"new"), ("y/2.jpg", b"new")])
    before = snapshot(work)
    with pytest.raises(UserError, match="--overwrite"):
        unpack(src, work / "out" / "ds")
    assert snapshot(work) == before
    unpack(src, work / "out" / "ds", overwrite=True)
    assert unmarked(snapshot(work / "out"), "ds") == {"ds": "dir", "ds/x": "dir", "ds/y": "dir",
                                      "ds/x/1.jpg": hashlib.sha1(b"new").hexdigest(),
                                      "ds/y/2.jpg": hashlib.sha1(b"new").hexdigest()}


def test_empty_destination_is_used(tmp_path):
    (tmp_path / "out").mkdir()
    unpack(make_zip(tmp_path / "d.zip", [("x/1.jpg", b"1")]), tmp_path / "out")
    assert (tmp_path / "out/1.jpg").exists()


def test_archive_inside_destination_is_not_overwritten(work):
    src = make_zip(work / "out" / "ds" / "d.zip", [("x/1.jpg", b"1")])
    before = snapshot(work)
    with pytest.raises(UserError, match="inside"):
        unpack(src, work / "out" / "ds", overwrite=True)
    assert snapshot(work) == before


def test_refused_archive_leaves_no_new_parent_folders(tmp_path):
    src = make_tar(tmp_path / "bad.tar", [("../x", b"1")])
    with pytest.raises(UserError):
        unpack(src, tmp_path / "new" / "deeper" / "ds")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("fmt", ["zip", "tar.gz"])
def test_interrupted_extraction_leaves_destination(work, fmt, monkeypatch):
    members = [(f"a/{i}.jpg", os.urandom(100)) for i in range(5)]
    src = work / "in" / f"d.{fmt}"
    make_zip(src, members) if fmt == "zip" else make_tar(src, members, "w:gz")
    real, calls = guard._copy_stream, []

    def copy_then_ctrl_c(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(guard, "_copy_stream", copy_then_ctrl_c)
    before = snapshot(work)
    with pytest.raises(KeyboardInterrupt):
        unpack(src, work / "out" / "ds", overwrite=True)
    assert snapshot(work) == before
    # through the CLI it is exit code 130 and one line
    calls.clear()
    assert cli.run_command("unpack", {"archive": str(src), "dest": str(work / "out" / "ds"),
                                      "overwrite": True, "report": False}) == 130
    assert snapshot(work) == before


def test_cli_refusal_is_one_line_exit_2(work, capsys):
    src = make_tar(work / "in" / "evil.tar", [("../../evil", b"x")])
    code = cli.run_command("unpack", {"archive": str(src), "dest": str(work / "out" / "ds"), "overwrite": True})
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'../../evil'" in err


@pytest.mark.parametrize("name,dest,match", [
    ("..tar.gz", None, "'..tar.gz' gives no folder name to unpack into; pass --dest NAME"),  # was data/.
    ("...tar", None, "'...tar' gives no folder name"),                                       # was data/..
    ("....zip", None, "'....zip' gives no folder name"),
    ("ok.tar", ".", "destination . does not name a folder of its own; pass --dest NAME"),
    ("ok.tar", "..", "destination .. does not name a folder of its own"),
    ("ok.tar", "/", "destination / does not name a folder of its own"),
    ("ok.tar", "data/..", "destination data/.. does not name a folder of its own"),
    ("ok.tar", "data/x/..", "destination data/x/.. does not name a folder of its own"),
    ("ok.tar", "data", "destination data is the data folder itself"),
    ("ok.tar", "data/.", "destination data is the data folder itself"),
    ("ok.tar", "CWD", "is the working folder, which --overwrite would replace"),
    ("ok.tar", "CWD/..", "does not name a folder of its own"),
    ("ok.tar", "PARENT", "is an ancestor of the working folder"),
])
def test_destination_that_would_replace_the_data_or_working_folder_is_refused(tmp_path, monkeypatch, capsys,
                                                                              name, dest, match):
    """Such destinations once replaced the whole data/ folder (--overwrite) or ended in a traceback:
    refused in one line, exit 2, nothing on disk changed."""
    cwd = tmp_path / "work"
    make_image_tree = [("a/1.jpg", b"1"), ("b/2.jpg", b"2")]
    (cwd / "data" / "x").mkdir(parents=True)
    (cwd / "data" / "x" / "keep.txt").write_text("the user's data")
    src = make_zip(cwd / name, make_image_tree) if name.endswith(".zip") else make_tar(cwd / name, make_image_tree)
    monkeypatch.chdir(cwd)
    if dest is not None:
        dest = dest.replace("CWD", str(cwd)).replace("PARENT", str(tmp_path))
    before = snapshot(tmp_path)
    code = cli.run_command("unpack", {"archive": src.name, "dest": dest, "overwrite": True, "report": False})
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and match in err, err
    assert snapshot(tmp_path) == before


def test_leftovers_of_killed_runs_are_cleaned(tmp_path):
    parent = tmp_path / "data"
    (parent / ".ds.unpack-4242-tmp" / "a").mkdir(parents=True)          # a killed extraction
    (parent / ".other.unpack-77-tmp").mkdir()                            # another destination's
    (parent / ".moved.unpack-99-old").mkdir()                            # a killed --overwrite swap,
    (parent / ".moved.unpack-99-old" / "keep.txt").write_text("mine")    # before the new one arrived
    (parent / "done").mkdir()
    (parent / ".done.unpack-98-old").mkdir()                             # ... and after it arrived
    src = make_zip(tmp_path / "d.zip", [("x/1.jpg", b"1")])
    r = unpack(src, parent / "ds")
    assert len(r.cleaned) == 4
    assert sorted(os.listdir(parent)) == ["done", "ds", "moved"]
    assert (parent / "moved" / "keep.txt").read_text() == "mine"


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from dlenv.data import unpack as archive
    from dlenv.data.unpack import guard
    real = guard._copy_stream
    def slow(*args):
        real(*args)
        print("copying", flush=True)
        time.sleep(30)
    guard._copy_stream = slow
    archive.unpack({archive!r}, {dest!r}, overwrite=True, progress=False)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_process_leaves_destination(work, sig):
    src = make_zip(work / "in" / "d.zip", [(f"a/{i}.jpg", os.urandom(100)) for i in range(3)])
    dest = work / "out" / "ds"
    before = snapshot(work)
    code = _CHILD.format(src=str(SRC), archive=str(src), dest=str(dest))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "copying"
        child.send_signal(sig)
        child.wait(timeout=20)
    finally:
        child.kill()
    assert (dest / "keep.txt").read_text() == "the user's data"
    left = [n for n in os.listdir(dest.parent) if n != "ds"]
    if sig == signal.SIGTERM:  # cleaned up on the way out
        assert child.returncode == 128 + signal.SIGTERM and left == []
    else:  # nothing could run: the next unpack removes the temporary folder
        assert len(left) == 1 and left[0].endswith("-tmp")
        with pytest.raises(UserError, match="--overwrite"):
            unpack(src, dest)
    assert snapshot(work) == before


def test_main_prints_destination_and_report(tmp_path, capsys, monkeypatch):
    from imagedata import make_image_folder

    monkeypatch.chdir(tmp_path)
    make_image_folder(tmp_path / "src" / "shapes" / "train", per_class=3)
    make_image_folder(tmp_path / "src" / "shapes" / "val", per_class=2, seed=1)
    with tarfile.open(tmp_path / "shapes.tgz", "w:gz") as t:
        t.add(tmp_path / "src" / "shapes", arcname="shapes")
    cfg = config.build(config.UnpackConfig, archive="shapes.tgz")
    assert archive.main(cfg) == 0
    out = capsys.readouterr().out
    assert "into data/shapes/" in out and "cat" in out and "dog" in out
    assert (tmp_path / "data/shapes/train/cat").is_dir()
    # not a dataset layout: the files are unpacked, and the verdict is the exit code (test_unpack_verdict)
    make_zip(tmp_path / "notes.zip", [("notes/a.txt", b"1")])
    assert archive.main(config.build(config.UnpackConfig, archive="notes.zip")) == 2
    assert "not a dataset layout" in capsys.readouterr().err
    assert (tmp_path / "data/notes/a.txt").exists()


def test_no_temporary_folder_survives_success(tmp_path):
    src = make_tar(tmp_path / "d.tar", dataset_members())
    unpack(src, tmp_path / "data" / "d")
    assert os.listdir(tmp_path / "data") == ["d"]


def test_concurrent_unpacks_into_one_folder_take_turns(tmp_path, capsys):
    import fcntl
    import threading

    parent = tmp_path / "data"
    parent.mkdir()
    src = make_zip(tmp_path / "d.zip", [("x/1.jpg", b"1")])
    fd = os.open(parent, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another unpack is running
    done = threading.Event()
    t = threading.Thread(target=lambda: (unpack(src, parent / "d"), done.set()))
    t.start()
    out, deadline = "", time.monotonic() + 60  # a safety net: the line comes at once
    while "waiting for another dlenv unpack" not in out and time.monotonic() < deadline:  # the event, not a sleep
        out += capsys.readouterr().out
        time.sleep(0.05)
    assert "waiting for another dlenv unpack" in out, out
    assert not done.is_set() and not (parent / "d").exists()
    os.close(fd)  # it finished
    t.join(60)
    assert done.is_set() and (parent / "d" / "1.jpg").exists()
