"""bench-memory's worker processes: one measurement in a fresh Python process, stopped as a whole.

`run_worker` starts `python -m dlenv.bench.memory_worker` in a session and process group of its own (a
Ctrl-C in the terminal reaches the parent alone), its output unbuffered into a log as it comes, and ends
the whole group when the parent is interrupted (`Stop`, KeyboardInterrupt) or the worker runs past its
timeout. `stoppable` turns SIGTERM and SIGHUP into `Stop` while a bench runs. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from dlenv.errors import UserError
from dlenv.invocation import python_module

#: seconds a stopped worker's process group has after SIGTERM before SIGKILL
STOP_GRACE_S = 2.0


def _src_dir() -> str:
    import dlenv

    return str(Path(dlenv.__file__).resolve().parent.parent)


class Stop(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a bench (a KeyboardInterrupt, as Ctrl-C is: no library swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_group(proc: subprocess.Popen) -> None:
    """End a worker and everything it started: SIGTERM to its process group, SIGKILL after STOP_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):  # a grandchild that outlived its parent
        os.killpg(proc.pid, signal.SIGKILL)


def _exit_line(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = " (out of host memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
        return f"the worker was killed by {name}{why}"
    return f"the worker exited {code} without a result"


def run_worker(spec: dict[str, Any], alloc_conf: str | None = None, timeout: float | None = 3600,
               log: Path | None = None) -> dict:
    """Run one measurement in a fresh Python process and return its result dict.

    `alloc_conf` sets PYTORCH_CUDA_ALLOC_CONF for that process ("" unsets it; None keeps the
    user's). The worker's stdout and stderr go unbuffered to `log` (appended as they come; else
    discarded). It runs in a process group of its own: a KeyboardInterrupt here (Ctrl-C, `Stop`) ends
    that group before it propagates. A worker that dies gives {"status": "error", "error": one line}; a
    UserError in the worker (an unknown model, no GPU) is raised here.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_src_dir(), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # each step's line reaches the log as it is printed
    if alloc_conf is not None:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    fd, result_path = tempfile.mkstemp(prefix="dlenv-bench-", suffix=".json")
    os.close(fd)
    out = open(log, "ab", buffering=0) if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    if log is not None:  # which worker the lines below come from
        shown = {k: spec.get(k) for k in ("mode", "amp", "checkpoint", "channels_last") if k in spec}
        out.write(f"--- worker {json.dumps(shown)}\n".encode())
    try:
        cmd = [*python_module("dlenv.bench.memory_worker"), "--worker", json.dumps(spec), "--result", result_path]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return {"status": "error", "error": f"the worker took more than {timeout:.0f} s"}
        except BaseException:
            _stop_group(proc)
            raise
        text = Path(result_path).read_text(encoding="utf-8")
        result = json.loads(text) if text.strip() else None
    finally:
        Path(result_path).unlink(missing_ok=True)
        if log is not None:
            out.close()
    if result is None:
        return {"status": "error", "error": _exit_line(code) + (f"; its output is in {log}" if log else "")}
    if result.get("status") == "user_error":
        raise UserError(result["error"])
    return result


@contextlib.contextmanager
def stoppable():
    """SIGTERM and SIGHUP raise `Stop` in the main thread while the bench runs (Ctrl-C already raises
    KeyboardInterrupt): the running worker is ended and the tables of what was measured are written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Stop(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
