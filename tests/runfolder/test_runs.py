"""Run folder naming (exp, exp2, ..., exp3-2), the run lock and its file, and --resume auto."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dlenv import runfolder
from dlenv.errors import UserError


def test_names_increment_like_yolo(tmp_path):
    assert runfolder.new_run_dir(tmp_path, "exp").name == "exp"
    assert runfolder.new_run_dir(tmp_path, "exp").name == "exp2"
    assert runfolder.new_run_dir(tmp_path, "exp").name == "exp3"
    assert runfolder.new_run_dir(tmp_path, "exp", exist_ok=True).name == "exp"
    assert runfolder.new_run_dir(tmp_path, "other").name == "other"


@pytest.mark.parametrize("taken,asked,got", [
    # config.yaml records the folder a run got, so `--cfg runs/exp3/config.yaml` asks for exp3 again
    (["exp", "exp2", "exp3"], "exp3", "exp3-2"),
    (["exp3", "exp3-2"], "exp3", "exp3-3"),
    (["resnet50"], "resnet50", "resnet50-2"),
    ([], "exp3", "exp3"),                        # a free name is used as asked
    (["exp", "exp2", "exp3"], "exp", "exp4"),    # the plain series is unchanged
    (["exp3-2"], "exp3-2", "exp3-3"),
    (["v2a"], "v2a", "v2a2"),                    # only a trailing digit takes the dash
], ids=["cfg-of-exp3", "again", "digits-in-name", "free", "series", "dash-again", "inner-digit"])
def test_a_taken_name_ending_in_a_digit_goes_on_with_a_dash(tmp_path, taken, asked, got):
    for name in taken:
        (tmp_path / name).mkdir()
    assert runfolder.new_run_dir(tmp_path, asked).name == got


@pytest.mark.parametrize("name", ["a/b", "..", ""])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(UserError, match="--name"):
        runfolder.new_run_dir(tmp_path, name)


def test_resume_auto_is_the_newest_last_pth(tmp_path):
    with pytest.raises(UserError, match="no .*last.pth"):
        runfolder.find_resume("auto", tmp_path)
    for i, name in enumerate(["exp", "exp2", "zzz"]):
        (tmp_path / name).mkdir()
        f = tmp_path / name / "last.pth"
        f.write_bytes(b"x")
        t = time.time() - 100 + (50 if name == "exp2" else i)
        os.utime(f, (t, t))
    assert runfolder.find_resume("auto", tmp_path) == tmp_path / "exp2" / "last.pth"
    assert runfolder.find_resume(str(tmp_path / "exp"), tmp_path) == tmp_path / "exp" / "last.pth"
    with pytest.raises(UserError, match="no such run file"):
        runfolder.find_resume(str(tmp_path / "missing.pth"), tmp_path)


def test_a_locked_run_folder_refuses_another_process(tmp_path):
    import subprocess
    import sys

    run = runfolder.new_run_dir(tmp_path, "exp")
    lock = runfolder.lock_run_dir(run)
    assert runfolder.lock_run_dir(run) is lock  # again in this process: the same lock
    code = "import sys; from dlenv import runfolder; runfolder.lock_run_dir(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert r.returncode == 1 and f"is in use by another run (process {os.getpid()})" in r.stderr
    lock.release()
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_lock_goes_with_the_object_that_holds_it(tmp_path):
    run = runfolder.new_run_dir(tmp_path, "exp")
    lock = runfolder.lock_run_dir(run)
    fd = os.open(run / runfolder.LOCK_FILE, os.O_RDWR)  # opened while held, as a second run would
    try:
        del lock  # the trainer's local variable going out of scope at the end of a run
        assert not (run / runfolder.LOCK_FILE).exists()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: would raise if still held
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------
# The lock file: there while the run runs, gone when it ends, however it ends.


def test_release_removes_the_lock_file_and_a_second_release_is_harmless(tmp_path):
    run = runfolder.new_run_dir(tmp_path, "exp")
    with runfolder.lock_run_dir(run) as lock:
        assert (run / runfolder.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert not (run / runfolder.LOCK_FILE).exists()
    lock.release()
    again = runfolder.lock_run_dir(run)  # a released lock is not handed out again: a fresh one is taken
    assert again is not lock and (run / runfolder.LOCK_FILE).is_file()
    del again
    assert not (run / runfolder.LOCK_FILE).exists()


def test_release_never_removes_another_runs_lock_file(tmp_path):
    run = runfolder.new_run_dir(tmp_path, "exp")
    lock = runfolder.lock_run_dir(run)
    os.unlink(run / runfolder.LOCK_FILE)
    (run / runfolder.LOCK_FILE).write_text("12345\n")  # another run's file under the same name
    lock.release()
    assert (run / runfolder.LOCK_FILE).read_text() == "12345\n"


def test_a_run_that_opened_the_file_before_it_was_removed_takes_a_fresh_one(tmp_path, monkeypatch):
    """The race the removal opens: B opens the lock file, A releases (removes it), B gets the flock on
    the removed file. B must notice and lock the file now at that name, or a third run C could hold
    the new file at the same time."""
    run = runfolder.new_run_dir(tmp_path, "exp")
    stale = os.open(run / runfolder.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    os.unlink(run / runfolder.LOCK_FILE)  # what A's release does after B's open
    real_open, opened = os.open, []

    def first_open_is_stale(path, flags, mode=0o777):
        opened.append(path)
        return os.dup(stale) if len(opened) == 1 else real_open(path, flags, mode)

    monkeypatch.setattr(runfolder.os, "open", first_open_is_stale)
    lock = runfolder.lock_run_dir(run)
    monkeypatch.undo()
    os.close(stale)
    assert len(opened) == 2  # the stale file was let go and the name opened again
    fd = os.open(run / runfolder.LOCK_FILE, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # the file at the name is the one locked
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    lock.release()


_HOLDER = textwrap.dedent("""
    import os, signal, sys, time
    from dlenv import runfolder

    def stop(signum, frame):  # what the trainer's console.Stop turns SIGTERM into: an orderly end
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    # Ctrl-C as a terminal's Python has it: a job a shell started in the background (`cmd &`, as CI
    # runs) inherits SIGINT ignored, and Python then leaves it ignored, so the signal never arrived
    signal.signal(signal.SIGINT, signal.default_int_handler)
    lock = runfolder.lock_run_dir(sys.argv[1])
    print("locked", flush=True)
    how = sys.argv[2]
    if how == "error":
        raise RuntimeError("a step failed")
    if how == "exit":
        sys.exit(0)
    if how != "normal":
        time.sleep(600)  # until the signal
""")


@pytest.mark.parametrize("how,signum,code", [
    ("normal", None, 0),                   # the script ends holding it
    ("exit", None, 0),                     # sys.exit while held
    ("error", None, 1),                    # an exception ends the process, its traceback holding the lock
    ("wait", signal.SIGTERM, 143),         # docker stop: the handler ends the process in order
    ("wait", signal.SIGINT, -signal.SIGINT),  # Ctrl-C: KeyboardInterrupt, then Python ends by SIGINT
])
def test_the_lock_file_goes_when_the_process_ends(tmp_path, how, signum, code):
    run = runfolder.new_run_dir(tmp_path, "exp")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    if signum is not None:
        assert (run / runfolder.LOCK_FILE).read_text() == f"{proc.pid}\n"  # there while it runs
        proc.send_signal(signum)
    proc.communicate(timeout=60)  # a safety net: each case ends in well under a second
    assert proc.returncode == code
    assert not (run / runfolder.LOCK_FILE).exists()


def test_a_killed_run_leaves_its_file_but_no_lock(tmp_path):
    run = runfolder.new_run_dir(tmp_path, "exp")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run), "wait"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    proc.kill()
    proc.communicate(timeout=30)
    assert (run / runfolder.LOCK_FILE).is_file()  # SIGKILL: no code runs
    with runfolder.lock_run_dir(run):  # the kernel ended the flock: the next run takes it
        assert (run / runfolder.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert not (run / runfolder.LOCK_FILE).exists()


@pytest.mark.parametrize("end", ["done", "sigterm", "error"])
def test_the_trainer_keeps_the_file_while_it_runs_and_removes_it_at_the_end(tmp_path, data, tiny, end):
    from tinymodels import tiny_config

    from dlenv import train as train_mod

    lock_file = tmp_path / "runs" / "exp" / runfolder.LOCK_FILE
    seen = []

    def on_step(state):
        seen.append(lock_file.read_text() == f"{os.getpid()}\n")
        if end == "sigterm" and len(seen) == 2:
            signal.raise_signal(signal.SIGTERM)
        if end == "error" and len(seen) == 2:
            raise RuntimeError("a step failed")

    if end == "error":
        with pytest.raises(RuntimeError, match="a step failed"):
            train_mod.train(tiny_config(tmp_path, data), on_step=on_step)
    else:
        summary = train_mod.train(tiny_config(tmp_path, data), on_step=on_step)
        assert summary["exit_code"] == (143 if end == "sigterm" else 0)
    assert seen and all(seen)
    assert not lock_file.exists() and Path(lock_file.parent / "config.yaml").is_file()


# ---------------------------------------------------------------------------------------------------
# "The newest run" is the one that started last, as its config.yaml records (issue 52 item 5): a run unpacked
# with its files dated 2100 was what --weights best_model.pth and --resume auto took.

Y2100 = 4_102_444_800.0
NOW = time.time()


def _run(project: Path, name: str, started: object = None, mtime: float | None = None,
         config: bytes | None = None) -> Path:
    """project/name with last.pth and best_model.pth dated `mtime`, and a config.yaml recording `started`."""
    folder = project / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.yaml").write_bytes(config)
    elif started is not None:
        (folder / "config.yaml").write_text(f"# dlenv train: ...\n# started: {started}\nepochs: 1\n")
    for f in (runfolder.LAST, runfolder.BEST):
        (folder / f).write_bytes(b"x")
        if mtime is not None:
            os.utime(folder / f, (mtime, mtime))
    return folder


def test_the_newest_run_is_the_last_started_whatever_its_files_say(tmp_path):
    _run(tmp_path, "old", started=runfolder.started_note(NOW - 3600), mtime=Y2100)  # unpacked, dated 2100
    _run(tmp_path, "new", started=runfolder.started_note(NOW - 60), mtime=0)        # dated 1970
    _run(tmp_path, "mid", started=int(NOW - 600), mtime=NOW)
    path, line = runfolder.find_weights(runfolder.BEST, tmp_path)
    assert path == tmp_path / "new" / runfolder.BEST
    assert "(the newest run's of 3 runs, by the start its config.yaml records)" in line
    path, line = runfolder.find_resume_said("auto", tmp_path)
    assert path == tmp_path / "new" / runfolder.LAST and line.startswith(f"--resume auto: {path} ")
    assert runfolder.find_resume("auto", tmp_path) == path


#: (id, the run "odd" as made, whether it is chosen over "plain" (no config.yaml, file dated an hour ago),
#: what the line says)
ODD_RUNS = [
    ("no-config-future-file", dict(mtime=Y2100), False, "by file time: it has no readable config.yaml"),
    ("no-config-1970-file", dict(mtime=0.0), False, "by file time: it has no readable config.yaml"),
    ("no-config-newer-file", dict(mtime=NOW - 60), True, "by file time: it has no readable config.yaml"),
    ("recorded-start", dict(started=int(NOW - 60), mtime=0.0), True, "by the start its config.yaml records"),
    ("start-in-2100", dict(started=int(Y2100), mtime=Y2100), False, "by file time"),
    ("start-a-string", dict(started="yesterday", mtime=NOW), True, "its config.yaml's start 'yesterday' is not a time"),
    ("start-huge-int", dict(started="9" * 400, mtime=Y2100), False, "by file time"),
    ("start-negative", dict(started=-5, mtime=NOW), True, "its config.yaml's start '-5' is not a time"),
    ("start-float", dict(started="1.7e9", mtime=NOW), True, "is not a time"),
    ("start-zero", dict(started=0, mtime=NOW), True, "its config.yaml's start 1970-01-01 is before any run"),
    ("start-empty", dict(started="", mtime=NOW), True, "its config.yaml's start '' is not a time"),
    ("start-control-chars", dict(started="\x1b[2J", mtime=NOW), True, "'\\\\x1b[2J' is not a time"),
    ("start-far-down", dict(config=b"# x\n" * 20_000 + f"# started: {int(NOW)}\n".encode(), mtime=NOW), True,
     "records no start"),
    ("config-not-utf8", dict(config=b"# started: \xff\xfe\n", mtime=NOW), True, "is not a time"),
]


@pytest.mark.parametrize(("made", "chosen", "said"), [c[1:] for c in ODD_RUNS], ids=[c[0] for c in ODD_RUNS])
def test_a_run_without_a_plausible_start_falls_back_and_says_why(tmp_path, made, chosen, said):
    _run(tmp_path, "plain", mtime=NOW - 3600)
    _run(tmp_path, "odd", **made)
    path, line = runfolder.find_weights(runfolder.LAST, tmp_path)
    assert path.parent.name == ("odd" if chosen else "plain"), line
    assert "\n" not in line and "\x1b" not in line
    assert said in line, line
    if not chosen:  # the line gives the chosen run's reason; the one left out has its own
        t, why = runfolder.recorded_start(tmp_path / "odd")
        assert t is None and why


@pytest.mark.parametrize("kind", ["fifo", "folder", "link-to-proc"])
def test_a_config_yaml_that_is_no_regular_file_is_no_start(tmp_path, kind):
    folder = _run(tmp_path, "exp", mtime=NOW)
    cfg = folder / "config.yaml"
    {"fifo": lambda: os.mkfifo(cfg), "folder": cfg.mkdir,
     "link-to-proc": lambda: cfg.symlink_to("/proc/self/environ")}[kind]()
    assert runfolder.recorded_start(folder) == (None, "it has no readable config.yaml")  # and it did not block


def test_config_yaml_records_the_start_and_a_rewrite_keeps_it(tmp_path):
    from dlenv.runfolder import trainstate

    path = tmp_path / "config.yaml"
    trainstate.write_config_yaml(path, {"epochs": 1}, {"precision": "fp32"}, started=NOW - 100)
    assert runfolder.recorded_start(tmp_path)[0] == int(NOW - 100)
    trainstate.write_config_yaml(path, {"epochs": 2}, {"precision": "fp32"})  # a replan's rewrite
    assert runfolder.recorded_start(tmp_path)[0] == int(NOW - 100)
    assert trainstate.read_config_notes(path)["started"].startswith(f"{int(NOW - 100)} (")
    import yaml

    assert yaml.safe_load(path.read_text()) == {"epochs": 2}  # a comment: --cfg still reads the file
