"""status.yaml: how a run ended, in one line, for `dlenv runs` and anyone reading the folder later.

The trainer's main process writes it (`recording`): `running` when the epochs start, then `finished`, `stopped`
with the line the console printed (it ends with "Resume with: ..."), or `failed` with the error's one line. It is
written atomically (dlenv.files.atomic), a few hundred bytes. A run killed without a word (SIGKILL, the host's
out-of-memory killer, a power cut) leaves `running` behind with no live lock: `read_status` reads that as
what it is. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, printable
from dlenv.files import safeio
from dlenv.files.atomic import write_text
from dlenv.runfolder import LOCK_FILE

STATUS = "status.yaml"
#: the statuses a run records
STATES = ("running", "finished", "stopped", "failed")
#: the longest line kept (an error's first line, cut)
LINE_CHARS = 400


def write_status(run_dir: str | Path, status: str, line: str = "") -> None:
    """Record `status` (one of STATES) and its one line in run_dir/status.yaml, atomically."""
    import json  # a JSON string is a YAML string: quoted, escaped, one line

    one = printable(str(line).strip().splitlines()[0] if str(line).strip() else "")[:LINE_CHARS]
    write_text(Path(run_dir) / STATUS, f"status: {status}\nline: {json.dumps(one)}\n"
                                       f"time: {int(time.time())}\n")


@contextlib.contextmanager
def recording(run_dir: str | Path | None, resume_line: Callable[[], str]) -> Iterator[dict[str, Any]]:
    """Around a run's epochs: `running` first, then how they ended. The block puts the summary it got in the
    dict yielded (key "summary": status "done" is finished, else stopped with its "line"). An exception is
    `failed` with its one line; a BaseException that is no error (Ctrl-C reaching here) is `stopped` with
    `resume_line()`. `run_dir` None (another rank) records nothing. A status that cannot be written (a full
    disk) never ends the run."""
    if run_dir is None:
        yield {}
        return
    got: dict[str, Any] = {}
    _write_quietly(run_dir, "running")
    try:
        yield got
    except Exception as e:
        what = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        _write_quietly(run_dir, "failed", what)
        raise
    except BaseException as e:
        _write_quietly(run_dir, "stopped", f"{type(e).__name__}. {resume_line()}")
        raise
    summary = got.get("summary") or {}
    if summary.get("status") == "done":
        _write_quietly(run_dir, "finished")
    else:
        _write_quietly(run_dir, "stopped", summary.get("line") or resume_line())


def _write_quietly(run_dir: str | Path, status: str, line: str = "") -> None:
    with contextlib.suppress(OSError):
        write_status(run_dir, status, line)


def read_status(run_dir: str | Path, data: dict[str, Any]) -> tuple[str, str] | None:
    """(status, line) from status.yaml's parsed `data`, or None when it holds no known status; `running` with no
    live lock on the folder is `failed`, ended without a word."""
    status, line = data.get("status"), data.get("line")
    if status not in STATES:
        return None
    line = printable(line)[:LINE_CHARS] if isinstance(line, str) else ""
    if status == "running" and not lock_held(Path(run_dir)):
        return "failed", ("ended without a word (killed: SIGKILL, the host's out-of-memory killer or a power cut); "
                          "its last save is in last.pth")
    return status, line


def lock_held(run_dir: Path) -> bool:
    """Whether a process holds the run folder's lock now (dlenv.runfolder.lock_run_dir), judged from the
    kernel's /proc/locks without taking the lock (a reader that took it, even for a moment, could turn a
    run starting that moment away). False without /proc."""
    try:
        st = os.lstat(run_dir / LOCK_FILE)
        with open("/proc/locks", "rb") as fh:  # a kernel file (safeio refuses those): read bounded
            text = fh.read(16 * safeio.MIB).decode("ascii", "replace")
    except OSError:
        return False
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(f" {key} " in f" {ln} " and "FLOCK" in ln for ln in text.splitlines())
