"""Safe unpacking of dataset archives: `dlenv unpack ARCHIVE [--dest DIR] [--overwrite]`.

Archives come from strangers, so every member is checked before a byte of it is written:

- the format is read from the file's first bytes (zip, tar, tar.gz/.bz2/.xz, 7z), not its suffix;
- member names with `..` or an absolute path, links that point outside the destination or that a
  later member would be written through, device and FIFO members, a total beyond the free disk and
  a compression ratio that marks a bomb are refused with one line (tar links also pass through
  tarfile's own `data` extraction filter where this Python has it);
- truncated and corrupt archives (CRC, early EOF, a bad header) are refused the same way.

Everything is written into `.<dest>.unpack-<pid>-tmp` beside the destination and renamed into place
only when complete, so a refusal, a crash, Ctrl-C or `kill` leaves the destination as it was; the
next run removes what an interrupted one left behind. `--overwrite` swaps the old folder out only
after the new one is complete.

Real-world archives come out right: zip names stored in a Windows code page (GBK and others) are
decoded to their real characters, backslash separators become folders, macOS/Windows junk
(`__MACOSX/`, `._*`, `.DS_Store`, `Thumbs.db`, `desktop.ini`) is dropped, and a single top-level
folder is flattened into the destination.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import lzma
import os
import re
import shutil
import signal
import stat
import struct
import tarfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dlenv.errors import UserError

#: Bytes per read/write: large enough that Python's per-call overhead vanishes next to the copy.
CHUNK = 1 << 20
#: Below this many unpacked bytes no archive counts as a bomb, whatever its ratio.
BOMB_MIN_BYTES = 64 << 20
#: A single member may be this many times more compressed than `max_ratio` allows for the whole.
MEMBER_RATIO_FACTOR = 5
#: Free space kept spare on the destination's disk.
DISK_MARGIN = 64 << 20

_JUNK_FILES = {".ds_store", "thumbs.db", "desktop.ini"}
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.unpack-(?P<pid>\d+)-(?P<kind>tmp|old)$")
_SUFFIXES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tbz2", ".tbz", ".txz", ".tar", ".zip", ".7z")
_LEGACY_CODECS = ("gb18030", "cp932", "big5", "cp949")
_ZIP_UTF8_FLAG = 0x800
_ZIP_UNICODE_PATH = 0x7075


@dataclass
class UnpackResult:
    """What `unpack` did: where the data is and what it dropped or decoded."""

    dest: Path
    format: str
    files: int = 0
    bytes: int = 0
    junk: int = 0
    links: int = 0
    name_encoding: str | None = None  # the code page zip names were decoded from, when not UTF-8
    flattened: str | None = None      # the single top-level folder that was flattened
    cleaned: list[str] = field(default_factory=list)  # leftovers of interrupted runs removed first


# ---------------------------------------------------------------------------------------------------
# Format and names.


def detect_format(path: Path) -> str:
    """The archive format from the file's content: zip, 7z, tar, tar.gz, tar.bz2 or tar.xz.

    Raises UserError for an empty file, a format we do not unpack, or a file that is no archive.
    """
    with open(path, "rb") as fh:
        head = fh.read(512)
    if not head:
        raise UserError(f"{path} is empty (0 bytes); download it again")
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08"):
        return "zip"
    if head[:6] == b"7z\xbc\xaf\x27\x1c":
        return "7z"
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:3] == b"BZh":
        return "tar.bz2"
    if head[:6] == b"\xfd7zXZ\x00":
        return "tar.xz"
    if head[257:262] == b"ustar" or _is_v7_tar(head) or (len(head) == 512 and not any(head)):  # zeros: empty tar
        return "tar"
    if head[:7] in (b"Rar!\x1a\x07\x00", b"Rar!\x1a\x07\x01"):
        raise UserError(f"{path} is a RAR archive, which dlenv does not unpack; unpack it with unrar, or "
                        "re-pack it as .zip or .tar.gz")
    if head[:4] == b"\x28\xb5\x2f\xfd":
        raise UserError(f"{path} is zstd-compressed; run `zstd -d {path}` and unpack the .tar it gives")
    if zipfile.is_zipfile(path):  # a self-extracting zip: code first, the zip at the end
        return "zip"
    raise UserError(f"{path} is not an archive dlenv can unpack (its content is no zip, tar, tar.gz, "
                    "tar.bz2, tar.xz or 7z); check the file or download it again")


def _is_v7_tar(head: bytes) -> bool:
    """An old (pre-POSIX) tar header: a valid header checksum is the only mark it has."""
    if len(head) < 512:
        return False
    try:
        stored = int(head[148:156].replace(b"\x00", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(head[:148]) + 8 * 32 + sum(head[156:512])


def archive_stem(path: Path) -> str:
    """'pets.tar.gz' -> 'pets'; the default destination is data/<stem>/."""
    name = path.name
    for suffix in _SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return path.stem or name


def clean_name(raw: str, where: str, backslashes: bool) -> str | None:
    """A member's name as a safe relative path ('a/b.jpg'), '' for the root entry, None for junk.

    `backslashes` turns Windows separators into folders (zip and 7z). Raises UserError for an
    absolute name, a `..` component or a NUL byte.
    """
    name = raw.replace("\\", "/") if backslashes else raw
    if "\x00" in name:
        raise UserError(f"{where}: member {raw!r} has a NUL byte in its name; refusing to unpack")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise UserError(f"{where}: member {raw!r} is an absolute path; refusing to unpack anything")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UserError(f"{where}: member {raw!r} points outside the destination (..); refusing to "
                        "unpack anything")
    if not parts:
        return ""
    last = parts[-1]
    if "__MACOSX" in parts or last.startswith("._") or last.lower() in _JUNK_FILES:
        return None
    return "/".join(parts)


def _zip_unicode_extra(info: zipfile.ZipInfo, raw: bytes) -> str | None:
    """The UTF-8 name in an Info-ZIP Unicode Path extra field (7-Zip, WinRAR write it), if it matches."""
    extra, i = info.extra, 0
    while i + 4 <= len(extra):
        kind, size = struct.unpack_from("<HH", extra, i)
        body = extra[i + 4: i + 4 + size]
        # version 1, then the CRC of the stored name: a stale field (name changed later) is ignored
        if (kind == _ZIP_UNICODE_PATH and len(body) > 5 and body[0] == 1
                and struct.unpack_from("<I", body, 1)[0] == zlib.crc32(raw)):
            try:
                return body[5:].decode("utf-8")
            except UnicodeDecodeError:
                return None
        i += 4 + size
    return None


def _plausible(codec: str, ch: str) -> bool:
    """Whether a non-ASCII character is a common one in the language of `codec`.

    Bytes in one East Asian code page usually decode in the others too, but into rare characters;
    counting the common ones tells them apart (GBK is preferred on a tie: our users are mostly Chinese).
    """
    o = ord(ch)
    try:
        if codec == "gb18030":
            ch.encode("gb2312")  # GB2312 holds the common simplified characters and punctuation
            return True
        if codec == "cp932":  # kana, or a JIS level-1 kanji
            return 0x3040 <= o <= 0x30FF or (0x4E00 <= o <= 0x9FFF and 0x88 <= ch.encode("cp932")[0] <= 0x9F)
        if codec == "big5":  # the frequent-character block of Big5
            return 0x4E00 <= o <= 0x9FFF and 0xA4 <= ch.encode("big5")[0] <= 0xC6
        if codec == "cp949":
            return 0xAC00 <= o <= 0xD7A3
    except UnicodeEncodeError:
        return False
    return False


def guess_name_codec(raw_names: list[bytes]) -> str:
    """The code page of zip names stored without the UTF-8 flag: utf-8, a legacy East Asian one, or cp437."""
    names = [r for r in raw_names if not r.isascii()]
    if not names:
        return "utf-8"
    best, best_key = "cp437", (0, -1.0)
    for codec in ("utf-8", *_LEGACY_CODECS):
        decoded = []
        for r in names:
            with contextlib.suppress(UnicodeDecodeError):
                decoded.append(r.decode(codec))
        if codec == "utf-8":
            if len(decoded) == len(names):
                return "utf-8"  # random bytes are almost never valid UTF-8
            continue
        chars = [c for d in decoded for c in d if ord(c) > 127]
        score = sum(_plausible(codec, c) for c in chars) / max(len(chars), 1)
        key = (len(decoded), score)
        if key > best_key:
            best, best_key = codec, key
    return best


def _zip_names(infos: list[zipfile.ZipInfo], encoding: str, where: str) -> tuple[list[str], str | None]:
    """Each member's real name, and the code page used for the unflagged ones (None: all UTF-8/ASCII)."""
    raws: list[bytes | None] = []
    for info in infos:
        if info.flag_bits & _ZIP_UTF8_FLAG:
            raws.append(None)
        else:
            # zipfile decoded the stored bytes as cp437, which maps every byte: encoding gives them back
            raws.append(info.orig_filename.encode("cp437"))
    if encoding == "auto":
        codec = guess_name_codec([r for r, i in zip(raws, infos, strict=True) if r is not None
                                  and _zip_unicode_extra(i, r) is None])
    else:
        codec = encoding
    names, used = [], None
    for info, raw in zip(infos, raws, strict=True):
        if raw is None:
            names.append(info.filename)
            continue
        unicode_name = _zip_unicode_extra(info, raw)
        if unicode_name is not None:
            names.append(unicode_name)
            continue
        try:
            names.append(raw.decode(codec))
        except UnicodeDecodeError:
            if encoding != "auto":
                raise UserError(f"{where}: member name {raw!r} is not valid {encoding}; try "
                                "--name-encoding auto or another code page") from None
            names.append(raw.decode("cp437"))
        if not raw.isascii():
            used = codec
    return names, used


# ---------------------------------------------------------------------------------------------------
# Limits and progress.


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class _Budget:
    """Counts declared and written bytes against the free disk and the bomb limit; drives the bar."""

    def __init__(self, where: str, archive_size: int, free: int, max_ratio: float, parent: Path,
                 bar: Any, raw: BinaryIO | None):
        self.where, self.archive_size, self.free, self.max_ratio = where, archive_size, free, max_ratio
        self.parent = parent
        self.disk_cap = max(free - DISK_MARGIN, 0)
        self.bomb_cap = max(BOMB_MIN_BYTES, int(max_ratio * archive_size))
        self.declared = 0
        self.written = 0
        self.bar = bar
        self.raw = raw  # tar: progress follows the compressed bytes read, whose total is known
        self._raw_seen = 0

    def _check(self, total: int) -> None:
        if total > self.disk_cap:
            raise UserError(f"{self.where} unpacks to at least {_size(total)} but only {_size(self.free)} are "
                            f"free on {self.parent} (keeping {_size(DISK_MARGIN)} spare); free some space "
                            "or unpack to another disk with --dest")
        if total > self.bomb_cap:
            raise UserError(f"{self.where} unpacks to more than {_size(total)}, over {self.max_ratio:g}x its "
                            f"own {_size(self.archive_size)}: this looks like a decompression bomb; refusing. "
                            "If the data is genuine, raise --max-ratio")

    def start(self, total: int) -> None:
        """Formats that list their sizes up front (zip, 7z): the bar counts unpacked bytes."""
        self.bar.reset(total=total)

    def declare(self, name: str, size: int, packed: int | None = None) -> None:
        """Account for a member before it is written; raises UserError when a limit would be crossed."""
        self.declared += size
        self._check(self.declared)
        if packed is not None and size > BOMB_MIN_BYTES and size > MEMBER_RATIO_FACTOR * self.max_ratio * max(
                packed, 1):
            raise UserError(f"{self.where}: member {name!r} unpacks to {_size(size)} from {_size(packed)} "
                            f"(ratio {size / max(packed, 1):.0f}): this looks like a decompression bomb; "
                            "refusing. If the data is genuine, raise --max-ratio")

    def tick(self, n: int) -> None:
        """Count `n` written bytes (the archive may lie about sizes) and move the progress bar."""
        self.written += n
        if self.written > self.declared:
            self._check(self.written)
        if self.raw is not None:
            pos = self.raw.tell()
            self.bar.update(pos - self._raw_seen)
            self._raw_seen = pos
        else:
            self.bar.update(n)


def _copy_stream(src: BinaryIO, dst: BinaryIO, tick: Callable[[int], None]) -> None:
    """Copy src to dst in CHUNK-sized reads, reporting each chunk to `tick` (which may refuse)."""
    read, write = src.read, dst.write
    while True:
        buf = read(CHUNK)
        if not buf:
            return
        write(buf)
        tick(len(buf))


# ---------------------------------------------------------------------------------------------------
# Writing members into the temporary folder.


class _Writer:
    """Writes checked members under `root`; no write ever goes through or over a link.

    Symbolic links are created last, after every target has been checked against every other link,
    so no member can be written through one and no chain of links can lead outside.
    """

    def __init__(self, root: Path, where: str, budget: _Budget):
        self.root, self.where, self.budget = str(root), where, budget
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        self.links: dict[str, str] = {}
        self.junk = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _guard(self, name: str) -> None:
        if not self.links:
            return
        if name in self.links:
            raise UserError(f"{self.where}: member {name!r} would replace the link of the same name; refusing "
                            "to unpack")
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in self.links:
                raise UserError(f"{self.where}: member {name!r} would be written through the link "
                                f"{prefix!r} -> {self.links[prefix]!r}; refusing to unpack")

    def _parents(self, name: str) -> None:
        d = name.rpartition("/")[0]
        if d and d not in self.dirs:
            if d in self.files:
                raise UserError(f"{self.where}: member {name!r} needs a folder {d!r}, but the archive has a file "
                                "of that name; the archive is inconsistent")
            os.makedirs(self._path(d), exist_ok=True)
            while d and d not in self.dirs:
                self.dirs.add(d)
                d = d.rpartition("/")[0]

    def directory(self, name: str) -> None:
        self._guard(name)
        if name in self.files:
            raise UserError(f"{self.where}: member {name!r} is both a file and a folder; the archive is "
                            "inconsistent")
        self._parents(name + "/x")

    def _new_file(self, name: str) -> str:
        """The path for file `name`, its folders made and an earlier member of that name removed."""
        self._guard(name)
        if name in self.dirs:
            raise UserError(f"{self.where}: member {name!r} is both a folder and a file; the archive is "
                            "inconsistent")
        self._parents(name)
        path = self._path(name)
        if name in self.files:
            os.unlink(path)  # a later member of the same name wins; never write into a hard-linked inode
        self.files.add(name)
        return path

    def open_file(self, name: str) -> BinaryIO:
        """Open file `name` for writing."""
        return open(self._new_file(name), "wb")

    def file(self, name: str, src: BinaryIO, mtime: float | None) -> None:
        with self.open_file(name) as out:
            _copy_stream(src, out, self.budget.tick)
        self.set_mtime(name, mtime)

    def set_mtime(self, name: str, mtime: float | None) -> None:
        if mtime is not None:
            with contextlib.suppress(OSError, OverflowError, ValueError):
                os.utime(self._path(name), (mtime, mtime))

    def hardlink(self, name: str, target: str | None) -> None:
        if not target or target not in self.files:
            raise UserError(f"{self.where}: hard link {name!r} points to {target!r}, which is not an earlier "
                            "file of the archive; refusing to unpack")
        path = self._new_file(name)
        try:
            os.link(self._path(target), path)
        except OSError:  # a filesystem without hard links: a copy reads the same
            shutil.copyfile(self._path(target), path)

    def symlink(self, name: str, target: str) -> None:
        self._guard(name)
        if name in self.files or name in self.dirs:
            raise UserError(f"{self.where}: link {name!r} has the name of another member; refusing to unpack")
        self._walk(name, target)  # refuse an absolute or escaping target now; chains are checked at the end
        self.links[name] = target

    def _walk(self, name: str, target: str) -> int:
        """Follow a link's target lexically; returns the shallowest folder depth it passes (0 = the root)."""
        if not target or target.startswith("/") or re.match(r"^[A-Za-z]:", target):
            raise UserError(f"{self.where}: link {name!r} points to the absolute path {target!r}; refusing "
                            "to unpack anything")
        parts = name.split("/")[:-1]
        low = len(parts)
        comps = target.split("/")
        for i, comp in enumerate(comps):
            if comp in ("", "."):
                continue
            if comp == "..":
                if not parts:
                    raise UserError(f"{self.where}: link {name!r} -> {target!r} points outside the "
                                    "destination; refusing to unpack anything")
                parts.pop()
                low = min(low, len(parts))
                continue
            parts.append(comp)
            if i < len(comps) - 1 and "/".join(parts) in self.links:
                raise UserError(f"{self.where}: link {name!r} -> {target!r} goes through another link "
                                f"({'/'.join(parts)!r}); refusing to unpack")
        return low

    def finish(self) -> bool:
        """Create the symbolic links; returns whether a link reaches the archive's root level."""
        reaches_root = False
        for name, target in self.links.items():
            reaches_root |= self._walk(name, target) == 0
            if name in self.dirs:  # every folder that holds a member is in dirs
                raise UserError(f"{self.where}: link {name!r} has the name of a folder in the archive; "
                                "refusing to unpack")
            parents = name.split("/")[:-1]
            for i in range(1, len(parents) + 1):
                if "/".join(parents[:i]) in self.links:
                    raise UserError(f"{self.where}: link {name!r} would be created through the link "
                                    f"{'/'.join(parents[:i])!r}; refusing to unpack")
            self._parents(name)
            os.symlink(target, self._path(name))
        return reaches_root


# ---------------------------------------------------------------------------------------------------
# The formats.


def _zip_mtime(info: zipfile.ZipInfo) -> float | None:
    try:
        return time.mktime((*info.date_time, 0, 0, -1))
    except (OverflowError, ValueError):
        return None


def _unpack_zip(raw: BinaryIO, w: _Writer, encoding: str) -> str | None:
    try:
        zf = zipfile.ZipFile(raw)
    except zipfile.BadZipFile as e:
        raise UserError(f"{w.where} is a damaged or truncated zip ({e}); download it again") from None
    with zf:
        infos = zf.infolist()
        names, used = _zip_names(infos, encoding, w.where)
        plan = []
        for info, raw_name in zip(infos, names, strict=True):
            name = clean_name(raw_name, w.where, backslashes=True)
            if name is None:
                w.junk += 1
                continue
            if not name:
                continue
            mode = info.external_attr >> 16 if info.create_system == 3 else 0
            if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                raise UserError(f"{w.where}: member {raw_name!r} is a device, FIFO or socket; refusing to unpack")
            if info.flag_bits & 0x1:
                raise UserError(f"{w.where}: member {raw_name!r} is encrypted; dlenv does not unpack "
                                "password-protected archives: unpack it yourself and pass the folder")
            is_dir = raw_name.endswith(("/", "\\")) or stat.S_ISDIR(mode)
            if not is_dir:
                w.budget.declare(name, info.file_size, info.compress_size)
            plan.append((info, name, "link" if stat.S_ISLNK(mode) else "dir" if is_dir else "file"))
        w.budget.start(w.budget.declared)
        for info, name, kind in plan:
            if kind == "dir":
                w.directory(name)
            elif kind == "link":
                with zf.open(info) as fh:
                    target = fh.read(4097).decode("utf-8", "surrogateescape").replace("\\", "/")
                w.symlink(name, target)
            else:
                with zf.open(info) as src:
                    w.file(name, src, _zip_mtime(info))
    return used


def _tar_filter(member: tarfile.TarInfo, root: str, where: str) -> None:
    """tarfile's own `data` filter (Python 3.10.12+) as a second opinion on a link member."""
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is None:  # older Pythons: clean_name and _Writer already enforce the same rules
        return
    try:
        data_filter(member, root)
    except tarfile.FilterError as e:
        raise UserError(f"{where}: member {member.name!r} refused by tarfile's data filter ({e}); refusing to "
                        "unpack anything") from None


class _HeaderRecorder:
    """The stream tarfile reads, keeping the last 512-byte block it asked for.

    tarfile ends its member loop quietly at a missing or damaged header; that last block tells a sound
    end (zeros) from a truncated or corrupt archive without seeking back in a compressed stream.
    """

    def __init__(self, fileobj: BinaryIO):
        self.fileobj = fileobj
        self.last = b""

    def read(self, size: int = -1) -> bytes:
        data = self.fileobj.read(size)
        if size == tarfile.BLOCKSIZE:
            self.last = data
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.fileobj.seek(offset, whence)

    def tell(self) -> int:
        return self.fileobj.tell()


def _decompressed(raw: BinaryIO, fmt: str) -> BinaryIO:
    if fmt == "tar.gz":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if fmt == "tar.bz2":
        import bz2

        return bz2.BZ2File(raw, mode="rb")
    if fmt == "tar.xz":
        return lzma.LZMAFile(raw, mode="rb")
    return raw


def _unpack_tar(raw: BinaryIO, fmt: str, w: _Writer) -> None:
    stream = _HeaderRecorder(_decompressed(raw, fmt))
    try:
        tf = tarfile.open(fileobj=stream, mode="r:")  # noqa: SIM115 (closed by the `with tf` below)
    except tarfile.ReadError as e:
        what = "is compressed but holds no tar archive, or is damaged" if "." in fmt else "is a damaged tar"
        raise UserError(f"{w.where} {what} ({e}); check the file or download it again") from None
    with tf:
        for m in tf:
            name = clean_name(m.name, w.where, backslashes=False)
            if name is None:
                w.junk += 1
                continue
            if m.ischr() or m.isblk() or m.isfifo():
                raise UserError(f"{w.where}: member {m.name!r} is a device or FIFO; refusing to unpack anything")
            if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                raise UserError(f"{w.where}: member {m.name!r} has an unsupported type ({m.type!r}); refusing "
                                "to unpack")
            if not name:
                continue
            # our checks first (their messages say what to do), then tarfile's filter as a second opinion
            # on links. Files and folders skip it: once clean_name passed them and with links created
            # last, its realpath walk (15% of the time on small files) cannot find anything more.
            target = clean_name(m.linkname, w.where, backslashes=False) if m.islnk() else None
            if m.issym() or m.islnk():
                _tar_filter(m, w.root, w.where)
            if m.isdir():
                w.directory(name)
            elif m.issym():
                w.symlink(name, m.linkname)
            elif m.islnk():
                w.hardlink(name, target)
            else:
                w.budget.declare(name, m.size)
                w.file(name, tf.extractfile(m), m.mtime)
    if len(stream.last) < tarfile.BLOCKSIZE:
        raise UserError(f"{w.where} ends early (truncated: no end-of-archive block); download it again")
    if stream.last.count(0) != tarfile.BLOCKSIZE:
        raise UserError(f"{w.where} has a damaged header at byte {tf.offset}; download it again")


class _SevenZipSink:
    """Receives one 7z member's bytes from py7zr (duck-types py7zr.io.Py7zIO)."""

    def __init__(self, w: _Writer, name: str | None, kind: str):
        self.w, self.name, self.kind = w, name, kind
        self.fh: BinaryIO | None = w.open_file(name) if name and kind == "file" else None
        self.link = bytearray()
        self.n = 0

    def write(self, data: bytes) -> int:
        if self.fh is not None:
            self.fh.write(data)
            self.w.budget.tick(len(data))
        elif self.kind == "link" and len(self.link) < 4097:
            self.link += data
        self.n += len(data)
        return len(data)

    def read(self, size: int | None = None) -> bytes:
        return b""

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def flush(self) -> None:
        pass

    def size(self) -> int:
        return self.n

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        elif self.kind == "link" and self.name:
            self.w.symlink(self.name, bytes(self.link).decode("utf-8", "surrogateescape").replace("\\", "/"))
            self.kind = "done"


def _unpack_7z(raw: BinaryIO, w: _Writer) -> None:
    import py7zr
    import py7zr.exceptions

    if not hasattr(py7zr.io, "WriterFactory"):
        raise UserError(f"py7zr {py7zr.__version__} is too old to unpack {w.where} safely; .7z needs py7zr>=1.0")
    # py7zr's header parser meets garbage with whatever error the garbage leads to
    header_errors = (py7zr.exceptions.ArchiveError, EOFError, lzma.LZMAError, ValueError, KeyError, IndexError,
                     struct.error)
    try:
        z = py7zr.SevenZipFile(raw, mode="r")
    except header_errors as e:
        raise UserError(f"{w.where} is a damaged or truncated 7z archive ({e}); download it again") from None
    with z:
        if z.needs_password():
            raise UserError(f"{w.where} is encrypted; dlenv does not unpack password-protected archives: "
                            "unpack it yourself and pass the folder")
        kinds: dict[str, tuple[str | None, str]] = {}
        seen: set[str] = set()
        root = Path(w.root)
        for f in z.files:
            name = clean_name(f.filename, w.where, backslashes=True)
            mode = f.file_properties().get("posix_mode") or 0
            if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)) or f.is_socket:
                raise UserError(f"{w.where}: member {f.filename!r} is a device, FIFO or socket; refusing to unpack")
            if name in seen:
                raise UserError(f"{w.where} holds {name!r} twice; refusing to guess which one is meant")
            if name:
                seen.add(name)
            kind = "dir" if f.is_directory else "link" if (f.is_symlink or f.is_junction) else "file"
            if name is None:
                w.junk += 1
            elif name and kind == "dir":
                w.directory(name)
            elif name and kind == "file":
                size = f.uncompressed if isinstance(f.uncompressed, int) else sum(f.uncompressed)
                w.budget.declare(name, size, f.compressed)
            # py7zr hands the factory the member's path under `root`: map it back to our checked name
            kinds[os.path.normpath(os.path.join(root, f.filename.lstrip("/")))] = (name, kind)
        w.budget.start(w.budget.declared)

        class Factory(py7zr.io.WriterFactory):
            current: _SevenZipSink | None = None

            def create(self, filename: str) -> _SevenZipSink:
                if self.current is not None:
                    self.current.close()
                key = os.path.normpath(filename)
                if key not in kinds:
                    raise UserError(f"{w.where}: py7zr reported a member {filename!r} that its listing lacks; "
                                    "refusing to unpack")
                name, kind = kinds[key]
                self.current = _SevenZipSink(w, name, kind)
                return self.current

        factory = Factory()
        try:
            z.extractall(path=root, factory=factory)
        except (py7zr.exceptions.ArchiveError, EOFError, lzma.LZMAError, zlib.error) as e:
            raise UserError(f"{w.where} is damaged ({type(e).__name__}: {e}); download it again") from None
        finally:
            if factory.current is not None:
                factory.current.close()
    for name, kind in kinds.values():  # py7zr skips no member, but be sure empty files exist
        if name and kind == "file" and name not in w.files:
            w.open_file(name).close()


# ---------------------------------------------------------------------------------------------------
# Temporary folders, locking, swapping into place.


@contextlib.contextmanager
def _parent_lock(parent: Path) -> Iterator[None]:
    """Hold an exclusive lock on the destination's parent folder, so concurrent unpacks take turns and
    anything named `.X.unpack-*` found while holding it is a leftover of a dead run."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another dlenv unpack into {parent} to finish ...", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # a filesystem without locks: unpack anyway
        yield
    finally:
        os.close(fd)


def clean_leftovers(parent: Path) -> list[str]:
    """Remove what interrupted unpacks left in `parent`; returns one line per thing done.

    A `-tmp` folder is an unfinished extraction: deleted. An `-old` folder is a destination that an
    interrupted --overwrite moved aside: put back if the destination is missing, else deleted.
    Call only while holding the parent lock.
    """
    done = []
    for entry in sorted(parent.iterdir()):
        m = _LEFTOVER.match(entry.name)
        if not m or not entry.is_dir() or entry.is_symlink():
            continue
        target = parent / m["name"]
        if m["kind"] == "old" and not os.path.lexists(target):
            os.rename(entry, target)
            done.append(f"restored {target} from an interrupted --overwrite")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry.name}, left by an interrupted unpack (pid {m['pid']})")
    return done


def _check_dest(dest: Path, overwrite: bool, archive: Path) -> None:
    if dest.is_symlink():
        raise UserError(f"destination {dest} is a symbolic link; pass the folder it points to as --dest")
    if dest.exists():
        if not dest.is_dir():
            raise UserError(f"destination {dest} exists and is not a folder; choose another --dest")
        if any(dest.iterdir()):
            if not overwrite:
                raise UserError(f"destination {dest} already exists and is not empty; pass --overwrite to "
                                "replace it (only after the new extraction succeeded) or choose another --dest")
            if archive.resolve().is_relative_to(dest.resolve()):
                raise UserError(f"the archive {archive} lies inside {dest}, which --overwrite would delete; "
                                "move the archive out first")


def _swap_into_place(new: Path, tmp: Path, dest: Path) -> None:
    """Rename `new` (tmp itself or its single top folder) to `dest`; an old dest is moved aside first
    and deleted last. Ctrl-C and SIGTERM wait for the renames (they take microseconds)."""
    old = dest.parent / f".{dest.name}.unpack-{os.getpid()}-old"
    in_main = threading.current_thread() is threading.main_thread()
    blocked = {signal.SIGINT, signal.SIGTERM}
    if in_main:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        moved = False
        if dest.exists():
            if any(dest.iterdir()):
                os.rename(dest, old)
                moved = True
            else:
                dest.rmdir()
        try:
            os.rename(new, dest)
        except BaseException:
            if moved:
                os.rename(old, dest)
            raise
        if new != tmp:
            tmp.rmdir()
    finally:
        if in_main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up below instead of dying mid-write


# ---------------------------------------------------------------------------------------------------
# The command.


def unpack(archive: str | Path, dest: str | Path | None = None, overwrite: bool = False,
           name_encoding: str = "auto", max_ratio: float = 100.0, progress: bool = True) -> UnpackResult:
    """Unpack `archive` into `dest` (default data/<archive stem>/) safely and atomically.

    Returns an UnpackResult. Raises UserError for a missing, hostile, damaged or empty archive, a
    destination that is in the way, or too little disk; the destination is then exactly as before.
    """
    from tqdm import tqdm

    src = Path(archive)
    if not src.is_file():
        raise UserError(f"archive {src} not found" + ("" if not src.exists() else " (it is not a file)"))
    if name_encoding != "auto":
        import codecs

        try:
            codecs.lookup(name_encoding)
        except LookupError:
            raise UserError(f"--name-encoding {name_encoding!r} is not a codec Python knows; try gbk, cp932, "
                            "big5, cp949 or auto") from None
    fmt = detect_format(src)
    dest = Path(dest) if dest else Path("data") / archive_stem(src)
    if dest.resolve() == src.resolve():
        raise UserError(f"destination {dest} is the archive itself; choose another --dest")
    parent = dest.absolute().parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    result = UnpackResult(dest=dest, format=fmt)
    try:
        with _parent_lock(parent):
            result.cleaned = clean_leftovers(parent)
            for line in result.cleaned:
                print(line)
            _check_dest(dest, overwrite, src)
            _extract_and_swap(src, fmt, dest, parent, result, name_encoding, max_ratio, progress, tqdm)
    except BaseException:
        for p in made:  # parents created for a destination that never came to be
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return result


def _extract_and_swap(src: Path, fmt: str, dest: Path, parent: Path, result: UnpackResult, name_encoding: str,
                      max_ratio: float, progress: bool, tqdm: Any) -> None:
    tmp = parent / f".{dest.name}.unpack-{os.getpid()}-tmp"
    where = str(src)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    if previous is None:  # a handler installed outside Python: restore the default
        previous = signal.SIG_DFL
    tmp.mkdir()
    try:
        size = src.stat().st_size
        with open(src, "rb") as raw, tqdm(total=None if fmt == "zip" or fmt == "7z" else size, unit="B",
                                           unit_scale=True, unit_divisor=1024, desc=src.name, mininterval=0.5,
                                           delay=1.0, leave=False,
                                           disable=None if progress else True) as bar:  # None: not in logs
            budget = _Budget(where, size, _free_bytes(parent), max_ratio, parent, bar,
                             raw if fmt.startswith("tar") else None)
            w = _Writer(tmp, where, budget)
            try:
                if fmt == "zip":
                    result.name_encoding = _unpack_zip(raw, w, name_encoding)
                elif fmt == "7z":
                    _unpack_7z(raw, w)
                else:
                    _unpack_tar(raw, fmt, w)
                reaches_root = w.finish()
            except UserError:
                raise
            except OSError as e:
                raise _os_error(e, where, parent) from None
            except (tarfile.TarError, zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError) as e:
                raise UserError(f"{where} is damaged or truncated ({type(e).__name__}: {e}); download it "
                                "again") from None
            except NotImplementedError as e:
                raise UserError(f"{where} uses a compression method Python cannot read ({e}; Windows' "
                                "Deflate64 for big zips is one); re-pack it with 7-Zip or zip") from None
            except RuntimeError as e:
                if "encrypted" not in str(e) and "password" not in str(e):
                    raise
                raise UserError(f"{where} is encrypted; dlenv does not unpack password-protected archives: "
                                "unpack it yourself and pass the folder") from None
        if not w.files:
            what = "only macOS/Windows junk files" if w.junk else "no files"
            raise UserError(f"{where} holds {what}; nothing to unpack")
        result.files, result.bytes, result.junk, result.links = len(w.files), budget.written, w.junk, len(w.links)
        top = os.listdir(tmp)
        new = tmp
        if len(top) == 1 and top[0] in w.dirs and not reaches_root:
            new = tmp / top[0]
            result.flattened = top[0]
        _swap_into_place(new, tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _os_error(e: OSError, where: str, parent: Path) -> UserError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"the disk holding {parent} filled up while unpacking {where}; free some space or "
                         "unpack to another disk with --dest")
    if e.errno is None:  # decompressors (bz2, gzip) raise OSError without an errno for bad data
        return UserError(f"{where} is damaged or truncated ({e}); download it again")
    return UserError(f"cannot write while unpacking {where}: {e.strerror} ({e.filename}); check the "
                     "destination's permissions and disk")


def main(cfg: Any) -> int:
    """`dlenv unpack ARCHIVE [--dest DIR] [--overwrite]`: unpack, then print where and the dataset report."""
    if not cfg.archive:
        raise UserError("unpack needs an archive: dlenv unpack ARCHIVE [--dest DIR]")
    r = unpack(cfg.archive, cfg.dest, overwrite=cfg.overwrite, name_encoding=cfg.name_encoding,
               max_ratio=cfg.max_ratio)
    print(f"unpacked {r.files} files ({_size(r.bytes)}) from {cfg.archive} into {r.dest}/")
    if r.flattened:
        print(f"  its single top-level folder {r.flattened}/ was flattened into {r.dest}/")
    if r.junk:
        print(f"  dropped {r.junk} macOS/Windows junk entries (__MACOSX, ._*, .DS_Store, Thumbs.db, desktop.ini)")
    if r.name_encoding and r.name_encoding != "utf-8":
        print(f"  file names decoded from {r.name_encoding} (the zip does not mark them as UTF-8); if they "
              "look wrong, try --name-encoding")
    if cfg.report:
        _print_report(r.dest)
    return 0


def _print_report(root: Path) -> None:
    from dlenv.data import folder

    try:
        report = folder.dataset_report(root)
    except UserError as e:
        print(f"not a dataset layout dlenv can train on yet: {e}")
        return
    print()
    print(folder.format_report(report))
