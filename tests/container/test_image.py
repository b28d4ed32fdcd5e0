"""The built image from the host, through a real engine: `pytest tests/container --image dlenv:cu116`.

Each test starts a fresh container the way users do (the image's own entrypoint; --ipc=host unless the
test is about /dev/shm; all GPUs where the test needs them) and checks what a user would see. This is
the runtime contract of docs/docker.md, run end to end: `docker stop` and Ctrl-C on a terminal during
training with DataLoader workers (exit 143/130, last.pth saved once, `--resume` finishes the run),
`--user` with and without a passwd entry, a project mounted at /root/workspace and at /workspace,
`--read-only`, Docker's default 64 MB /dev/shm, and the tasks and verify-env as users reach them.

Every container runs with networking off (`--network none`): CI's engine has no network, and nothing
here may need one. CI's image lane (.ci/image-lane) runs this file against the image it builds.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SLOW = 1800  # seconds: `invoke test` runs the whole suite inside
TINY = ["--model", "squeezenet1_1", "--img-size", "32", "--batch-size", "2", "--device", "cpu"]
DEMO = "dlenv demo-data --dest data/demo --train-per-class 20 --val-per-class 2 --size 32 >/dev/null && "


def start(client, image: str, command, *, ipc_host: bool = True, gpus: bool = False, **kwargs):
    """A detached container of `image` running `command`, as `docker run --network none [--ipc=host]`."""
    if gpus:
        from docker.types import DeviceRequest

        kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if ipc_host:
        kwargs["ipc_mode"] = "host"
    container = client.containers.create(image, command, network_mode="none", **kwargs)
    try:
        container.start()
    except Exception:  # e.g. no GPU runtime: leave no created-but-never-started container behind
        container.remove(force=True)
        raise
    return container


def run(client, image: str, command, *, timeout: int = 600, stderr: bool = True, **kwargs) -> tuple[int, str]:
    """Run `command` in a new container of `image` to its end; return (exit status, its output)."""
    container = start(client, image, command, **kwargs)
    try:
        status = container.wait(timeout=timeout)["StatusCode"]
        output = container.logs(stdout=True, stderr=stderr).decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    return status, output


def docker_cli() -> str:
    """The docker client for what the SDK cannot do (a terminal): DOCKER_CLI, else the one on PATH."""
    cli = os.environ.get("DOCKER_CLI") or shutil.which("docker")
    if not cli:
        pytest.skip("no docker client on PATH (set DOCKER_CLI)")
    return cli


@pytest.fixture(scope="session")
def gpus(docker_client, image):
    """Skip unless this Docker host can give containers GPUs (NVIDIA Container Toolkit installed)."""
    import docker

    try:
        status, output = run(docker_client, image, ["nvidia-smi", "-L"], gpus=True, timeout=120)
    except docker.errors.APIError as e:  # "could not select device driver with capabilities: [[gpu]]"
        pytest.skip(f"this Docker host cannot start GPU containers: {e.explanation or e}")
    if status != 0 or "GPU 0" not in output:
        pytest.skip(f"no GPU visible in a --gpus all container: {output.strip()[:200]}")
    return True


def mounted(path, at: str = "/root/workspace") -> dict:
    return {str(path): {"bind": at, "mode": "rw"}}


def owned_by(path: Path, uid: int, gid: int) -> Path:
    """`path` as a host folder of uid:gid (what `docker run --user` users mount)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    return path


def epochs_done(project: Path) -> list[int]:
    csv = project / "runs" / "exp" / "results.csv"
    if not csv.is_file():
        return []
    rows = csv.read_text().splitlines()[1:]
    return [int(r.split(",")[0]) for r in rows if r]


def wait_for(path: Path, container_or_proc, timeout: float = 600) -> None:
    """Poll until `path` exists, failing at once (with the output) if the container or process ends."""
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path.name} did not appear in {timeout} s"
        if isinstance(container_or_proc, subprocess.Popen):
            assert container_or_proc.poll() is None, f"the run ended before writing {path.name}"
        else:
            container_or_proc.reload()
            assert container_or_proc.status == "running", container_or_proc.logs().decode()[-3000:]
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# What the image is


def test_image_metadata(docker_client, image):
    config = docker_client.images.get(image).attrs["Config"]
    assert config["WorkingDir"] == "/root/workspace"
    assert config["Entrypoint"][0].endswith("tini")
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["DLENV_IMAGE"] == "1" and env["PATH"].startswith("/opt/conda/envs/dl/bin:")
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "dlenv"
    assert labels["dlenv.env-kind"] == env["DLENV_ENV_KIND"] in ("conda", "pip")
    # the label says which CUDA torch was built for; the build check made it true
    status, output = run(docker_client, image, ["python", "-c", "import torch; print(torch.version.cuda)"])
    assert status == 0 and output.strip().splitlines()[-1] == labels["dlenv.torch-cuda"], output


def test_invoke_list_without_a_mount(docker_client, image):
    status, output = run(docker_client, image, ["invoke", "--list"])
    assert status == 0, output
    assert "verify-env" in output and "train" in output and "test" in output


def test_invoke_list_with_a_mounted_project(docker_client, image, tmp_path):
    (tmp_path / "notes.txt").write_text("a user's project, no tasks.py of its own\n")
    status, output = run(docker_client, image, ["invoke", "--list"], volumes=mounted(tmp_path))
    assert status == 0, output
    assert "verify-env" in output and "train" in output


def test_tini_is_pid_1(docker_client, image):
    status, output = run(docker_client, image, ["cat", "/proc/1/cmdline"])
    assert status == 0 and "tini" in output.split("\0")[0]


def test_verify_env_passes_on_a_cpu_with_allow_cpu(docker_client, image):
    status, output = run(docker_client, image, ["dlenv", "verify-env", "--json", "--allow-cpu"], stderr=False)
    data = json.loads(output)
    failed = [c for c in data["checks"] if c["status"] == "fail"]
    assert status == 0 and data["ok"] and not failed, failed


def test_default_shm_is_flagged_by_verify_env(docker_client, image):
    # without --ipc=host Docker gives /dev/shm 64 MB: verify-env must say so (and pass with --allow-cpu)
    status, output = run(docker_client, image, ["dlenv", "verify-env", "--json", "--allow-cpu",
                                                "--workers", "8"], ipc_host=False, stderr=False)
    data = json.loads(output)
    shm = next(c for c in data["checks"] if c["name"] == "/dev/shm")
    assert shm["status"] == "warn" and "--ipc=host" in shm["fix"]
    assert status == (0 if data["ok"] else 1)


def test_verify_env_passes_with_all_gpus(docker_client, image, gpus):
    status, output = run(docker_client, image, ["invoke", "verify-env"], gpus=True)
    assert status == 0, output
    assert "PASS" in output
    assert not [ln for ln in output.splitlines() if ln.startswith("fail")], output


def test_invoke_test_passes_inside(docker_client, image, gpus):
    status, output = run(docker_client, image, ["invoke", "test"], gpus=True, timeout=SLOW)
    assert status == 0, output[-4000:]
    assert " passed" in output and " failed" not in output


# ---------------------------------------------------------------------------------------------------
# Users: --user UID:GID on a folder of theirs, and a UID with no passwd entry


@pytest.mark.parametrize("user, uid, gid", [("1234:1234", 1234, 1234), ("4321", 4321, 0)])
def test_a_user_trains_into_a_folder_of_theirs_and_owns_the_files(docker_client, image, tmp_path, user, uid, gid):
    folder = owned_by(tmp_path / "project", uid, gid)
    script = ('echo "HOME=$HOME USER=$USER"; test -w "$HOME" && ' + DEMO +
              "dlenv train --data data/demo --workers 0 --epochs 1 --max-steps 2 " + " ".join(TINY))
    status, output = run(docker_client, image, ["sh", "-c", script], volumes=mounted(folder), user=user)
    assert status == 0, output[-3000:]
    # the entrypoint gave the unnamed user a writable HOME and a name
    assert f"HOME=/tmp/home-{uid} USER=user{uid}" in output, output[:500]
    written = [p for p in folder.rglob("*")]
    assert (folder / "runs" / "exp" / "last.pth").is_file() and len(written) > 10
    wrong = [(str(p.relative_to(folder)), p.stat().st_uid, p.stat().st_gid) for p in written
             if (p.stat().st_uid, p.stat().st_gid) != (uid, gid)]
    assert not wrong, wrong[:5]
    # the same user still reaches the tasks (/root is readable, HOME writable)
    status, output = run(docker_client, image, ["invoke", "--list"], volumes=mounted(folder), user=user)
    assert status == 0 and "verify-env" in output, output


# ---------------------------------------------------------------------------------------------------
# A project mounted where users mount it, with tasks of its own


PROJECT_TASKS = "from invoke import task\n\n@task\ndef hello(c):\n    print('hello from the project')\n"


@pytest.mark.parametrize("workdir", ["/root/workspace", "/workspace"])
def test_a_project_with_its_own_tasks_mounted_anywhere_reaches_dlenvs(docker_client, image, tmp_path, workdir):
    (tmp_path / "tasks.py").write_text(PROJECT_TASKS)
    script = ("invoke --list && invoke -r . hello && " + DEMO +
              "invoke train --data data/demo --workers 0 --epochs 1 --max-steps 1 " + " ".join(TINY))
    status, output = run(docker_client, image, ["sh", "-c", script], working_dir=workdir,
                         volumes=mounted(tmp_path, at=workdir))
    assert status == 0, output[-3000:]
    assert "verify-env" in output and "hello from the project" in output
    # `invoke train` reached dlenv's trainer, which wrote the run into the mounted project
    assert epochs_done(tmp_path) == [1], output[-2000:]


def test_read_only_root_with_a_tmpfs_and_a_writable_mount(docker_client, image, tmp_path):
    script = DEMO + "dlenv train --data data/demo --workers 2 --epochs 1 --max-steps 2 " + " ".join(TINY)
    status, output = run(docker_client, image, ["sh", "-c", script], volumes=mounted(tmp_path), read_only=True,
                         tmpfs={"/tmp": ""})
    assert status == 0, output[-3000:]
    assert epochs_done(tmp_path) == [1] and "Traceback" not in output, output[-2000:]


# ---------------------------------------------------------------------------------------------------
# Stopping a run: `docker stop`, and Ctrl-C in `docker run -it`


# Short epochs (this CPU trains a few steps a second at best): the first saves last.pth, the stop lands in
# one of the later ones, and the resumed run finishes the rest quickly.
EPOCHS = 4
STOPPABLE = (DEMO + f"exec {{verb}} train --data data/demo --workers 2 --epochs {EPOCHS} --max-steps 6 "
             + " ".join(TINY))


def check_stopped_then_resume(docker_client, image, folder: Path, status: int, output: str, name: str,
                              code: int) -> None:
    """The run stopped by `name` exited `code`, saved last.pth once and names the resume command; a new
    container resumes it from last.pth to the last epoch."""
    last = folder / "runs" / "exp" / "last.pth"
    assert status == code, output[-3000:]
    assert output.count(f"{name}: saving last.pth") == 1, output[-3000:]
    assert "DataLoader worker (pid" not in output and "Traceback" not in output, output[-3000:]
    assert re.search(r"Resume with: (dlenv|invoke) train --resume \S*last\.pth", output), output[-2000:]
    assert last.is_file()
    done = epochs_done(folder)
    assert 1 <= len(done) < EPOCHS, done
    status, output = run(docker_client, image, ["dlenv", "train", "--resume", "runs/exp/last.pth", "--device", "cpu"],
                         volumes=mounted(folder))
    assert status == 0, output[-3000:]
    assert epochs_done(folder) == list(range(1, EPOCHS + 1)), output[-2000:]


@pytest.mark.parametrize("verb", ["dlenv", "invoke"])
def test_docker_stop_with_dataloader_workers_saves_last_pth_and_resumes(docker_client, image, tmp_path, verb):
    container = start(docker_client, image, ["sh", "-c", STOPPABLE.format(verb=verb)], volumes=mounted(tmp_path))
    try:
        wait_for(tmp_path / "runs" / "exp" / "last.pth", container)
        container.stop(timeout=120)  # SIGTERM to tini, as `docker stop` does
        status = container.wait(timeout=180)["StatusCode"]
        output = container.logs().decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    check_stopped_then_resume(docker_client, image, tmp_path, status, output, "SIGTERM", 143)


def test_ctrl_c_in_docker_run_it_saves_last_pth_and_resumes(docker_client, image, tmp_path):
    # A real terminal: the docker client on a pty in raw mode passes ^C to the container's terminal,
    # whose line discipline sends SIGINT to the foreground process group (the trainer and its workers).
    name = f"dlenv-ctrl-c-{os.getpid()}"
    master, slave = pty.openpty()
    proc = subprocess.Popen([docker_cli(), "run", "-it", "--rm", "--name", name, "--network", "none", "--ipc=host",
                             "-v", f"{tmp_path}:/root/workspace", image, "sh", "-c", STOPPABLE.format(verb="dlenv")],
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain(until: float) -> None:
        while time.time() < until:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the client closed the terminal
                    return
                if not data:
                    return
                chunks.append(data)
            elif proc.poll() is not None:
                return

    try:
        last = tmp_path / "runs" / "exp" / "last.pth"
        deadline = time.time() + 600
        while not last.exists():
            assert time.time() < deadline and proc.poll() is None, b"".join(chunks).decode(errors="replace")[-3000:]
            drain(time.time() + 0.2)
        os.write(master, b"\x03")  # Ctrl-C, typed
        drain(time.time() + 180)
        status = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            subprocess.run([docker_cli(), "rm", "-f", name], capture_output=True)
            proc.kill()
        os.close(master)
    output = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    check_stopped_then_resume(docker_client, image, tmp_path, status, output, "SIGINT", 130)


# ---------------------------------------------------------------------------------------------------
# Docker's default /dev/shm (64 MB) with DataLoader workers shipping 224 px batches of 64


@pytest.mark.parametrize("workers", ["2", "auto"])
def test_default_64mb_shm_never_crashes(docker_client, image, tmp_path, workers):
    # 70 images: one full batch of 64 crosses /dev/shm from each worker's side (PyTorch's crash is a worker
    # "killed by signal: Bus error" when a batch does not fit)
    script = ("dlenv demo-data --dest data/demo --train-per-class 7 --val-per-class 1 --size 224 >/dev/null && "
              f"dlenv train --data data/demo --model squeezenet1_1 --img-size 224 --batch-size 64 --workers {workers} "
              "--epochs 1 --max-steps 1 --device cpu")
    status, output = run(docker_client, image, ["sh", "-c", script], volumes=mounted(tmp_path), ipc_host=False,
                         shm_size="64m", timeout=900)
    for crash in ("Traceback", "Bus error", "bug in dlenv", "DataLoader worker (pid"):
        assert crash not in output, output[-3000:]
    if status == 0:  # training went on within the memory there is
        assert epochs_done(tmp_path) == [1], output[-2000:]
    else:  # or it stopped with one line that names the way out
        lines = [ln for ln in output.splitlines() if ln.strip()]
        assert re.search(r"--ipc=host|--shm-size", lines[-1]), output[-2000:]


# ---------------------------------------------------------------------------------------------------
# A model of one's own with --amp, on the image's torch (issue 53 item 1)


def _ln_vit_source() -> str:
    """tests/usermodels.py's LN_VIT: lucidrains' patch embedding (LayerNorm, Linear, LayerNorm), whose bf16
    step fails on the CPU with PyTorch 1.13.1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("usermodels", Path(__file__).parents[1] / "usermodels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LN_VIT


@pytest.mark.parametrize("amp", [["--amp"], ["--amp", "--amp-dtype", "bf16"]])
def test_train_py_amp_checkpoint_on_a_vit_of_ones_own(docker_client, image, tmp_path, amp):
    """`python train.py --amp --checkpoint` in an uploaded project with a ViT of its own trains (it crashed with
    'expected scalar type BFloat16 but found Float' in the image): bf16 only where the model's step runs in it."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "vit.py").write_text(_ln_vit_source())
    shutil.copy(Path(__file__).parents[2] / "workspace" / "train.py", tmp_path / "train.py")
    script = (DEMO + "python train.py --model models/vit.py:ViT --checkpoint --data data/demo --workers 0 "
              "--epochs 1 --max-steps 2 --img-size 16 --batch-size 2 --device cpu " + " ".join(amp))
    status, output = run(docker_client, image, ["sh", "-c", script], volumes=mounted(tmp_path))
    assert status == 0 and "bug in dlenv" not in output, output[-3000:]
    assert epochs_done(tmp_path) == [1], output[-2000:]
    start = next(line for line in output.splitlines() if line.startswith("training models/vit.py:ViT"))
    if "--amp-dtype" in amp:  # asked for by name: the model's step is tried, and fails on this torch
        assert "one bf16 training step of this model failed on cpu with PyTorch 1.13.1" in output, output[-3000:]
        assert "cpu fp32" in start, start
