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
