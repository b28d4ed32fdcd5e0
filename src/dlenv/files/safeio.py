"""Opening a file someone gave us: only a regular file, never blocking, never read past a bound.

A FIFO blocks `open()` until a writer comes (and no signal handler runs while the main thread waits in
the kernel), /dev/zero never ends, and a 40 GB "config" fills memory. Every path dlenv reads that came
from a user, an archive or another file goes through here: the file is opened with O_NONBLOCK (so a
FIFO opens at once instead of hanging), checked with fstat on the open descriptor (no race between the
check and the open), and read up to a limit. A "regular file" of the kernel's own file systems (/proc, /sys,
/dev and their kin: `PSEUDO_FS`) is refused too, judged by the file system the open descriptor lies on, not by
its path: its size (0 or 4096) says nothing of what reading it gives (/proc/self/mem fails with EIO, which
read as a broken disk; /proc/kcore is the machine's memory; /proc/self/environ is this process's secrets).
No torch here: config and the CLI use it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import stat
from typing import BinaryIO

from dlenv.errors import UserError, printable

#: the file `dlenv unpack` leaves in the root of every folder it makes: what lies under it came from an
#: archive, so no code in it counts as the project's own (dlenv.model.modelsource); a hidden name the
#: dataset scan skips. Here, below both wings that read it.
UNPACKED_MARKER = ".dlenv-unpacked"

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: bounds for the small files dlenv reads: a --cfg YAML, a JSON report
SMALL_FILE = 4 * MIB
#: the largest image file a decoder is handed (a 100-megapixel TIFF is ~300 MB; Pillow's own
#: decompression-bomb check bounds the pixels)
IMAGE_FILE = 1 * GIB


#: the kernel's own file systems: what they call regular files are views of the kernel, not bytes on a disk
#: (tmpfs, /dev/shm's, is a real one: files there hold what was written)
PSEUDO_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs", "securityfs", "cgroup", "cgroup2", "configfs",
    "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "selinuxfs", "nsfs", "mqueue", "hugetlbfs",
    "rpc_pipefs", "autofs"})
#: the most of /proc/self/mountinfo read (a host with thousands of mounts has a few hundred KB)
_MOUNTINFO_LIMIT = 4 * MIB


def kernel_mounts(mountinfo: str) -> dict[int, str]:
    """{st_dev: file system type} of the `PSEUDO_FS` mounts in the text of a /proc/PID/mountinfo."""
    found: dict[int, str] = {}
    for line in mountinfo.splitlines():
        # ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [OPTIONAL FIELDS...] - FSTYPE SOURCE SUPEROPTIONS
        fields = line.split(" ")
        if "-" not in fields[6:] or len(fields) < 3:
            continue
        at = fields.index("-", 6) + 1
        major, _, minor = fields[2].partition(":")
        if at < len(fields) and fields[at] in PSEUDO_FS and major.isdigit() and minor.isdigit():
            found[os.makedev(int(major), int(minor))] = fields[at]
    return found


@functools.lru_cache(maxsize=1)
def pseudo_devices() -> dict[int, str]:
    """{st_dev: file system type} of this process's mounts of a `PSEUDO_FS`, read once from
    /proc/self/mountinfo; without it (no /proc mounted), the devices of /proc and /sys where they exist."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            found = kernel_mounts(f.read(_MOUNTINFO_LIMIT).decode("utf-8", "replace"))
    except OSError:
        found = {}
    for where, fstype in (() if found else (("/proc", "proc"), ("/sys", "sysfs"))):
        with contextlib.suppress(OSError):
            found[os.stat(where).st_dev] = fstype
    return found


def _pseudo(st: os.stat_result) -> str | None:
    """'the kernel's proc file system' for a file on a `PSEUDO_FS`, else None."""
    fstype = pseudo_devices().get(st.st_dev)
    return f"a file of the kernel's {fstype} file system (not one on a disk)" if fstype else None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str = "file", limit: int | None = None) -> BinaryIO:
    """`path` opened for binary reading, after checking (on the open descriptor) that it is a regular
    file of at most `limit` bytes.

    Raises UserError naming `what` and the path for a folder, FIFO, device or socket, or a file over the
    limit; OSError (ENOENT, EACCES, ...) passes through for `errors.environment_fault`.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise UserError(f"{what} {printable(os.fspath(path))} is a folder, not a file; pass a file path") from None
    except OSError as e:
        # a socket cannot be opened at all (ENXIO), nor a device with no driver behind it (ENODEV):
        # name what the path is instead of the kernel's "No such device or address"
        if e.errno not in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
            raise
        try:
            kind = _kind(os.stat(path).st_mode)
        except OSError:
            kind = "not a regular file"
        raise UserError(f"{what} {printable(os.fspath(path))} is {kind}, not a regular file; pass a regular file"
                        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} {printable(os.fspath(path))} is {_kind(st.st_mode)}, not a regular file; "
                            "pass a regular file")
        pseudo = _pseudo(st)
        if pseudo:  # its size says nothing of what reading gives: never read as data
            raise UserError(f"{what} {printable(os.fspath(path))} is {pseudo[:-1]}: its size says nothing of what "
                            "reading it gives); pass a regular file")
        if limit is not None and st.st_size > limit:
            raise UserError(f"{what} {printable(os.fspath(path))} is {st.st_size:,} bytes, more than the "
                            f"{limit:,} such a file may have; pass the right file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        # FileIO + BufferedReader is what open() builds (os.fdopen's extra Python layer costs ~20 us a
        # file: this runs once per image); the name makes messages (Pillow's too) show the path
        raw = io.FileIO(fd, "rb")
        raw.name = os.fspath(path)
        return io.BufferedReader(raw)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of regular file `path`, at most `limit` of them (UserError past it, even when the file
    grows while we read)."""
    with open_regular(path, what, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{what} {printable(os.fspath(path))} grew past the {limit:,} bytes such a file may "
                        "have while it was read; pass the right file")
    return data


def read_text(path: str | os.PathLike, limit: int = SMALL_FILE, what: str = "file") -> str:
    """`read_regular` decoded as UTF-8 (UserError naming the file when it is not text)."""
    data = read_regular(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {printable(os.fspath(path))} is not UTF-8 text (byte {e.start}); "
                        "pass a text file") from None


def is_regular(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file on a disk (following links), without opening it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and _pseudo(st) is None


def irregular(path: str | os.PathLike) -> str | None:
    """What `path` is when it is not a regular file on a disk ('a named pipe (FIFO)', 'a folder', 'a file of
    the kernel's proc file system, ...'), following links, without opening it; None for a regular file on a disk
    and for a path that cannot be looked at (opening it says why)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else _pseudo(st)
