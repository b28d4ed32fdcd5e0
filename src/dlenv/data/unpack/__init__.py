"""Safe unpacking of dataset archives: `dlenv unpack ARCHIVE [--dest DIR] [--overwrite]`.

Archives come from strangers, so every member is checked before a byte of it is written:

- the format is read from the file's first bytes (zip, tar, tar.gz/.bz2/.xz, 7z: dlenv.archives.FORMATS, the
  one table of formats), not its suffix;
- member names with `..` or an absolute path, links that point outside the destination or that a
  later member would be written through, device and FIFO members, a total beyond the free disk and
  a compression ratio that marks a bomb are refused with one line (tar links also pass through
  tarfile's own `data` extraction filter where this Python has it);
- truncated and corrupt archives (CRC, early EOF, a bad header) are refused the same way;
- code (Python sources and bytecode, shared objects, scripts: `names.is_code`) is left out and listed in
  one line, unless `--keep-code`: a dataset is data, and `python -m` run inside the folder would import
  a `dlenv/` or `argparse.py` from it before the installed one.

Everything is written into `.<dest>.unpack-<pid>-tmp` beside the destination and renamed into place
only when complete, so a refusal, a crash, Ctrl-C or `kill` leaves the destination as it was; the
next run removes what an interrupted one left behind. `--overwrite` swaps the old folder out only
after the new one is complete. The folder arrives with a `.dlenv-unpacked` file in its root (`MARKER`,
written by unpack itself, whatever the archive held at that name): code anywhere under it never counts
as the project's own model when a weights file names it (dlenv.model.modelsource), wherever it was unpacked.

Real-world archives come out right: zip names stored in a Windows code page (GBK and others) are
decoded to their real characters, backslash separators become folders, macOS/Windows junk
(`__MACOSX/`, `._*`, `.DS_Store`, `Thumbs.db`, `desktop.ini`) is dropped, and a single top-level
folder is flattened into the destination.

The parts: `names` (the format, safe member names, zip code pages), `guard` (the byte budget and the
writer that checks every member), `formats` (the member readers the table names) and `swap` (temporary folders, locking,
the swap into place).
"""

from __future__ import annotations

import contextlib
import errno
import lzma
import os
import shutil
import signal
import sys
import tarfile
import threading
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlenv.archives import BY_NAME
from dlenv.data.unpack import formats
from dlenv.data.unpack.guard import Budget, Writer, _free_bytes, _size
from dlenv.data.unpack.names import archive_stem, detect_format, guess_name_codec, importable_names, module_of
from dlenv.data.unpack.swap import (
    MARKER,
    _check_dest,
    _move_into,
    _on_sigterm,
    _parent_lock,
    _swap_into_place,
    clean_leftovers,
    refuse_unsafe_dest,
    write_marker,
)
from dlenv.errors import EXIT_INPUT, UserError, printable
from dlenv.files.safeio import open_regular

__all__ = ["MARKER", "UnpackResult", "archive_stem", "clean_leftovers", "detect_format", "guess_name_codec", "main",
           "unpack"]


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
    code: list[str] = field(default_factory=list)  # members left out as code (none with keep_code)
    kept: list[str] = field(default_factory=list)  # code kept (keep_code)
    shadows: list[str] = field(default_factory=list)  # top-level entries left out: named like an importable module


def unpack(archive: str | Path, dest: str | Path | None = None, overwrite: bool = False,
           name_encoding: str = "auto", max_ratio: float = 100.0, progress: bool = True,
           keep_code: bool = False) -> UnpackResult:
    """Unpack `archive` into `dest` (default data/<archive stem>/) safely and atomically, leaving out code
    (listed in the result's `code`) unless `keep_code`.

    Returns an UnpackResult. Raises UserError for a missing, hostile, damaged or empty archive, a
    destination that is in the way, or too little disk; the destination is then exactly as before.
    """
    src = Path(archive)
    if not src.is_file():
        if not src.exists():
            raise UserError(f"archive {src} not found")
        # a FIFO would block the open below, /dev/zero would never end: name it and stop
        with open_regular(src, "archive"):
            pass
    if name_encoding != "auto":
        import codecs

        try:
            codecs.lookup(name_encoding)
        except LookupError:
            raise UserError(f"--name-encoding {name_encoding!r} is not a codec Python knows; try gbk, cp932, "
                            "big5, cp949 or auto") from None
    fmt = detect_format(src)
    if not dest:
        stem = archive_stem(src)
        if not stem.strip("."):  # '..tar.gz' would make data/. (the data folder), '...tar' data/..
            raise UserError(f"archive {src.name!r} gives no folder name to unpack into; pass --dest NAME "
                            "(e.g. data/NAME)")
        dest = Path("data") / stem
    dest = Path(dest)
    refuse_unsafe_dest(dest, Path("data"))
    if dest.resolve() == src.resolve():
        raise UserError(f"destination {dest} is the archive itself; choose another --dest")
    parent = dest.absolute().parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    result = UnpackResult(dest=dest, format=fmt)
    # a mount point (docker run -v HOST:/root/workspace/data/x) cannot be renamed or removed (EBUSY):
    # the extraction then happens inside it, on its own file system, and is moved into it at the end
    mounted = dest.is_dir() and not dest.is_symlink() and os.path.ismount(dest)
    try:
        with _parent_lock(parent):
            result.cleaned = clean_leftovers(parent) + (clean_leftovers(dest) if mounted else [])
            for line in result.cleaned:
                print(printable(line))
            _check_dest(dest, overwrite, src, mounted)
            _extract_and_swap(src, dest if mounted else parent, result, name_encoding, max_ratio, progress,
                              mounted, keep_code)
    except BaseException:
        for p in made:  # parents created for a destination that never came to be
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return result


def _extract_and_swap(src: Path, parent: Path, result: UnpackResult, name_encoding: str, max_ratio: float,
                      progress: bool, mounted: bool = False, keep_code: bool = False) -> None:
    """Extract `src` (in `result.format`) into a temporary folder in `parent` (the destination's parent, or the
    destination itself when it is a mount point), then swap (or, into a mount point, move) it into place at
    `result.dest`."""
    from tqdm import tqdm  # lazy: only an unpack draws a bar

    fmt, dest = BY_NAME[result.format], result.dest
    tmp = parent / f".{dest.name}.unpack-{os.getpid()}-tmp"
    where = str(src)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    if previous is None:  # a handler installed outside Python: restore the default
        previous = signal.SIG_DFL
    tmp.mkdir()
    try:
        size = src.stat().st_size
        with open(src, "rb") as raw, tqdm(total=None if fmt.listed else size, unit="B",
                                           unit_scale=True, unit_divisor=1024, desc=printable(src.name),
                                           mininterval=0.5,
                                           delay=1.0, leave=False,
                                           disable=None if progress else True) as bar:  # None: not in logs
            budget = Budget(where, size, _free_bytes(parent), max_ratio, parent, bar,
                             None if fmt.listed else raw)
            w = Writer(tmp, where, budget, keep_code)
            try:
                result.name_encoding = getattr(formats, fmt.reader)(raw, w, fmt, name_encoding)
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
            if w.code:
                raise UserError(f"{where} holds only code ({code_summary(w.code)}), no data; a dataset is data. If "
                                "you trust it, unpack it with --keep-code")
            what = "only macOS/Windows junk files" if w.junk else "no files"
            raise UserError(f"{where} holds {what}; nothing to unpack")
        result.files, result.bytes, result.junk, result.links = len(w.files), budget.written, w.junk, len(w.links)
        result.code = w.code
        top = os.listdir(tmp)
        new = tmp
        if len(top) == 1 and top[0] in w.dirs and not reaches_root:
            new = tmp / top[0]
            result.flattened = top[0]
        result.shadows = drop_shadows(new)
        prefix = result.flattened + "/" if result.flattened else ""
        gone = [prefix + d.rstrip("/") for d in result.shadows]
        result.kept = [k for k in w.kept if not any(k == g or k.startswith(g + "/") for g in gone)]
        write_marker(new, src)  # after the flattening choice: the marker is not a second top-level entry
        if mounted:
            _move_into(new, tmp, dest)
        else:
            _swap_into_place(new, tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def drop_shadows(root: Path) -> list[str]:
    """Remove each top-level entry of `root` (the folder as it will be) that Python would import in place of
    a module this Python has (names.importable_names: dlenv, torch, numpy, yaml, argparse...): `python -m`
    run inside the folder puts it first on sys.path, and `python -m dlenv` would then run the archive's
    dlenv/. A folder counts when it holds a module file (with or without __init__: a class folder `torch/` of
    images is data and stays), a link as what it names. Even with --keep-code: a dataset never needs one.
    Returns the names removed, sorted."""
    names = importable_names()
    dropped = []
    with os.scandir(root) as entries:
        for e in entries:
            is_dir = e.is_dir(follow_symlinks=False)
            as_dir = is_dir or e.is_dir()
            if module_of(e.name, as_dir) not in names or (as_dir and not _holds_code(e.path)):
                continue
            if is_dir:
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            dropped.append(e.name + ("/" if is_dir else ""))
    return sorted(dropped)


def _holds_code(folder: str) -> bool:
    """Whether a folder holds any module file at its top."""
    try:
        return any(module_of(n, False) for n in os.listdir(folder))
    except OSError:
        return False


def code_summary(names: list[str], shown: int = 3) -> str:
    """'a.py, dlenv/__init__.py, run.sh and 4 more': the first few of `names`, for one line."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more:,} more" if more > 0 else "")


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
               max_ratio=cfg.max_ratio, keep_code=cfg.keep_code)
    # every name below came from the archive or its file name: escaped, so ESC or CR cannot act
    dest, archive = printable(r.dest), printable(cfg.archive)
    print(f"unpacked {r.files} files ({_size(r.bytes)}) from {archive} into {dest}/")
    if r.flattened:
        print(f"  its single top-level folder {printable(r.flattened)}/ was flattened into {dest}/")
    if r.junk:
        print(f"  dropped {r.junk} macOS/Windows junk entries (__MACOSX, ._*, .DS_Store, Thumbs.db, desktop.ini)")
    if r.code:
        files = f"{len(r.code)} code file{'s' if len(r.code) != 1 else ''}"
        print(f"  left out {files} ({printable(code_summary(r.code))}): a dataset is data; --keep-code keeps them")
    if r.shadows:
        print(f"  left out {printable(code_summary(r.shadows))} at its top: named like a module Python imports "
              "(python -m inside the folder would load it instead), even with --keep-code")
    if r.kept:
        print(f"  kept {len(r.kept)} code file{'s' if len(r.kept) != 1 else ''} (--keep-code): "
              f"{printable(code_summary(r.kept, shown=len(r.kept) if len(r.kept) <= 20 else 20))}")
    if r.name_encoding and r.name_encoding != "utf-8":
        print(f"  file names decoded from {r.name_encoding} (the zip does not mark them as UTF-8); if they "
              "look wrong, try --name-encoding")
    if cfg.report and not _print_report(r.dest):
        return EXIT_INPUT  # the files stay: the line says what to change or which --data to pass
    return 0


def _print_report(root: Path) -> bool:
    """Print the dataset report of `root`, or the one line that says why dlenv cannot train on it (a
    dataset nested folders down: that, and the --data that would work); returns whether it can."""
    from dlenv.data.report import dataset_report, format_report

    try:
        report = dataset_report(root)
    except UserError as e:
        nested = nested_dataset(root)
        if nested is not None:
            inner = nested.relative_to(root).as_posix()
            depth = len(nested.relative_to(root).parts)
            print(f"dlenv unpack: not a dataset layout dlenv can train on yet: the dataset sits {depth} folder"
                  f"{'s' if depth > 1 else ''} down in {printable(root)}/ ({printable(inner)}/); train on it "
                  f"with --data {printable(nested)}, or move {printable(inner)}/'s contents up into "
                  f"{printable(root)}/; the files stay in {printable(root)}/", file=sys.stderr)
        else:
            print(f"dlenv unpack: not a dataset layout dlenv can train on yet: {printable(e)}; the files stay in "
                  f"{printable(root)}/", file=sys.stderr)
        return False
    print()
    print(format_report(report))
    return True


#: folder names of a dataset's splits: never the dataset itself
_SPLITS = ("train", "val", "valid", "validation", "test")
#: how deep `nested_dataset` looks below the unpacked folder, and how many folders it visits at most
NEST_DEPTH, NEST_FOLDERS = 8, 2000


def nested_dataset(root: Path) -> Path | None:
    """The shallowest folder below `root` (not `root` itself) that holds a dataset layout: train/ with two
    or more class folders, or two or more class folders with files in them; None when there is none, or
    when `root` has a split of its own (train/, val/: its layout is what is wrong). Bounded: NEST_DEPTH
    levels, NEST_FOLDERS folders."""
    if any(sub.name.lower() in _SPLITS for sub in _subfolders(Path(root))):
        return None
    level, seen = [Path(root)], 0
    for _ in range(NEST_DEPTH):
        below = []
        for d in level:
            for sub in _subfolders(d):
                seen += 1
                if seen > NEST_FOLDERS:
                    return None
                if sub.name.lower() not in _SPLITS and _looks_like_dataset(sub):
                    return sub
                below.append(sub)
        level = below
    return None


def _subfolders(d: Path) -> list[Path]:
    try:
        with os.scandir(d) as it:
            return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    except OSError:
        return []


def _looks_like_dataset(d: Path) -> bool:
    if (d / "train").is_dir() and len(_subfolders(d / "train")) >= 2:
        return True
    classes = _subfolders(d)
    return len(classes) >= 2 and all(any(f.is_file() for f in c.iterdir()) for c in classes[:2])
