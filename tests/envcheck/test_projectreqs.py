"""A project's requirements.txt (issue 44 item 2), simulated on the host: scripts/tools/entrypoint.sh as the image
runs it installs the file once into PYTHONUSERBASE (a folder of the workspace) under the profile's PyTorch
pins, from a folder of wheels made here (no network), again only when the file changes; a requirement
that would replace torch or NumPy is one line naming it and the modern profile; verify-env reports it.
tests/container/test_requirements_image.py runs the same through real `docker run`.

pip's user scheme does not work inside a virtual environment, and the test lanes are ones: the installs
run on the lane's base interpreter with the lane's site-packages on PYTHONPATH, so that pip sees the same
torch and NumPy installed, as the image's interpreter does (its env is no venv).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from dockerfile import ROOT
from wheelmaker import make_wheel

from dlenv.envcheck import checks
from dlenv.envcheck.facts import Facts
from dlenv.envcheck.projectreqs import (
    CONSTRAINTS,
    FAILED,
    STAMP,
    Status,
    constraint_lines,
    direct_conflicts,
    file_hash,
    pip_failure_line,
    protected_versions,
    status,
)

ENTRYPOINT = ROOT / "scripts" / "tools" / "entrypoint.sh"


def base_python() -> Path:
    """This lane's interpreter outside its venv (pip --user refuses to run inside one)."""
    if sys.prefix == sys.base_prefix:
        return Path(sys.executable)
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not exe.is_file():
        pytest.skip(f"no base interpreter at {exe}")
    return exe


@pytest.fixture
def project(tmp_path):
    """A workspace, a folder of wheels and the environment the entrypoint runs with (image-like)."""
    ws, wheels, bin_dir = tmp_path / "ws", tmp_path / "wheels", tmp_path / "bin"
    ws.mkdir()
    bin_dir.mkdir()
    make_wheel(wheels, "dlenvtiny", code="VALUE = 1\n")
    make_wheel(wheels, "dlenvtwo", code="VALUE = 2\n")
    make_wheel(wheels, "needsnewtorch", requires=("torch>=99",))
    (bin_dir / "python").symlink_to(base_python())  # `python` on PATH, as in the image
    base = ws / ".dlenv" / "cu11.6"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUSERBASE": str(base),
           "DLENV_WORKSPACE": str(ws), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([sysconfig.get_paths()["purelib"], str(ROOT / "src")])}
    env.pop("PIP_CONSTRAINT", None)
    return ws, base, env


def start(env: dict, *command: str) -> subprocess.CompletedProcess:
    """One container start: the entrypoint, then `command` (a Python line)."""
    return subprocess.run(["bash", str(ENTRYPOINT), "python", "-c", *command], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_the_entrypoint_installs_once_and_again_only_when_the_file_changes(project):
    ws, base, env = project
    (ws / "requirements.txt").write_text("# the project's own\ndlenvtiny==1.0\n")
    first = start(env, "import dlenvtiny; print(dlenvtiny.VALUE)")
    assert first.returncode == 0 and first.stdout.strip() == "1", first.stderr
    assert "installing" in first.stderr and "installed (dlenvtiny-1.0)" in first.stderr
    site = base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert (site / "dlenvtiny" / "__init__.py").is_file()  # in the workspace, not the env
    assert (base / STAMP).read_text().strip() == file_hash(ws / "requirements.txt")
    pins = (base / CONSTRAINTS).read_text().splitlines()
    assert pins == constraint_lines(protected_versions()) and any(p.startswith("torch==") for p in pins)
    assert status(ws, base).state == "installed"

    log = (base / "requirements.log").stat().st_mtime_ns
    again = start(env, "import dlenvtiny; print(dlenvtiny.VALUE)")  # a new container, the same file
    assert again.returncode == 0 and again.stdout.strip() == "1" and again.stderr == ""
    assert (base / "requirements.log").stat().st_mtime_ns == log  # pip did not run

    (ws / "requirements.txt").write_text("dlenvtiny==1.0\ndlenvtwo\n")
    assert status(ws, base).state == "out-of-date"
    changed = start(env, "import dlenvtiny, dlenvtwo; print(dlenvtiny.VALUE + dlenvtwo.VALUE)")
    assert changed.returncode == 0 and changed.stdout.strip() == "3", changed.stderr
    assert "installed (dlenvtwo-1.0)" in changed.stderr and status(ws, base).state == "installed"


@pytest.mark.slow
def test_a_dependency_that_would_replace_torch_is_one_line_and_the_command_still_runs(project):
    ws, base, env = project
    (ws / "requirements.txt").write_text("needsnewtorch\n")
    first = start(env, "import torch; print('ran')")
    lines = first.stderr.strip().splitlines()
    assert first.returncode == 0 and first.stdout.strip() == "ran"
    assert lines[-1].startswith("dlenv: requirements.txt: needsnewtorch 1.0 (it depends on torch>=99) would "
                                f"replace torch {protected_versions()['torch']}"), first.stderr
    assert "modern profile" in lines[-1] and "Traceback" not in first.stderr
    s = status(ws, base)
    assert s.state == "failed" and "needsnewtorch" in s.detail
    log = (base / "requirements.log").stat().st_mtime_ns
    again = start(env, "print('ran')")  # said again at the next start, without running pip
    assert again.stderr.strip() == lines[-1] and again.stdout.strip() == "ran"
    assert (base / "requirements.log").stat().st_mtime_ns == log


# requirement lines naming a protected package at a version the installed one is not
REFUSED = [("torch>=99", "torch"), ("torch==1.0 ; python_version >= '3'", "torch"), ("numpy<1", "numpy"),
           ("torchvision==0.0.1  # an old one", "torchvision")]


@pytest.mark.parametrize(("line", "name"), REFUSED, ids=[r[1] + str(i) for i, r in enumerate(REFUSED)])
def test_a_requirement_that_would_replace_the_stack_is_refused_before_pip(project, line, name):
    ws, base, env = project
    versions = protected_versions()
    if name not in versions:
        pytest.skip(f"{name} is not installed in this lane")
    (ws / "requirements.txt").write_text(f"dlenvtiny\n{line}\n")
    proc = subprocess.run([str(base_python()), "-m", "dlenv.envcheck.projectreqs"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and not (base / "requirements.log").exists()  # pip never started
    said = proc.stderr.strip().splitlines()
    assert len(said) == 1 and f"would replace {name} {versions[name]}" in said[0] and "modern profile" in said[0]
    assert (base / FAILED).read_text().strip() == said[0].removeprefix("dlenv: ")


@pytest.mark.parametrize("text", ["torch", "torch>=1.0", f"numpy=={protected_versions().get('numpy', '1')}",
                                  "# torch>=99", "--find-links wheels", "pandas>=99",
                                  "torch>=99 ; python_version < '3'"])
def test_requirements_the_installed_stack_satisfies_are_not_conflicts(text):
    assert direct_conflicts(text, protected_versions()) == []


def test_pips_own_failure_is_its_first_error_line(tmp_path):
    out = "Looking in links: w\nERROR: Could not find a version that satisfies the requirement nosuch\nERROR: more\n"
    line = pip_failure_line(out, protected_versions(), tmp_path / "requirements.log")
    assert line.startswith("pip could not install requirements.txt: Could not find a version that satisfies")
    assert str(tmp_path / "requirements.log") in line and "python -m dlenv.envcheck.projectreqs" in line


def test_a_workspace_without_requirements_is_left_alone(project):
    ws, base, env = project
    proc = start(env, "print('ran')")
    assert proc.returncode == 0 and proc.stderr == "" and not base.exists()
    assert status(ws, base).state == "none"


# ---------------------------------------------------------------------------------------------------
# verify-env's line


@pytest.mark.parametrize(("s", "shown"), [
    (Status("installed", "ws/requirements.txt installed in ws/.dlenv/cu11.6", "ws/requirements.txt"), "ok"),
    (Status("out-of-date", "ws/requirements.txt changed since it was installed", "ws/requirements.txt",
            "a new container installs it at start"), "warn"),
    (Status("failed", "requirements.txt: torch>=2 would replace torch 1.13.1", "ws/requirements.txt", "fix it"),
     "warn"),
    (Status("none", "ws/requirements.txt: installed by the image only", "ws/requirements.txt"), "info"),
])
def test_verify_env_reports_the_requirements(s, shown):
    row = [c for c in checks(Facts(requirements=s), allow_cpu=True) if c.name == "requirements"]
    assert len(row) == 1 and row[0].status == shown and row[0].detail == s.detail and row[0].fix == s.fix


def test_verify_env_says_nothing_without_a_requirements_file():
    assert not [c for c in checks(Facts(requirements=Status("none", "no requirements.txt")), allow_cpu=True)
                if c.name == "requirements"]


def test_status_of_each_state(tmp_path):
    ws, base = tmp_path / "ws", tmp_path / "ws" / ".dlenv" / "cu11.6"
    base.mkdir(parents=True)
    assert status(ws, base).state == "none"
    (ws / "requirements.txt").write_text("dlenvtiny\n")
    assert status(ws, None).state == "none" and status(ws, None).file  # outside the image: said, as info
    assert status(ws, base).state == "out-of-date"
    (base / STAMP).write_text(file_hash(ws / "requirements.txt") + "\n")
    assert status(ws, base).state == "installed"
    (base / FAILED).write_text("requirements.txt: torch>=2 would replace torch 1.13.1\n")
    assert status(ws, base).state == "failed" and status(ws, base).detail.endswith("torch 1.13.1")


def test_a_file_that_cannot_be_read_is_reported_not_a_crash(tmp_path, monkeypatch):
    import errno

    from dlenv.envcheck import projectreqs

    ws, base = tmp_path / "ws", tmp_path / "ws" / ".dlenv" / "cu11.6"
    base.mkdir(parents=True)
    (ws / "requirements.txt").write_text("dlenvtiny\n")
    (base / STAMP).write_text("0" * 64 + "\n")

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(projectreqs, "file_hash", unreadable)
    s = status(ws, base)
    assert s.state == "failed" and "cannot be read (Permission denied)" in s.detail and "--user" in s.fix
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: unreadable(self))
    said = []
    assert projectreqs.install(ws, base, say=said.append) == 1
    assert said == [f"dlenv: cannot install {ws / 'requirements.txt'}: Permission denied; make it readable by the "
                    "container's user"]
