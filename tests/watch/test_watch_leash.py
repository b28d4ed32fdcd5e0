"""dlenv.watch.leash: the command `dlenv watch` starts never outlives the watcher.

Every signal the watcher can catch reaches the command's group, also one that comes while the command is
being started; a SIGKILL of the watcher ends the command (PR_SET_PDEATHSIG) and what it started (the
keeper). Each command carries a marker in its argv, and /proc is searched for it after the watcher is gone.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from dlenv.watch import leash, run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc: Linux")


def _alive_with(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(d.name))
    return found


def _gone(marker: str, within: float = 10.0) -> list[int]:
    end = time.monotonic() + within
    while (left := _alive_with(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)


def test_every_catchable_signal_is_forwarded_but_the_watchers_own():
    fwd = set(leash.forwarded_signals())
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM, signal.SIGTSTP, signal.SIGCONT, signal.SIGWINCH} <= fwd
    assert not fwd & {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGSEGV, signal.SIGPIPE}


# ---------------------------------------------------------------------------------------------------
# In this process: a signal at each moment of the start, delivered to the command's group


# sleep itself, not a shell that execs it: bash ignores SIGQUIT until its exec, so one that came in that moment
# was lost and the command slept its 30 s (a CI flake). No core file: see no_core.
SLEEPER = ["sleep", "30"]


@pytest.fixture
def no_core():
    """The command inherits a core-file limit of 0 (SIGQUIT's default action dumps one)."""
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, old)


def _at(moment: str, signum: int, monkeypatch):
    """Send `signum` to this process at `moment` of watch's start."""
    me = os.getpid()
    real_start, real_deliver = leash.start, leash.Forwarder.deliver
    if moment == "before the command starts":
        monkeypatch.setattr(leash, "start", lambda cmd: (os.kill(me, signum), real_start(cmd))[1])
    elif moment == "right after it starts, before forwarding":
        monkeypatch.setattr(leash, "start", lambda cmd: (real_start(cmd), os.kill(me, signum))[0])
    elif moment == "while its group is being given":
        def deliver(self, pid):
            os.kill(me, signum)  # taken by the handler before the pid is set: kept, then sent
            real_deliver(self, pid)
        monkeypatch.setattr(leash.Forwarder, "deliver", deliver)
    else:  # while it runs and is sampled
        threading.Timer(0.5, os.kill, (me, signum)).start()


MOMENTS = ["before the command starts", "right after it starts, before forwarding", "while its group is being given",
           "while it runs"]


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                                    signal.SIGUSR2], ids=lambda s: signal.Signals(s).name)
def test_a_signal_at_any_moment_of_the_start_reaches_the_command(tmp_path, monkeypatch, no_gpu, no_core, moment,
                                                                 signum):
    _at(moment, signum, monkeypatch)
    before = signal.getsignal(signum)
    t0 = time.monotonic()
    status = run.watch(SLEEPER, tmp_path, interval=0.1, say=lambda m: None)
    assert status == 128 + signum  # the command ended by that very signal, long before its 30 s
    assert time.monotonic() - t0 < 20
    assert signal.getsignal(signum) == before  # the watcher's own handler is back


# ---------------------------------------------------------------------------------------------------
# The watcher as users run it, in a process of its own


def _watcher(tmp_path: Path, command: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dlenv", "watch", "--interval", "0.2", "--", *command],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(marker: str, n: int, within: float = 30.0) -> None:
    end = time.monotonic() + within
    while len(_alive_with(marker)) < n:
        assert time.monotonic() < end, f"the command did not start {n} process(es)"
        time.sleep(0.05)


def _sleeper(marker: str) -> str:
    return f"{sys.executable} -c 'import time; time.sleep(120)' {marker}"


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["the command alone", "a shell and its children"])
def test_a_sigkill_of_the_watcher_ends_the_command_and_what_it_started(tmp_path, shape):
    marker = f"dlenv-leash-{uuid.uuid4().hex}"
    if shape == "the command alone":
        command, n = [sys.executable, "-c", "import time; time.sleep(120)", marker], 1
    else:  # a child in the background and one in front: neither is the watcher's own child
        command, n = ["bash", "-c", f"{_sleeper(marker)} & {_sleeper(marker)}; wait", marker], 3
    proc = _watcher(tmp_path, command)
    try:
        _wait_for(marker, n)
        proc.kill()  # timeout -k, the OOM killer: nothing of the watcher runs after this
        proc.wait(timeout=30)
        assert _gone(marker) == []
    finally:
        for pid in _alive_with(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.3, 2.0])
def test_a_sigterm_soon_after_start_leaves_nothing_behind(tmp_path, delay):
    marker = f"dlenv-leash-{uuid.uuid4().hex}"
    proc = _watcher(tmp_path, ["bash", "-c", f"{_sleeper(marker)}; true", marker])
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode in (143, -signal.SIGTERM), err  # passed on, or the watcher was not up yet
        assert "Traceback" not in err
        assert _gone(marker) == []
    finally:
        for pid in _alive_with(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
