"""The member readers of the formats in dlenv.archives.FORMATS: zip, tar (plain, gz, bz2, xz) and 7z, each read
member by member into the guard's writer (dlenv.data.unpack.guard), with each format's own damage turned into one
line. A reader is `unpack_X(raw, w, fmt, name_encoding)`, named by its row, and returns the code page it decoded
member names from (zip), else None."""

from __future__ import annotations

import importlib
import lzma
import os
import stat
import struct
import tarfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from dlenv.archives import ArchiveFormat
from dlenv.data.unpack.guard import Writer
from dlenv.data.unpack.names import _zip_names, clean_name
from dlenv.errors import UserError


def _zip_mtime(info: zipfile.ZipInfo) -> float | None:
    try:
        return time.mktime((*info.date_time, 0, 0, -1))
    except (OverflowError, ValueError):
        return None


def unpack_zip(raw: BinaryIO, w: Writer, fmt: ArchiveFormat, encoding: str) -> str | None:
    try:
        zf = zipfile.ZipFile(raw)
    except zipfile.BadZipFile as e:
        raise UserError(f"{w.where} is a damaged or truncated zip ({e}); download it again") from None
    except UnicodeDecodeError as e:  # zipfile decodes a name flagged UTF-8 strictly, while listing
        raise UserError(f"{w.where}: a member name is marked as UTF-8 but holds bytes that are not UTF-8 "
                        f"({e.object[max(0, e.start - 20):e.end + 20]!r}); the zip was written by a broken "
                        "tool or damaged: re-pack it (7-Zip, zip) or download it again") from None
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
            if not is_dir and w.leave_out(name):
                continue
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
    if data_filter is None:  # older Pythons: clean_name and Writer already enforce the same rules
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


def _decompressed(raw: BinaryIO, fmt: ArchiveFormat) -> BinaryIO:
    """The tar inside a compressed one: the module its row names (gzip, bz2, lzma) opens the stream."""
    return importlib.import_module(fmt.compression).open(raw, "rb") if fmt.compression else raw


def unpack_tar(raw: BinaryIO, w: Writer, fmt: ArchiveFormat, encoding: str) -> None:
    stream = _HeaderRecorder(_decompressed(raw, fmt))
    try:
        tf = tarfile.open(fileobj=stream, mode="r:")  # noqa: SIM115 (closed by the `with tf` below)
    except tarfile.ReadError as e:
        what = "is compressed but holds no tar archive, or is damaged" if fmt.compression else "is a damaged tar"
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
            # last, its realpath walk (a large share of the time on small files) finds nothing more.
            target = clean_name(m.linkname, w.where, backslashes=False) if m.islnk() else None
            if not m.isdir() and w.leave_out(name, target):
                continue
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

    def __init__(self, w: Writer, name: str | None, kind: str):
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


def unpack_7z(raw: BinaryIO, w: Writer, fmt: ArchiveFormat, encoding: str) -> None:
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
            if name and kind != "dir" and w.leave_out(name):
                kinds[os.path.normpath(os.path.join(root, f.filename.lstrip("/")))] = (None, kind)  # not written
                continue
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
