"""dlenv.invocation: the resume hint names the command the user actually ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv import cli, invocation

CASES = [  # (sys.argv[0], the script passed its own verb, what to suggest)
    ("/opt/conda/envs/dl/bin/dlenv", False, "dlenv train"),
    ("/opt/conda/envs/dl/bin/invoke", False, "invoke train"),
    ("/usr/lib/python3/site-packages/invoke/__main__.py", False, "invoke train"),
    # python -m dlenv is told the dlenv command: the working folder can stand in for a package run with -m
    ("/opt/dlenv/src/dlenv/__main__.py", False, "dlenv train"),
    ("/opt/dlenv/src/dlenv/cli.py", False, "dlenv train"),
    ("train.py", True, "python train.py"),
    ("my project/train.py", True, "python 'my project/train.py'"),
    ("tools/run.py", False, "python tools/run.py train"),
]


@pytest.mark.parametrize("argv0, picks, want", CASES)
def test_describe(argv0, picks, want):
    assert invocation.describe("train", argv0, picks) == want


def test_again_defaults_to_the_dlenv_command(monkeypatch):
    monkeypatch.delenv(invocation.ENV, raising=False)
    assert invocation.again("train", "--resume r/last.pth") == "dlenv train --resume r/last.pth"
    monkeypatch.setenv(invocation.ENV, "python train.py")
    assert invocation.again("train", "--resume r/last.pth") == "python train.py --resume r/last.pth"


def test_a_torchrun_worker_keeps_what_its_launcher_recorded(monkeypatch):
    monkeypatch.setenv(invocation.ENV, "invoke train")
    monkeypatch.setenv("LOCAL_RANK", "1")
    invocation.remember("train", "/x/dlenv/cli.py")  # the worker's own command line is dlenv's internal one
    assert os.environ[invocation.ENV] == "invoke train"
    monkeypatch.delenv("LOCAL_RANK")
    invocation.remember("train", "/x/bin/dlenv")
    assert os.environ[invocation.ENV] == "dlenv train"


@pytest.mark.parametrize("argv, argv0, want", [
    (None, "/venv/bin/dlenv", "dlenv plot"),          # the console script parses sys.argv itself
    (["plot"], "train.py", "python train.py"),       # a project script that passes its own verb
])
def test_the_cli_remembers_how_it_was_started(tmp_path, monkeypatch, argv, argv0, want):
    monkeypatch.setattr("sys.argv", [argv0, "plot"])
    monkeypatch.setattr(cli, "run_command", lambda name, given, yaml_file=None: 0)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 0
    assert os.environ[invocation.ENV] == want


def test_the_invoke_tasks_remember_invoke(monkeypatch):
    from invoke import Context

    from dlenv import tasks

    seen = {}

    def fake_run(name, given, yaml_file=None):
        seen["command"] = os.environ[invocation.ENV]
        return 0

    monkeypatch.setattr(tasks, "run_command", fake_run)
    monkeypatch.setattr("sys.argv", ["/venv/bin/python", "-c"])  # whatever started the process
    tasks.ns["plot"](Context())
    assert seen["command"] == "invoke plot"


@pytest.mark.parametrize("used,want", [
    ("invoke train", "invoke val --weights w.pth"), ("dlenv train", "dlenv val --weights w.pth"),
    ("python -m dlenv train", "dlenv val --weights w.pth"),  # recorded by an older dlenv
    ("python train.py", "dlenv val --weights w.pth"),  # a script of one verb cannot validate: the CLI can
    (None, "dlenv val --weights w.pth"),
])
def test_the_next_command_goes_through_the_same_front_door(monkeypatch, used, want):
    if used is None:
        monkeypatch.delenv(invocation.ENV, raising=False)
    else:
        monkeypatch.setenv(invocation.ENV, used)
    assert invocation.command("val", "--weights w.pth") == want


# ---------------------------------------------------------------------------------------------------
# `python -m` puts the working folder first on sys.path (issue 43): what lies there must not run.

PAYLOAD = "open(__import__('os').path.join(__import__('os').path.dirname(__file__), 'RAN'), 'w').write('x')\n"
CONSOLE = Path(sys.executable).parent / "dlenv"
SAFE_M = [sys.executable, "-P" if sys.version_info >= (3, 11) else "-I", "-m", "dlenv"]  # as the README says


def _plant(folder: Path, rel: str) -> Path:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PAYLOAD)
    return path.parent / "RAN" if rel.endswith("__init__.py") else folder / "RAN"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([*argv, "--version"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("planted", ["argparse.py", "yaml/__init__.py", "json/__init__.py", "typing.py",
                                     "numpy.py", "shlex.pyc"])
def test_python_m_refuses_a_folder_whose_modules_stand_in_for_real_ones(tmp_path, planted):
    ran = _plant(tmp_path, planted)
    if planted.endswith(".pyc"):  # a sourceless module: bytecode of the payload
        import py_compile

        src = tmp_path / "shlex_src.py"
        src.write_text(PAYLOAD)
        py_compile.compile(str(src), cfile=str(tmp_path / planted))
        src.unlink()
    r = _run([sys.executable, "-m", "dlenv"], tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert planted.split("/")[0].rsplit(".", 1)[0] in lines[0] and "dlenv VERB" in lines[0]
    assert not ran.exists()
    for argv in ([str(CONSOLE)], SAFE_M):  # the documented commands never look there: they run, and it does not
        r = _run(argv, tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("dlenv "), r.stderr
        assert not ran.exists()


def test_a_dlenv_package_in_the_working_folder_never_runs_through_the_documented_commands(tmp_path):
    """Plain `python -m dlenv` would import it (nothing of ours runs before it): the docs and every hint
    therefore name the commands below, which leave the working folder out."""
    ran = _plant(tmp_path, "dlenv/__init__.py")
    (tmp_path / "dlenv" / "__main__.py").write_text(PAYLOAD)
    for argv in ([str(CONSOLE)], SAFE_M):
        r = _run(argv, tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("dlenv "), r.stderr
        assert not ran.exists()


@pytest.mark.parametrize("planted", ["train.py", "utils/__init__.py", "models/net.py", "a-b.py", "data/x.py"])
def test_python_m_runs_in_a_project_folder_of_its_own(tmp_path, planted):
    """A project's own modules (the workspace template's train.py, utils/) take no other's place: it runs,
    without the working folder on sys.path (as the dlenv command)."""
    _plant(tmp_path, planted)
    r = _run([sys.executable, "-m", "dlenv"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("dlenv "), r.stderr
    assert not list(tmp_path.rglob("RAN"))


@pytest.mark.parametrize("shadow", ["dlenv/__init__.py", "argparse.py", "json.py"])
def test_a_child_module_start_does_not_run_the_working_folders_code(tmp_path, shadow):
    """dlenv starts children (bench-memory's workers, JupyterLab) as `python -m` would, but not from the
    working folder: an archive unpacked there with a `dlenv/` package or an `argparse.py` does not run."""
    import subprocess
    import sys

    from dlenv.invocation import python_module

    (tmp_path / shadow).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / shadow).write_text("open('RAN', 'w').write('shadow')\nraise SystemExit(7)\n")
    r = subprocess.run([*python_module("dlenv.options.helptext"), "--x"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "RAN").exists()
    plain = subprocess.run([sys.executable, "-m", "dlenv.options.helptext"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    if shadow.startswith("dlenv"):  # `python -m` would have run it: what the helper avoids
        assert (tmp_path / "RAN").exists() or plain.returncode == 7
