"""scripts/tools/setup-cpu.sh keeps invoke's reach inside the clone: no ~/.invoke.yaml, other projects keep theirs.

The script, sourced, only defines its functions; `set_up_invoke` (its last step, without the PyTorch
download) runs here with HOME in a temporary folder. Then, with a venv active as `. .venv/bin/activate`
makes it (this lane's venv stands in for .venv), `invoke hello` runs another project's own tasks.py
and `invoke --list` in the clone lists dlenv's verbs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tools" / "setup-cpu.sh"
VENV = Path(sys.prefix)
#: what an earlier setup-cpu.sh wrote (dlenv.invocation.set_up_invoke), for a clone at /home/u/dlenv
OLD = ("# written by dlenv (scripts/setup-cpu.sh): `invoke VERB` finds dlenv's tasks from any folder;\n"
       "# your own tasks: invoke -r . TASK\n"
       "tasks:\n  search_root: /home/u/dlenv/src/dlenv/invokeroot\n")


def _env(home: Path) -> dict[str, str]:
    """The environment of a user whose home is `home`, with no venv active and no dlenv on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "DLENV_COMMAND")}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != VENV / "bin")
    return env


def _set_up_invoke(home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), "-c", f'. "{SCRIPT}" && set_up_invoke'], env=_env(home),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("before,after,says", [
    (None, None, None),                                           # nothing there: nothing written
    (OLD, None, "removed"),                                       # what an earlier setup-cpu.sh wrote
    (OLD.replace("\n", "\r\n"), OLD.replace("\n", "\r\n"), "take that setting out"),  # not ours byte for byte
    ("run:\n  echo: true\n", "run:\n  echo: true\n", None),       # the user's own
    (OLD + "run:\n  echo: true\n", OLD + "run:\n  echo: true\n", "take that setting out"),  # ours, edited
], ids=["none", "earlier-setup", "crlf", "users-own", "edited"])
def test_set_up_invoke_writes_no_global_invoke_config(tmp_path, before, after, says):
    config = tmp_path / ".invoke.yaml"
    if before is not None:
        config.write_bytes(before.encode())
    r = _set_up_invoke(tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (config.read_bytes().decode() if config.exists() else None) == after
    assert [p.name for p in tmp_path.iterdir()] == ([".invoke.yaml"] if after is not None else [])
    lines = r.stdout.splitlines()
    assert len(lines) == (2 if says else 1) and (says is None or says in lines[0])
    assert "dlenv VERB` works from any folder" in lines[-1]


def test_the_script_no_longer_calls_the_global_set_up():
    text = SCRIPT.read_text()
    assert "dlenv.invocation" not in text and "\n  set_up_invoke\n" in text  # main's last step is the local one


@pytest.mark.skipif(not (VENV / "bin" / "activate").is_file() or not (VENV / "bin" / "invoke").is_file(),
                    reason="this Python is not a venv with invoke installed")
def test_with_the_venv_active_other_projects_keep_their_tasks_and_the_clone_has_dlenvs(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert _set_up_invoke(home).returncode == 0
    other = tmp_path / "other-project"
    other.mkdir()
    (other / "tasks.py").write_text("from invoke import task\n\n\n@task\ndef hello(c):\n    print('hello from mine')\n")

    def active(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([shutil.which("bash"), "-c", f'. "{VENV}/bin/activate" && {cmd}'], cwd=cwd,
                              env=_env(home), capture_output=True, text=True, timeout=120)

    r = active("invoke hello", other)
    assert r.returncode == 0 and r.stdout == "hello from mine\n", r.stdout + r.stderr
    r = active("invoke --list", ROOT)  # the clone's tasks.py: dlenv's verbs
    assert r.returncode == 0 and "train" in r.stdout and "verify-env" in r.stdout, r.stdout + r.stderr
    assert not (home / ".invoke.yaml").exists()
