"""The guard every member passes on its way to disk: the byte budget (free disk, decompression bombs)
counted as it is written, and the writer that leaves code out (a dataset is data), never writes through
or over a link and creates symbolic links last, after every target was checked against every other link."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from dlenv.data.unpack.names import is_code
from dlenv.errors import UserError

#: Bytes per read/write: large enough that Python's per-call overhead vanishes next to the copy.
CHUNK = 1 << 20
#: Below this many unpacked bytes no archive counts as a bomb, whatever its ratio.
BOMB_MIN_BYTES = 64 << 20
#: A single member may be this many times more compressed than `max_ratio` allows for the whole.
MEMBER_RATIO_FACTOR = 5
#: Free space kept spare on the destination's disk.
DISK_MARGIN = 64 << 20


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Budget:
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


class Writer:
    """Writes checked members under `root`; no write ever goes through or over a link.

    Symbolic links are created last, after every target has been checked against every other link,
    so no member can be written through one and no chain of links can lead outside. Code (files and
    links named as code, hard links to it) is left out and listed in `code`, unless `keep_code`.
    """

    def __init__(self, root: Path, where: str, budget: Budget, keep_code: bool = False):
        self.root, self.where, self.budget = str(root), where, budget
        self.keep_code = keep_code
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        self.links: dict[str, str] = {}
        self.code: list[str] = []  # members left out as code, in archive order
        self.kept: list[str] = []  # code kept with keep_code, in archive order
        self._code_set: set[str] = set()
        self.junk = 0

    def leave_out(self, name: str, target: str | None = None) -> bool:
        """Whether file or link `name` (a hard link to `target`) is code to leave out; records it if so."""
        if not (is_code(name) or target in self._code_set):
            return False
        if self.keep_code:
            self.kept.append(name)
            return False
        if name not in self._code_set:
            self._code_set.add(name)
            self.code.append(name)
        return True

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
        if "\x00" in target:  # no file system stores one; os.symlink would raise ValueError
            raise UserError(f"{self.where}: link {name!r} points to a name holding a NUL byte ({target[:60]!r}); "
                            "the archive is damaged or hostile, refusing to unpack")
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
