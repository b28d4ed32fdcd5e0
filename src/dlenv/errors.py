"""The one exception type for bad user input, and the one line for a fault of the machine.

A `UserError` carries a single line that names the bad value and the way out; the CLI and the invoke
tasks print it as is and exit non-zero, with no traceback. `environment_fault` turns what the machine
did wrong (a full disk, a read-only folder, a permission, a name too long: an `OSError`, or torch's
own message for a write that failed under it) into such a line, naming the path and what to do. The
CLI applies it to every verb in one place. Anything else is a bug and keeps its traceback, followed by
`BUG_REPORT`. A stop signal is `Stopped`, a BaseException no `except Exception` takes for a failure
of its own, and noted by `stop` where no library can lose it (`check_stop`). No torch here: `dlenv --help`
imports this module; of dlenv it reads only the table of archive formats (dlenv.archives).
"""

from __future__ import annotations

import errno
import importlib
import os
import re
from types import ModuleType
from typing import Any, NoReturn

from dlenv.archives import ARCHIVE_SUFFIXES

# Every exit status a dlenv command ends with, in this one table (docs/faults.md shows it; a test
# checks that the two agree and that no two meanings share a value). A launcher reads them: torchrun's
# wrapper (dlenv.cluster.launch) must tell the rank that failed (a full disk: EXIT_FAULT) from the ranks that
# only saw it go (EXIT_PEER), so no two meanings may share a number.
EXIT_OK = 0
EXIT_BUG = 1             #: an error dlenv did not expect: traceback, then BUG_REPORT
EXIT_INPUT = 2           #: a bad flag, file, folder or dataset (UserError's default)
EXIT_OOM = 3             #: out of memory, with advice: CUDA in train, the host's RAM in any verb
EXIT_NONFINITE = 4       #: non-finite losses in train; non-finite outputs in val
EXIT_FAULT = 5           #: the machine: full disk, read-only folder, permission, /dev/shm, a killed worker
EXIT_PEER = 6            #: another process of a multi-GPU run failed; this one stopped because of it
EXIT_SIGINT = 130        #: Ctrl-C (128 + SIGINT), after saving
EXIT_SIGTERM = 143       #: docker stop / kill (128 + SIGTERM), after saving
EXIT_SIGHUP = 129        #: the terminal or SSH session closed (128 + SIGHUP), after saving

#: status -> what it means, for docs/faults.md and `dlenv --help`-free lookups
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done",
    EXIT_BUG: "a bug in dlenv (the traceback, then a line asking for a report)",
    EXIT_INPUT: "a bad flag, file, folder or dataset you gave",
    EXIT_OOM: "out of memory: CUDA (train), or the host's RAM (any verb)",
    EXIT_NONFINITE: "non-finite numbers: losses (train), outputs of the weights (val)",
    EXIT_FAULT: "the machine: a full disk or /dev/shm, a read-only or foreign-owned folder, a worker the system "
                "killed",
    EXIT_PEER: "another process of the multi-GPU run failed (its own line names the cause)",
    EXIT_SIGINT: "interrupted by Ctrl-C (train saves first)",
    EXIT_SIGTERM: "stopped by docker stop / SIGTERM (train saves first)",
    EXIT_SIGHUP: "the terminal or SSH session closed, SIGHUP (train saves first)",
}

#: printed after the traceback of an error dlenv did not expect
BUG_REPORT = ("this is a bug in dlenv {version}, not a problem with your input; please report it to "
              "the dlenv issue tracker with the traceback above and the output of `invoke verify-env`")


# Characters that would act on a terminal instead of showing: C0/C1 controls (ESC clears the screen,
# CR and newline fake lines), bidirectional overrides (they reorder what follows), and the surrogates
# Python uses for bytes of a file name that are not UTF-8 (printing them raises).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                          "\u2066-\u2069\ud800-\udfff]")


def _escape(ch: str) -> str:
    o = ord(ch)
    if ch in "\t\n\r":
        return repr(ch)[1:-1]
    if 0xDC80 <= o <= 0xDCFF:  # a byte of a non-UTF-8 file name: show the byte
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(text: object) -> str:
    """`text` with every control, bidi-override and stray-surrogate character written as an escape
    (\\x1b, \\r, \\n, \\u202e, \\xff for a non-UTF-8 byte of a file name), so it prints as one line
    that shows what is there."""
    return _UNPRINTABLE.sub(lambda m: _escape(m.group()), str(text))


class UserError(Exception):
    """A problem the user can fix. `str(err)` is the one line to print; `exit_code` the status."""

    def __init__(self, message: str, exit_code: int = EXIT_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


def not_installed(exc: BaseException, name: str) -> bool:
    """Whether `exc`, raised by `import name`, says the library (or the part of it named) is not there,
    rather than that it is there and broken: a ModuleNotFoundError for `name` or a package above it."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return bool(missing) and (name == missing or name.startswith(f"{missing}."))


def broken_library(name: str, exc: BaseException | str) -> UserError:
    """The one line for an optional library that is installed but fails to import (onnx built for NumPy 2
    beside NumPy 1.x raises RuntimeError or SystemError, a half-removed install AttributeError or an
    ImportError of a part of it): what it said, and `pip check`."""
    top = name.split(".")[0]
    said = printable(first_line(exc, 160))
    return UserError(f"{top} is installed but fails to import ({said}); it does not fit the packages beside it "
                     f"(often a build for another NumPy): run pip check, then pip install --force-reinstall {top} "
                     "(or pip install -r requirements.txt)")


def optional_import(name: str, missing: str | None = None) -> ModuleType | None:
    """`import name` for a library dlenv can run without: the module; when it is not installed, a UserError
    saying `missing`, or None where `missing` is None (the caller has a way without it). When it is installed
    but fails to import with any error (`broken_library`), one line naming it and pip check. A stop signal
    that lands inside the import and is converted on the way stays a stop (`check_stop`)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # RuntimeError, SystemError, AttributeError, ...: what a broken build raises
        check_stop()
        if not not_installed(e, name):
            raise broken_library(name, e) from None
        if missing is None:
            return None
        raise UserError(missing) from None


_ELSEWHERE = "or write elsewhere (--project / --out)"

#: errno -> (what happened to PATH, what to do). PATH is filled in by `environment_fault`.
_FAULTS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on the device holding {path}",
                   "free some space (df -h {dir}) " + _ELSEWHERE + ", then run again"),
    errno.EDQUOT: ("disk quota exceeded writing {path}", "free space in your quota " + _ELSEWHERE),
    errno.EFBIG: ("{path} would grow past the largest file allowed here (ulimit -f or the file "
                  "system's limit)", "raise the limit " + _ELSEWHERE),
    errno.EROFS: ("{path} is on a read-only file system",
                  "mount it read-write (docker run -v HOST:CONTAINER without :ro) " + _ELSEWHERE),
    errno.EACCES: ("permission denied for {path}",
                   "run as its owner (docker run --user $(id -u):$(id -g)), fix its permissions, " + _ELSEWHERE),
    errno.EPERM: ("the operation on {path} is not permitted",
                  "run as its owner (docker run --user $(id -u):$(id -g)), fix its permissions, " + _ELSEWHERE),
    errno.ENAMETOOLONG: ("the name {path} is too long for the file system (at most 255 bytes a name)",
                         "choose a shorter --name, --project or --out"),
    errno.ENOTDIR: ("a part of {path} is a file where a folder is needed",
                    "move that file away or choose another path"),
    errno.EISDIR: ("{path} is a folder where a file is needed", "pass a file path"),
    errno.EEXIST: ("{path} already exists and is in the way", "move it away or choose another path"),
    errno.ENOENT: ("{path} does not exist", "check the path (inside the container: under /root/workspace)"),
    errno.ELOOP: ("{path} has a loop of symbolic links", "fix the links or choose another path"),
    errno.EIO: ("an input/output error on {path}: the disk or network file system failed",
                "check the device (dmesg) and run again"),
    errno.EMFILE: ("too many open files (while opening {path})",
                   "raise the limit (ulimit -n 65536, or docker run --ulimit nofile=65536) or use fewer --workers"),
    errno.ENFILE: ("the system ran out of open files (while opening {path})", "use fewer --workers"),
    errno.EPIPE: ("the output was closed before dlenv finished writing to it (piped into head?)",
                  "let the command write all of its output"),
    errno.EBUSY: ("{path} is busy: a mount point (docker run -v ...:{path}) or in use, so it cannot be renamed "
                  "or removed", "write into a folder inside it, or mount its parent folder instead"),
    errno.ENOMEM: ("out of memory (while working on {path})", "use a smaller --batch-size or fewer --workers"),
}

# What torch raises (as RuntimeError) when a write under its zip writer fails, e.g. on a full disk:
# "[enforce fail at inline_container.cc:325] . unexpected pos 320 vs 248", "PytorchStreamWriter failed
# writing file data/0: file write failed", and the shared-memory file of a DataLoader worker
# ("unable to write to file </torch_123_456>: No space left on device").
_TORCH_WRITE = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing|file write failed|"
                          r"No space left on device", re.I)
_SHM_FILE = re.compile(r"</?torch_\d+_\d+|/dev/shm", re.I)


# A DataLoader worker that died: torch's message in the main process ("DataLoader worker (pid 123) is
# killed by signal: Bus error. ..."), raised as the cause of "DataLoader worker (pid(s) 123) exited
# unexpectedly".
_WORKER_SIGNAL = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: ([\w ]+)")
# (worded without torch's "DataLoader worker", which marks its own crash output)
_SHM_LINE = ("shared memory (/dev/shm) is full: the processes that load images pass batches through it; start "
             "the container with --ipc=host or --shm-size=8g, or use fewer --workers (0 needs none)")
_KILLED_LINE = ("a process that loads images (--workers) was killed by the system{at} (SIGKILL; out of host memory? "
                "see dmesg or docker stats); use fewer --workers or a smaller --batch-size, or give the container "
                "more memory (docker run --memory)")


def _chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """`exc` and the errors it was raised from, newest first."""
    out: list[BaseException] = []
    while exc is not None and len(out) < limit and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def shm_full(exc: BaseException) -> bool:
    """Whether `exc` is /dev/shm running out under a DataLoader: a write into a shared-memory segment
    that failed (ENOSPC), or a worker killed by SIGBUS (the signal a full tmpfs sends)."""
    for e in _chain(exc):
        text = str(e)
        if (isinstance(e, (RuntimeError, OSError)) and _SHM_FILE.search(text)
                and ("No space left" in text or getattr(e, "errno", None) == errno.ENOSPC)):
            return True
        m = _WORKER_SIGNAL.search(text)
        if m and m.group(1).strip() == "Bus error":
            return True
    return False


def _worker_gone_mid_handoff(e: BaseException) -> bool:
    """A connection error raised while the main process fetched a batch tensor's file descriptor from the
    worker that made it (multiprocessing's resource_sharer, under torch's rebuild_storage_fd): the worker
    died between sending the batch and handing over its memory, so torch never names the signal."""
    if not isinstance(e, (ConnectionError, EOFError)):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("resource_sharer.py"):
            return True
        tb = tb.tb_next
    return False


def worker_killed(exc: BaseException) -> bool:
    """Whether `exc` says a DataLoader worker was killed by SIGKILL (the OOM killer, or a person), by
    torch's message or by a worker that vanished while handing a batch over."""
    return any(((m := _WORKER_SIGNAL.search(str(e))) and m.group(1).strip() == "Killed")
               or _worker_gone_mid_handoff(e) for e in _chain(exc))


def first_line(e: BaseException | str, limit: int = 200, named: bool = True) -> str:
    """The first line of an exception's message (at most `limit` characters, cut at a word with "..."), for
    a one-line report: 'Type: line', or the line alone with `named=False`; the type's name where the message
    is empty. A str (a warning's text) gives its own first line, or ''. The one copy of this rule in dlenv."""
    lines = str(e).strip().splitlines()
    line = cut_at_word(lines[0], limit) if lines else ""
    if isinstance(e, str):
        return line
    if not line:
        return type(e).__name__
    return f"{type(e).__name__}: {line}" if named else line


def cut_at_word(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: whole, or cut after its last whole word that fits, then "..."
    (a line cut mid-word, "... could not be lo", reads as a typo); a word longer than half the room is cut."""
    if len(text) <= limit:
        return text
    room = max(limit - 3, 1)
    cut = text[:room]
    space = cut.rfind(" ")
    if text[room] != " " and space > room // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "..."


# PyTorch's CPU allocator refusing an allocation (a RuntimeError: "[enforce fail at alloc_cpu.cpp:75] err == 0.
# DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot
# allocate memory)" on 1.13 and 2.x; "not enough memory" on Windows), as raised or as quoted by a DataLoader
# worker's re-raise ("Caught RuntimeError in DataLoader worker process 0. Original Traceback ...").
_CPU_ALLOC = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
                        r"(?:: you tried to allocate (\d+) bytes)?")


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB" if n >= 2 ** 20 else f"{n} bytes"


def host_memory_short(exc: BaseException) -> str | None:
    """Whether `exc` is the host running out of RAM in this process: PyTorch's CPU allocator (above) or a
    MemoryError (Python's, NumPy's, Pillow's), raised or re-raised from a DataLoader worker. Returns what
    failed ("could not allocate 1.90 GiB", or "an allocation failed" when the size is not said), else None.
    A worker the system killed is `worker_killed` (its cause is only a guess)."""
    for e in _chain(exc):
        m = _CPU_ALLOC.search(str(e)) if isinstance(e, RuntimeError) else None
        if m and m.group(1):
            return f"could not allocate {_size(int(m.group(1)))}"
        if m or isinstance(e, MemoryError):
            return "an allocation failed"
    return None


def sizes_said(batch_size: object = None, img_size: object = None, workers: object = None) -> str:
    """'batch size 512, image size 224, 8 workers': the sizes a command ran at that bear on its memory,
    each left out when not known (None or 'auto')."""
    parts = [f"{label} {v}" for label, v in (("batch size", batch_size), ("image size", img_size))
             if isinstance(v, int) and not isinstance(v, bool)]
    if isinstance(workers, int) and not isinstance(workers, bool):
        parts.append(f"{workers} worker{'s' if workers != 1 else ''}")
    return ", ".join(parts)


def host_memory_line(exc: BaseException, batch_size: object = None, img_size: object = None,
                     workers: object = None, accum_steps: object = None) -> str | None:
    """The one line for the host running out of RAM (`host_memory_short`), as CUDA's out-of-memory has
    (dlenv.engine.memory.oom_message): what failed, at which sizes, and what to try in order; None when `exc` is
    not that. The suggestions use the flags the command has (those given here, not None)."""
    what = host_memory_short(exc)
    if what is None:
        return None
    at = sizes_said(batch_size, img_size, workers)
    tries = []
    if isinstance(batch_size, int) and batch_size > 1:
        half = batch_size // 2
        if accum_steps is not None:
            accum = accum_steps if isinstance(accum_steps, int) else 1
            tries.append(f"--batch-size {half} --accum-steps {accum * 2} (same images per optimizer step)")
        else:
            tries.append(f"--batch-size {half}")
    if isinstance(workers, int) and workers > 0:
        tries.append(f"--workers {workers // 2} (each worker holds batches of its own in RAM)")
    if isinstance(img_size, int) and img_size > 32:
        tries.append("a smaller --img-size")
    tries.append("give the container more memory (docker run --memory; docker stats shows its use)")
    return (f"out of host memory (RAM): {what}{f' at {at}' if at else ''}; the machine's memory or the "
            "container's limit is used up. Try, in order: " + "; ".join(f"{i}) {t}" for i, t in enumerate(tries, 1)))


def torch_write_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch's RuntimeError for a file write that failed under it (a full disk)."""
    return isinstance(exc, RuntimeError) and bool(_TORCH_WRITE.search(str(exc)))


def environment_fault(exc: BaseException, at: str = "") -> str | None:
    """One line for a fault of the machine (see the module docstring), or None when `exc` is not one.

    Knows OSError by its errno (no space, quota, read-only, permission, name too long, a file where a
    folder is expected, ...) and torch's messages for a write that failed under it. `at` (`sizes_said`)
    names the sizes the command ran at, for a worker the system killed (out of host memory, likely).
    """
    if shm_full(exc):
        return _SHM_LINE
    if worker_killed(exc):
        return _KILLED_LINE.format(at=f" at {at}" if at else "")
    if torch_write_failure(exc):
        return ("writing a file failed: no space left on the device (PyTorch: "
                f"{str(exc).strip().splitlines()[0][:100]}); free some space " + _ELSEWHERE + ", then run again")
    if not isinstance(exc, OSError) or exc.errno not in _FAULTS:
        return None
    what, todo = _FAULTS[exc.errno]
    names = [n for n in (exc.filename, exc.filename2) if n is not None]
    path = os.fsdecode(names[-1]) if names else "a file"
    if exc.errno == errno.ENAMETOOLONG and len(path) > 90:
        path = path[:60] + "..." + path[-20:]
    folder = os.path.dirname(path) or "."
    return f"{what.format(path=path)} ({exc.strerror or errno.errorcode.get(exc.errno, exc.errno)}); " \
           f"{todo.format(dir=folder)}"


def with_path(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc` with `path` as its file name when it names none (a write() on an open file names nothing)."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        new = type(exc)(exc.errno, exc.strerror, os.fspath(path))
        new.__traceback__ = exc.__traceback__
        return new
    return exc


def need_folder(path: str | os.PathLike, flag: str, fix: str) -> None:
    """Raise UserError unless `path` is a folder, in one line that tells a missing folder from a file:
    "FLAG PATH: no such folder; FIX", or "FLAG PATH is a file, not a folder; FIX" (an archive is named
    as one, with the command that unpacks it: a dataset.zip passed where its folder belongs is common)."""
    if os.path.isdir(path):
        return
    shown = printable(os.fspath(path))
    if not os.path.exists(path):
        raise UserError(f"{flag} {shown}: no such folder; {fix}")
    if os.fspath(path).lower().endswith(ARCHIVE_SUFFIXES):
        raise UserError(f"{flag} {shown} is an archive, not a folder; unpack it first (invoke unpack {shown}) "
                        "and pass the folder it makes")
    raise UserError(f"{flag} {shown} is a file, not a folder; {fix}")


# ---------------------------------------------------------------------------------------------------
# Stop signals


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP; SIGINT in train's start-up) that ends a command where it lands. A
    BaseException, as KeyboardInterrupt is: no `except Exception` on the way (a decoder's, a file reader's,
    a library's) takes it for a failure of its own. `signum` is the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: the stop signals `stop` was called for in this process, in order
_stops: list[int] = []


def stop(signum: int) -> NoReturn:
    """What a handler that ends the command at once does: note `signum`, then raise Stopped. The note
    outlives the exception, which a library may still turn into an error of its own or drop: a handler that
    runs inside a C extension's start-up (torch._C's, while torch imports) raises into C++, and torch 1.13
    reports it as RuntimeError("Stopped: 15 At: ..."); on torch 2.x an extension's start-up clears it and
    the import goes on. `check_stop` after such a call, and `stop_received` before calling a failure the
    input's, find it."""
    _stops.append(signum)
    raise Stopped(signum)


def quiet_stops(previous: Any) -> Any:
    """A sys.unraisablehook for while `stop` handlers are on: a Stopped raised where Python cannot raise it
    (a destructor, a weakref callback, the import system's module-lock cleanup while PyTorch loads) would be
    printed as a traceback and dropped; it is dropped quietly, since `stop` noted it and the next `check_stop`
    ends the command in its one line. Anything else goes to `previous`."""
    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Stopped):
            previous(unraisable)
    return hook


def stop_received() -> int | None:
    """The first stop signal `stop` noted in this process, or None."""
    return _stops[0] if _stops else None


def check_stop() -> None:
    """Raise Stopped again for a stop signal that came (`stop`) but did not end the command: a library
    swallowed it or turned it into an error of its own. Call it after a library call that may have done so,
    and before taking an error for a bad file or image."""
    if _stops:
        raise Stopped(_stops[0])
