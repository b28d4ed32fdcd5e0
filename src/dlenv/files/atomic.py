"""Write a file whole or not at all: a temporary file beside it, renamed into place when complete.

Every file dlenv writes goes through here (reports, plots, config.yaml, results.csv, exports,
run files, the image cache), so an interrupted run leaves the old file or the new one, never half
of one. `durable=True` (run files, the cache's index) also fsyncs the file before the rename and
the folder after it, so the new file survives a power cut, not only a crash. A write that fails (a
full disk, a read-only folder) leaves the old file too, and raises an OSError naming the
destination, which the CLI prints as one line. `check_output` refuses an output path that cannot be
a file or folder before any work is done. No torch here: plots import this module.

The temporary file comes from `tempfile.mkstemp`, which creates it 0600 whatever the umask. A file
that is renamed into place keeps that mode, so every report, figure and run file would be private to
its writer while results.csv (opened normally) follows the umask. `file_mode()` gives the mode an
ordinary `open()` would have created (0666 minus the umask), and the writers set it before the rename:
with `docker run --user` and a group-shared folder, a run's files are readable by the group like any
other file the user writes.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dlenv.errors import UserError, first_line, torch_write_failure, with_path


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status, 4.7+).

    Elsewhere os.umask is set and restored at once, which another thread could observe for an instant.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """The permission bits `open(path, "w")` would give a new file now: 0o666 & ~umask."""
    return 0o666 & ~umask()


#: how a Rust writer's I/O error carries its errno in its message: safetensors' save_file raises SafetensorError
#: "Error while serializing: I/O error: No space left on device (os error 28)" (older: "Os { code: 28, ...")
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)|\bOs \{ code: (\d+)")


def _errno_in_text(exc: BaseException) -> int | None:
    """The errno an exception that is no OSError names in its message (a Rust library's I/O error), or None."""
    m = _OS_ERROR_IN_TEXT.search(str(exc))
    return int(m.group(1) or m.group(2)) if m else None


def write_atomic(path: str | Path, write: Callable[[Path], object], durable: bool = False) -> Path:
    """Call `write(tmp_path)` for a temporary file beside `path`, then os.replace it into place.

    The file gets the mode a plain `open()` would give it (see `file_mode`). A failure (or Ctrl-C)
    removes the temporary file and leaves whatever was at `path` untouched. `durable`: fsync the file
    and then its folder, so the rename itself is on disk. Returns `path`. Raises OSError naming `path`
    when the write fails (torch's RuntimeError for a write that failed under it becomes one too, and so does
    a Rust writer's error that names an OS error: safetensors on a full disk).
    """
    path = Path(path)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        write(Path(tmp))
        # after write(): some writers (ONNX, savefig) may have replaced the file instead of filling it
        os.chmod(tmp, file_mode())
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise with_path(e, path) from None
    except RuntimeError as e:
        Path(tmp).unlink(missing_ok=True)
        if torch_write_failure(e):
            raise write_failure(path, e) from None
        raise
    except Exception as e:
        Path(tmp).unlink(missing_ok=True)
        code = _errno_in_text(e)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync(path.parent)
    return path


def write_file(path: str | Path, write: Callable[[BinaryIO], object], durable: bool = False) -> Path:
    """`write(fh)` into a binary file handle, atomically (see `write_atomic`), for writers that take
    one (torch.save, numpy.save)."""
    def to_handle(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            write(fh)

    return write_atomic(path, to_handle, durable)


#: the names temp_beside gives: '.<file>.' + mkstemp's 8 random characters + '.tmp'
_TEMP_NAME = re.compile(r"^\.(?P<file>.+)\.[a-z0-9_]{8}\.tmp$")


def remove_leftover_temps(folder: Path) -> list[str]:
    """Delete the temporary files that killed writes (kill -9 mid-write) left in `folder`; returns their
    names. Only regular files named as temp_beside names them; call it only while no write into
    `folder` can be under way (e.g. holding the run folder's lock)."""
    removed = []
    with os.scandir(folder) as entries:
        for e in entries:
            if _TEMP_NAME.match(e.name) and e.is_file(follow_symlinks=False):
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    continue
                removed.append(e.name)
    return sorted(removed)


def temp_beside(path: Path) -> tuple[int, str]:
    """(fd, name) of a new temporary file in `path`'s folder (created if needed); an OSError names `path`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # name what was to be written, not the temporary name
        if e.errno in (errno.ENOTDIR, errno.EEXIST):  # a file where a folder of the path should be
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from None


def write_failure(path: str | Path, exc: BaseException) -> OSError:
    """The OSError to raise for torch's RuntimeError `exc` from writing `path`: ENOSPC when the disk
    holding it is (nearly) full, else EIO with torch's first line."""
    try:
        full = shutil.disk_usage(Path(path).parent).free < 64 * 2**20
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return OSError(errno.EIO, f"PyTorch could not write it: {first_line(exc, 120, named=False)}", str(path))


def write_bytes(path: str | Path, data: bytes, durable: bool = False) -> Path:
    """`data` to `path`, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data), durable)


def write_text(path: str | Path, text: str, durable: bool = False) -> Path:
    """`text` (UTF-8) to `path`, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output(path: str | Path, flag: str, folder: bool = False) -> Path:
    """Refuse an output `path` that cannot become a file (or with `folder`, a folder); returns it.

    Checked before a command spends time on its work: the path itself must not be a folder (a file
    when `folder`), and the nearest part of it that exists must be a folder this process may write in.
    Raises UserError naming `flag` and the part in the way, or the OSError of a folder it may not write
    in (EROFS, EACCES: the CLI's one line for a fault of the machine, exit 5).
    """
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; pass a folder for the reports "
                        "(it is created if needed)")
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; pass a file path (a new name inside it will do)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, so nothing can be written under it; "
                                "choose another path")
            if not os.access(parent, os.W_OK | os.X_OK):  # a read-only mount or folder: the fault's own line
                code = errno.EROFS if os.statvfs(parent).f_flag & os.ST_RDONLY else errno.EACCES
                raise OSError(code, os.strerror(code), str(parent))  # (exit 5), before the work, not after it
            break
    return path
