"""dlenv.invocation: the resume hint names the command the user actually ran."""

from __future__ import annotations

import os

import pytest

from dlenv import cli, invocation

CASES = [  # (sys.argv[0], the script passed its own verb, what to suggest)
    ("/opt/conda/envs/dl/bin/dlenv", False, "dlenv train"),
    ("/opt/conda/envs/dl/bin/invoke", False, "invoke train"),
    ("/usr/lib/python3/site-packages/invoke/__main__.py", False, "invoke train"),
    ("/opt/dlenv/src/dlenv/__main__.py", False, "python -m dlenv train"),
    ("/opt/dlenv/src/dlenv/cli.py", False, "python -m dlenv.cli train"),
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
    ("python -m dlenv train", "python -m dlenv val --weights w.pth"),
    ("python train.py", "dlenv val --weights w.pth"),  # a script of one verb cannot validate: the CLI can
    (None, "dlenv val --weights w.pth"),
])
def test_the_next_command_goes_through_the_same_front_door(monkeypatch, used, want):
    if used is None:
        monkeypatch.delenv(invocation.ENV, raising=False)
    else:
        monkeypatch.setenv(invocation.ENV, used)
    assert invocation.command("val", "--weights w.pth") == want
