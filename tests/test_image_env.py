"""Inside the built image (DLENV_IMAGE=1, marker `image`): the conda env `dl`, its pins, the paths and
the tasks the Dockerfile promises. Skipped everywhere else; `invoke test` runs them in the image."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.image

ENV_PREFIX = Path("/opt/conda/envs/dl")
WORKSPACE = Path("/root/workspace")


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def test_python_and_the_tools_come_from_the_dl_env():
    assert Path(sys.prefix) == ENV_PREFIX
    for tool in ("python", "pip", "invoke", "dlenv", "pytest"):
        found = shutil.which(tool)
        assert found and Path(found).parent == ENV_PREFIX / "bin", f"{tool} resolves to {found}"


def test_installed_versions_are_the_profile_pins():
    from packaging.version import Version

    from dlenv import envcheck

    env_file = Path(os.environ["DLENV_ENV_FILE"])
    assert env_file.is_file(), f"DLENV_ENV_FILE={env_file} is not in the image"
    pins = envcheck.read_pins(env_file)
    facts = envcheck.collect("auto")
    for name in ("python", "torch", "torchvision", "torchaudio", "numpy", "opencv", "cuda"):
        version = facts.versions.get(name)
        assert version, f"{name} is missing: {facts.import_errors.get(name, 'not installed')}"
        assert envcheck.pin_matches(version, pins[name]), f"{name} {version} does not match {pins[name]}"
    import numpy
    import torch

    assert torch.version.cuda is not None, "a CPU build of torch"
    if Version(torch.__version__).major < 2:
        assert Version(numpy.__version__).major < 2


def test_conda_activate_dl_works_in_an_interactive_bash():
    r = sh(["bash", "-ic", "conda activate dl && python -c 'import sys; print(sys.prefix)'"],
           env={**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(ENV_PREFIX)


def test_tasks_are_found_from_the_workspace_and_its_subfolders():
    for cwd in [WORKSPACE] + [d for d in (WORKSPACE / "data", WORKSPACE / "models") if d.is_dir()]:
        r = sh(["invoke", "--list"], cwd=cwd)
        assert r.returncode == 0, r.stderr
        assert "verify-env" in r.stdout and "train" in r.stdout
    assert (Path("/root/tasks.py")).is_file()


def test_the_test_task_finds_the_shipped_tests():
    import dlenv.tasks

    root = Path(dlenv.tasks.__file__).resolve().parents[2]
    shipped = root / "tests" if (root / "tests").is_dir() else Path("/opt/dlenv/tests")
    assert (shipped / "conftest.py").is_file() and (shipped / "test_image_env.py").is_file()
    assert shipped.resolve() == Path("/opt/dlenv/tests")


def test_workspace_template_and_permissions_for_other_users():
    for name in ("README.md", "data/README.md", "models/README.md", "utils/README.md"):
        assert (WORKSPACE / name).is_file() or os.path.ismount(WORKSPACE), name
    mode = Path("/root").stat().st_mode
    assert mode & stat.S_IXOTH and mode & stat.S_IROTH, "docker run --user cannot reach /root/workspace"


def test_tini_is_pid_1_and_the_nvidia_variables_are_set():
    cmdline = Path("/proc/1/cmdline").read_bytes().split(b"\0")
    assert cmdline[0].endswith(b"tini"), cmdline
    assert os.environ["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert {"compute", "utility"} <= set(os.environ["NVIDIA_DRIVER_CAPABILITIES"].split(","))


def test_conda_package_cache_was_cleaned():
    pkgs = Path("/opt/conda/pkgs")
    tarballs = list(pkgs.glob("*.conda")) + list(pkgs.glob("*.tar.bz2")) if pkgs.is_dir() else []
    assert not tarballs, f"conda clean did not run in the env's layer: {tarballs[:3]}"


def test_cli_starts_without_torch():
    r = sh([sys.executable, "-c", "import sys; from dlenv import cli, tasks; "
            "print('torch' in sys.modules)"], cwd=WORKSPACE)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
