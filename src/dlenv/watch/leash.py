"""The command `dlenv watch` starts dies with it, whatever ends the watcher. No torch here.

Three parts, each for what the others cannot reach:
- `forwarding`: every signal the watcher can catch (TERM, INT, HUP, QUIT, USR1, USR2, ALRM, TSTP, CONT,
  the real-time ones, ...) is passed on to the command's whole process group. Its handlers are in place
  before the command starts: a signal that comes while it is being started is kept and passed on as soon
  as there is a group to send it to.
- `start`: the command's own process gets PR_SET_PDEATHSIG(SIGKILL) between fork and exec (Linux), so a
  SIGKILL of the watcher (`timeout -k`, the OOM killer) ends it too; a watcher gone before that call is
  seen through getppid and the command is not run.
- `Keeper`: a small process outside both groups, ignoring every signal, holding a pipe from the watcher.
  The pipe closes when the watcher ends; unless the watcher said the command had ended, it SIGKILLs the
  command's process group: the processes the command started (a shell's children, DataLoader workers),
  which PR_SET_PDEATHSIG does not reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1

#: signals that are the watcher's own business: it cannot catch them (KILL, STOP), they say a child of its
#: own changed (CHLD), they are faults of its own code (SEGV ...), or Python ignores them (PIPE, XFSZ:
#: a write then fails with an OSError instead)
_NOT_FORWARDED = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE",
                                               "SIGILL", "SIGABRT", "SIGSYS", "SIGTRAP", "SIGPIPE", "SIGXFSZ")
                  if hasattr(signal, n)}


def forwarded_signals() -> list[int]:
    """The signals the watcher passes on to the command's group."""
    return sorted(int(s) for s in signal.valid_signals() if s not in _NOT_FORWARDED)


class Forwarder:
    """Signal handlers that pass each signal on to the process group of `pid` once it is set, and keep
    those that come before it is (`deliver` sends them)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen.append(signum)
        if self.pid is None:
            self.pending.append(signum)
        else:
            self._send(signum)

    def deliver(self, pid: int) -> None:
        self.pid = pid  # from here on the handler sends at once; what came before is sent below
        while self.pending:
            self._send(self.pending.pop(0))

    def _send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)


@contextlib.contextmanager
def forwarding() -> Iterator[Forwarder]:
    """Install a Forwarder for every forwarded signal (main thread only), and restore the old handlers
    after. Yields the Forwarder: call `deliver(pid)` once the command has started."""
    fwd = Forwarder()
    if threading.current_thread() is not threading.main_thread():
        yield fwd
        return
    old: dict[int, Any] = {}
    try:
        for s in forwarded_signals():
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # one the C library keeps for itself
                old[s] = signal.signal(s, fwd)
        yield fwd
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def _dies_with(parent: int, prctl: Callable[..., int]) -> Callable[[], None]:
    """The function run in the child between fork and exec: resolved here, in the parent, so that the child
    only calls into libc (no import, no allocation worth a lock)."""
    kill, getppid, getpid, sigkill = os.kill, os.getppid, os.getpid, int(signal.SIGKILL)

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if getppid() != parent:  # the watcher died before the line above: nothing to tie to
            kill(getpid(), sigkill)

    return setup


def start(command: Sequence[str]) -> subprocess.Popen:
    """Start `command` in a session and process group of its own (so that a terminal's Ctrl-C reaches it
    once, through the watcher, and the watcher can signal all of it), tied to the watcher's life.
    Raises OSError as Popen does."""
    prctl = _prctl()
    setup = _dies_with(os.getpid(), prctl) if prctl else None
    return subprocess.Popen(list(command), start_new_session=True, preexec_fn=setup)


#: the keeper: reads the command's group, then waits for one byte (the command ended) or the end of the
#: pipe (the watcher ended first), and in the second case kills the group
_KEEPER = """
import os, signal, sys
for s in signal.valid_signals():
    if s not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (OSError, ValueError, RuntimeError):
            pass
line = sys.stdin.buffer.readline()
if line.strip().isdigit() and not sys.stdin.buffer.read(1):
    try:
        os.killpg(int(line), signal.SIGKILL)
    except OSError:
        pass
"""


class Keeper:
    """The keeper process of one command's group; `None`-safe: it does nothing where it could not start."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        with contextlib.suppress(OSError):
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _KEEPER], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)

    def hold(self, pgid: int) -> None:
        """Tell the keeper the group to end if the watcher goes first."""
        self._write(f"{pgid}\n".encode())

    def release(self) -> None:
        """The command has ended: the keeper leaves its group alone and exits."""
        self._write(b"x")
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def _write(self, data: bytes) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError:  # it is gone (killed by hand): the command still has its PR_SET_PDEATHSIG
            self.proc = None
