"""Temporary folders, locking and the swap into place: an extraction lives in `.<dest>.unpack-<pid>-tmp`
beside the destination until it is complete; leftovers of interrupted runs are cleaned up (or put
back) by the next one, under a lock on the parent folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlenv.errors import UserError
from dlenv.files.safeio import UNPACKED_MARKER

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.unpack-(?P<pid>\d+)-(?P<kind>tmp|old)$")
MARKER = UNPACKED_MARKER  # the file unpack leaves in the root of every folder it makes (dlenv.files.safeio)


def write_marker(folder: Path, archive: Path) -> None:
    """Mark `folder` (the extraction, before it is swapped into place) as unpack's output. Whatever
    the archive put at that name (a file, a folder, a link) is removed first and the marker created
    anew, never followed or kept, so an archive can neither replace nor remove it; being written before
    the swap, it arrives with the folder in the same rename."""
    target = folder / MARKER
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif os.path.lexists(target):
        os.unlink(target)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(f"written by dlenv unpack from {archive.name!r}: no code under this folder is imported as the "
                 "project's model from a weights file unless --model names it (docs/unpack.md)\n")


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


def refuse_unsafe_dest(dest: Path, data_root: Path) -> None:
    """Refuse a destination that is not a folder of its own: one named '.', '..' or nothing (the swap
    renames the folder it names, so `data/..` would replace data's parent), the data root, the working
    folder or one of its ancestors (--overwrite would delete what the user is working in)."""
    hint = "pass --dest NAME, a new folder for this dataset (e.g. data/NAME)"
    if dest.name in ("", ".."):  # pathlib drops a trailing '.': 'data/.' is 'data', '.' has no name
        raise UserError(f"destination {dest} does not name a folder of its own; {hint}")
    where = dest.resolve()
    cwd = Path.cwd().resolve()
    if cwd.is_relative_to(where):
        what = "the working folder" if where == cwd else f"an ancestor of the working folder {cwd}"
        raise UserError(f"destination {dest} is {what}, which --overwrite would replace; {hint}")
    if data_root.resolve().is_relative_to(where):
        what = "the data folder itself" if where == data_root.resolve() else "an ancestor of the data folder"
        raise UserError(f"destination {dest} is {what}, which --overwrite would replace; {hint}")


def _check_dest(dest: Path, overwrite: bool, archive: Path, mounted: bool = False) -> None:
    if dest.is_symlink():
        raise UserError(f"destination {dest} is a symbolic link; pass the folder it points to as --dest")
    if dest.exists():
        if not dest.is_dir():
            raise UserError(f"destination {dest} exists and is not a folder; choose another --dest")
        if any(not _LEFTOVER.match(p.name) for p in dest.iterdir()):
            if not overwrite:
                raise UserError(f"destination {dest} already exists and is not empty; pass --overwrite to "
                                "replace it (only after the new extraction succeeded) or choose another --dest")
            if mounted:  # its old content cannot be swapped out in one rename, so it is not touched
                raise UserError(f"destination {dest} is a mount point (docker run -v ...:{dest}) that holds files; "
                                "--overwrite cannot swap a mount point out whole. Empty it first, or pass "
                                f"--dest {dest}/NAME")
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


def _move_into(new: Path, tmp: Path, dest: Path) -> None:
    """Move what `new` holds into `dest`, an empty mount point (it cannot be renamed itself: EBUSY);
    `tmp` is inside it, on its file system, so each move is a rename. Ctrl-C and SIGTERM wait for the
    renames, as in `_swap_into_place`."""
    in_main = threading.current_thread() is threading.main_thread()
    blocked = {signal.SIGINT, signal.SIGTERM}
    if in_main:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        names = sorted(os.listdir(new))
        clash = [n for n in names if os.path.lexists(dest / n)]
        if clash:  # the archive's own top-level name is the temporary folder's: never merge
            raise UserError(f"destination {dest} already holds {clash[0]!r}; choose another --dest")
        moved = []
        try:
            for n in names:
                os.rename(new / n, dest / n)
                moved.append(n)
        except BaseException:
            for n in moved:  # put back what was moved: the mount point stays as it was
                with contextlib.suppress(OSError):
                    os.rename(dest / n, new / n)
            raise
        if new != tmp:
            new.rmdir()
        tmp.rmdir()
    finally:
        if in_main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up below instead of dying mid-write
