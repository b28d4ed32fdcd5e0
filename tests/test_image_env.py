"""Inside the built image (DLENV_IMAGE=1, marker `image`): the conda env `dl`, its pins, the paths and
the tasks the Dockerfile promises, and the runtime contract with the image's own binaries: `docker stop`
with DataLoader workers (its tini and entrypoint at their image paths), a mounted project with tasks of
its own, a UID without a passwd entry, the tensorboard command, nvJPEG on the GPU and --compile as such a
user. Skipped everywhere else; `invoke test` runs them in the image. (tests/test_entrypoint.py,
test_tasks_discovery.py and tests/envcheck/test_pins.py run the same contract on a CI host; in the image they
run too.)"""

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


def env_kind() -> str:
    """How the image's `dl` env was made, as the Dockerfile records it: 'conda' (the builder stage, what
    users build) or 'pip' (an ENV_IMAGE without conda: CI's image lane, docker/ci/make-bases.sh)."""
    kind = os.environ.get("DLENV_ENV_KIND")
    assert kind in ("conda", "pip"), f"DLENV_ENV_KIND={kind!r}: the Dockerfile sets conda or pip"
    return kind


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def test_python_and_the_tools_come_from_the_dl_env():
    assert Path(sys.prefix) == ENV_PREFIX
    for tool in ("python", "pip", "invoke", "dlenv", "pytest"):
        found = shutil.which(tool)
        assert found and Path(found).parent == ENV_PREFIX / "bin", f"{tool} resolves to {found}"


def test_pythons_own_native_modules_load_and_its_build_data_names_the_env():
    # a Python copied from elsewhere (CI's pip-built env) or relocated by conda must find its libraries
    # here and write its own prefix into what sysconfig tells compilers
    import importlib
    import sysconfig

    for name in ("ssl", "sqlite3", "ctypes", "bz2", "lzma", "zlib", "readline", "curses", "uuid", "pyexpat",
                 "decimal", "hashlib"):
        importlib.import_module(name)
    build = importlib.import_module(sysconfig._get_sysconfigdata_name()).build_time_vars
    assert build["prefix"] == str(ENV_PREFIX), build["prefix"]


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
        if name == "cuda" and env_kind() == "pip":
            # PyPI has no CUDA 11.6 build of torch 1.13.1 (its one wheel is CUDA 11.7): the pip-built env is
            # built with TORCH_CUDA=11.7, which the build check proved and the image records
            assert version == os.environ["DLENV_TORCH_CUDA"] == "11.7", version
            continue
        assert envcheck.pin_matches(version, pins[name]), f"{name} {version} does not match {pins[name]}"
    assert env_kind() == "pip" or os.environ["DLENV_TORCH_CUDA"] == facts.versions["cuda"]
    import numpy
    import torch

    assert torch.version.cuda is not None, "a CPU build of torch"
    if Version(torch.__version__).major < 2:
        assert Version(numpy.__version__).major < 2


def test_the_dl_env_is_active_in_an_interactive_bash():
    # conda's env is activated by /etc/bash.bashrc (and by hand); a pip-built env's bin is put first
    command = "python -c 'import sys; print(sys.prefix)'"
    if env_kind() == "conda":
        command = f"conda activate dl && {command}"
    r = sh(["bash", "-ic", command],
           env={**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(ENV_PREFIX)


def test_tasks_are_found_from_the_workspace_and_its_subfolders():
    for cwd in [WORKSPACE] + [d for d in (WORKSPACE / "data", WORKSPACE / "models") if d.is_dir()]:
        r = sh(["invoke", "--list"], cwd=cwd)
        assert r.returncode == 0, r.stderr
        assert "verify-env" in r.stdout and "train" in r.stdout
    assert Path("/etc/invoke.yaml").is_file() and not Path("/root/tasks.py").exists()


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


# ---------------------------------------------------------------------------------------------------
# The runtime contract with the image's own binaries and files


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from imagedata import make_train_val

    root = tmp_path_factory.mktemp("ds")
    make_train_val(root, per_class=6, size=(32, 32))
    return root


def _image_entrypoint() -> list[str]:
    from dockerfile import entrypoint

    entry = entrypoint()
    assert all(Path(w).is_file() for w in entry if w.startswith("/")), entry
    return entry


@pytest.mark.slow
@pytest.mark.parametrize("target, signum, code", [("tini", 15, 143), ("foreground group", 2, 130)],
                         ids=["docker stop", "Ctrl-C -it"])
def test_stop_with_workers_through_the_images_own_entrypoint(tmp_path, tiny_data, target, signum, code):
    from test_entrypoint import stop_and_resume

    stop_and_resume(_image_entrypoint(), tmp_path, tiny_data, target, signum, code)


@pytest.mark.slow
def test_an_unknown_user_writes_group_readable_files_through_the_images_entrypoint(tiny_data):
    from test_entrypoint import user_run

    user_run(_image_entrypoint(), tiny_data)


@pytest.mark.parametrize("kind", ["tasks.py", "tasks/", "no tasks (mounted at /workspace)"])
def test_a_mounted_project_with_its_own_tasks_still_reaches_dlenvs(tmp_path, kind):
    from test_tasks_discovery import project

    folder = project(tmp_path / "workspace", kind)
    r = sh(["invoke", "--list"], cwd=folder)  # the image's /etc/invoke.yaml, nothing mapped
    assert r.returncode == 0 and "verify-env" in r.stdout and "hello" not in r.stdout, r.stderr
    if kind != "no tasks (mounted at /workspace)":
        r = sh(["invoke", "-r", ".", "hello"], cwd=folder)
        assert r.returncode == 0 and "hello from the project" in r.stdout, r.stderr


def test_the_tensorboard_command_runs_in_the_image():
    r = sh(["tensorboard", "--version"])
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_lock_and_the_pins_are_in_the_image():
    lock = Path("/opt/dlenv/lock")
    pip = (lock / "pip.txt").read_text().splitlines()
    assert any(ln.startswith("tensorboard==") for ln in pip)
    if env_kind() == "conda":
        explicit = (lock / "conda-explicit.txt").read_text()
        assert "@EXPLICIT" in explicit and "pytorch" in explicit
    else:  # no conda packages: pip's list is the whole lock, the PyTorch stack in it
        assert not (lock / "conda-explicit.txt").exists()
        assert {"torch==1.13.1", "torchvision==0.14.1", "torchaudio==0.13.1"} <= set(pip), pip[:5]
    assert os.environ.get("PIP_CONSTRAINT") == str(lock / "constraints.txt")
    pinned = (ENV_PREFIX / "conda-meta" / "pinned").read_text().splitlines()
    assert any(ln.startswith("python ") for ln in pinned) and any(ln.startswith("numpy ") for ln in pinned)


@pytest.mark.gpu
def test_nvjpeg_decodes_on_the_gpu_like_the_cpu():
    import io

    import numpy as np
    import torch
    from PIL import Image

    from dlenv import compat

    assert compat.cuda_jpeg_unavailable("cuda") is None, compat.cuda_jpeg_unavailable("cuda")
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=95)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    gpu = compat.decode_jpeg(data, device="cuda").cpu().int()
    cpu = compat.decode_jpeg(data).int()
    assert gpu.shape == cpu.shape == (3, 48, 64)
    assert (gpu - cpu).abs().float().mean() < 2.0  # IDCT rounding differs, the image does not


def test_nvimagecodec_loads_quietly_in_the_image(capfd):
    """The env ships nvImageCodec for the GPU's JPEG engines; loading it says nothing on the console
    (its optional JPEG 2000 / TIFF plug-ins complain at import when their wheels are absent)."""
    from dlenv.data import hwdecode

    mod, why = hwdecode.module()
    assert mod is not None, why
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.gpu
def test_nvimagecodec_decodes_on_the_gpu():
    from dlenv.data import hwdecode

    assert hwdecode.unavailable("cuda") is None, hwdecode.unavailable("cuda")


@pytest.mark.gpu
@pytest.mark.slow
def test_compile_as_a_user_without_a_passwd_entry():
    from test_entrypoint import user_folder

    with user_folder() as mount:
        _compile_as_an_unknown_user(mount)


def _compile_as_an_unknown_user(mount: Path) -> None:
    import torch
    from test_entrypoint import UID, _setpriv

    from dlenv import compat

    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME", "TORCHINDUCTOR_CACHE_DIR")}
    env["HOME"] = "/"
    r = subprocess.run([*_setpriv(), *_image_entrypoint(), "dlenv", "train", "--synthetic", "--model", "resnet18",
                        "--compile", "--epochs", "1", "--max-steps", "3", "--batch-size", "8", "--img-size", "64",
                        "--device", "cuda"], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                       cwd=mount, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if compat.HAS_COMPILE:  # inductor keeps its cache under the user's name: getpass.getuser() worked
        assert Path(f"/tmp/torchinductor_user{UID}").is_dir(), r.stdout[-2000:]
    else:
        assert f"PyTorch {torch.__version__} has no torch.compile" in r.stdout
