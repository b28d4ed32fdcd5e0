"""dlenv.files.requirements: a project's requirements.txt held against this Python (verify-env's `packages` line),
and a model file's missing import pointed at requirements.txt (dlenv.model.usermodel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv import envcheck
from dlenv.envcheck import Facts
from dlenv.errors import UserError
from dlenv.files import requirements
from dlenv.files.requirements import Judged, judge_line, judged, missing_module_hint, summary

SRC = Path(__file__).resolve().parents[2] / "src"
MISSING = "no-such-dist-for-dlenv-tests"


@pytest.mark.parametrize("line, state", [
    ("packaging", "ok"), ("packaging>=20", "ok"), ("Packaging >= 20, < 1000", "ok"), ("packaging[extra]>=20", "ok"),
    ("packaging>=20 --hash=sha256:abc", "ok"), ("packaging @ https://example.invalid/p.whl", "ok"),
    ("packaging<1", "version"), ("packaging==0.1", "version"),
    (MISSING, "missing"), (f"{MISSING}>=1", "missing"), (f"{MISSING} @ https://example.invalid/x.whl", "missing"),
    (f'{MISSING}; python_version < "3"', "skipped"), ('packaging<1; sys_platform == "nonesuch"', "skipped"),
    ("-r other.txt", "unchecked"), ("-e .", "unchecked"), ("--index-url https://example.invalid", "unchecked"),
    ("./vendor/pkg", "unchecked"), ("git+https://example.invalid/x.git", "unchecked"), ("numpy>=>1", "unchecked"),
    ("!!!", "unchecked"),
])
def test_each_line_is_judged_as_pip_reads_it(line, state):
    assert judge_line(line).state == state


def test_the_file_is_read_as_pip_does(tmp_path):
    (tmp_path / "requirements.txt").write_text(f"# a comment\n\npackaging>=20  # ours\n{MISSING} \\\n  >=1\n"
                                               "-r dev.txt\n")
    got = judged(tmp_path)
    assert [(j.name, j.state) for j in got] == [("packaging", "ok"), (MISSING, "missing"), (None, "unchecked")]
    assert judged(tmp_path / "nowhere") is None


@pytest.mark.parametrize("make, says", [
    ("folder", "not a regular file"), ("big", "bytes"), ("binary", "is not UTF-8 text"), ("fifo", "not a regular"),
])
def test_a_requirements_file_that_is_no_small_text_file_is_one_line(tmp_path, make, says):
    path = tmp_path / "requirements.txt"
    if make == "folder":
        path.mkdir()
    elif make == "big":
        path.write_text("packaging\n" * 30_000)
    elif make == "binary":
        path.write_bytes(b"\xff\xfe\x00numpy")
    else:
        os.mkfifo(path)
    with pytest.raises(UserError) as e:
        judged(tmp_path)
    assert "\n" not in str(e.value)
    assert says in str(e.value) or make in ("folder", "fifo"), str(e.value)


def test_lines_past_the_limit_are_not_judged(tmp_path):
    (tmp_path / "requirements.txt").write_text("packaging\n" * (requirements.MAX_LINES + 50))
    assert len(judged(tmp_path)) == requirements.MAX_LINES


@pytest.mark.parametrize("results, status, words", [
    ([Judged("packaging", "packaging", "ok", "24")], "ok", "requirements.txt: 1 of 1 installed"),
    ([Judged("a", "a", "ok", "1"), Judged("einops", "einops", "missing")], "warn",
     "requirements.txt: 1 of 2 installed; missing: einops"),
    ([Judged("torch==0.1", "torch", "version", "2.1")], "warn", "another version: torch 2.1 (wants torch==0.1)"),
    ([Judged("a", "a", "ok", "1"), Judged("-r x.txt", None, "unchecked")], "ok", "1 line not checked"),
    ([Judged("b; x", "b", "skipped")], "ok", "0 of 0 installed"),
])
def test_summary(results, status, words):
    got, line, fix = summary(results)
    assert got == status and words in line and ("pip install -r requirements.txt" in fix) == (status == "warn")


def _facts(met) -> Facts:
    return Facts(versions={"dlenv": "0", "python": "3.10"}, requirements_met=met, disk_free=10**12, cpus=2)


@pytest.mark.parametrize("met, status", [
    (None, None), ([Judged("x", "x", "ok", "1")], "ok"), ([Judged("einops", "einops", "missing")], "warn"),
    ([{"line": "einops", "name": "einops", "state": "missing", "installed": None}], "warn"),  # from JSON
    ("requirements.txt is not UTF-8 text", "warn"),
])
def test_verify_env_has_one_packages_line(met, status):
    lines = [c for c in envcheck.checks(_facts(met), allow_cpu=True) if c.name == "packages"]
    assert [c.status for c in lines] == ([status] if status else [])


def test_verify_env_in_a_project_folder_names_what_is_missing(tmp_path):
    (tmp_path / "requirements.txt").write_text(f"packaging\n{MISSING}>=1\n")
    r = subprocess.run([sys.executable, "-m", "dlenv", "verify-env", "--allow-cpu"], cwd=tmp_path, text=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    line = next(x for x in r.stdout.splitlines() if x.startswith("warn  packages"))
    assert f"requirements.txt: 1 of 2 installed; missing: {MISSING}" in line, r.stdout
    assert "-> pip install -r requirements.txt" in r.stdout


@pytest.mark.parametrize("text, says", [
    (None, "add einops to a requirements.txt beside your scripts"),
    ("numpy\n", "add einops to requirements.txt (it does not list it)"),
    ("einops>=0.6\n", "requirements.txt lists einops (einops>=0.6) but it is not installed"),
    ("Einops\n", "requirements.txt lists einops (Einops) but it is not installed"),
    ("\xff", "add einops to a requirements.txt"),  # unreadable: the hint never raises
])
def test_missing_module_hint(tmp_path, text, says):
    if text is not None:
        (tmp_path / "requirements.txt").write_bytes(text.encode("latin-1"))
    assert says in missing_module_hint("einops", tmp_path)


@pytest.mark.parametrize("module, dist", [("cv2", "opencv-python"), ("PIL.Image", "Pillow"),
                                          ("sklearn", "scikit-learn"), ("yaml", "PyYAML"),
                                          ("einops.layers.torch", "einops")])
def test_a_module_is_named_by_its_distribution(tmp_path, module, dist):
    assert f"add {dist} to" in missing_module_hint(module, tmp_path)


@pytest.mark.parametrize("listed, says", [(False, "add no_such_module_for_dlenv to requirements.txt"),
                                          (True, "requirements.txt lists no_such_module_for_dlenv")])
def test_a_model_file_missing_an_import_points_at_requirements(project, listed, says):
    from dlenv.model import usermodel

    (project / "models" / "needs.py").write_text("import no_such_module_for_dlenv\n\ndef build(n):\n    pass\n")
    (project / "requirements.txt").write_text("no_such_module_for_dlenv>=1\n" if listed else "numpy\n")
    with pytest.raises(UserError) as e:
        usermodel.load(usermodel.parse_reference("models/needs.py:build"))
    assert "ModuleNotFoundError" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)
