"""Run folder naming (exp, exp2, ...) and --resume auto."""

from __future__ import annotations

import os
import time

import pytest

from dlenv import runs
from dlenv.errors import UserError


def test_names_increment_like_yolo(tmp_path):
    assert runs.new_run_dir(tmp_path, "exp").name == "exp"
    assert runs.new_run_dir(tmp_path, "exp").name == "exp2"
    assert runs.new_run_dir(tmp_path, "exp").name == "exp3"
    assert runs.new_run_dir(tmp_path, "exp", exist_ok=True).name == "exp"
    assert runs.new_run_dir(tmp_path, "other").name == "other"


@pytest.mark.parametrize("name", ["a/b", "..", ""])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(UserError, match="--name"):
        runs.new_run_dir(tmp_path, name)


def test_resume_auto_is_the_newest_last_pth(tmp_path):
    with pytest.raises(UserError, match="no .*last.pth"):
        runs.find_resume("auto", tmp_path)
    for i, name in enumerate(["exp", "exp2", "zzz"]):
        (tmp_path / name).mkdir()
        f = tmp_path / name / "last.pth"
        f.write_bytes(b"x")
        t = time.time() - 100 + (50 if name == "exp2" else i)
        os.utime(f, (t, t))
    assert runs.find_resume("auto", tmp_path) == tmp_path / "exp2" / "last.pth"
    assert runs.find_resume(str(tmp_path / "exp"), tmp_path) == tmp_path / "exp" / "last.pth"
    with pytest.raises(UserError, match="no such checkpoint"):
        runs.find_resume(str(tmp_path / "missing.pth"), tmp_path)


def test_a_locked_run_folder_refuses_another_process(tmp_path):
    import subprocess
    import sys

    run = runs.new_run_dir(tmp_path, "exp")
    lock = runs.lock_run_dir(run)
    assert runs.lock_run_dir(run) is lock  # again in this process: the same lock
    code = "import sys; from dlenv import runs; runs.lock_run_dir(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert r.returncode == 1 and f"is in use by another run (process {os.getpid()})" in r.stderr
    lock.release()
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_lock_goes_with_the_object_that_holds_it(tmp_path):
    import fcntl

    run = runs.new_run_dir(tmp_path, "exp")
    lock = runs.lock_run_dir(run)
    del lock  # the trainer's local variable going out of scope at the end of a run
    fd = os.open(run / runs.LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: would raise if still held
    finally:
        os.close(fd)
