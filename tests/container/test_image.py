"""The built image from the host, through the Docker SDK: `pytest tests/container --image dlenv:cu116`.

Each test starts a fresh container the way users do (the image's own entrypoint, --ipc=host unless the
test is about /dev/shm, all GPUs where the test needs them) and checks what a user would see: tasks
found from /root/workspace with and without a mounted project, verify-env passing, the shipped test
suite passing inside, and files in a mounted folder owned by the user who passed --user UID:GID.
"""

from __future__ import annotations

import json
import os

import pytest

SLOW = 1800  # seconds: `invoke test` runs the whole suite inside


def run(client, image: str, command: list[str], *, gpus: bool = False, ipc_host: bool = True,
        volumes: dict | None = None, user: str | None = None, timeout: int = 600,
        stderr: bool = True) -> tuple[int, str]:
    """Start `command` in a new container of `image`; return (exit status, its output)."""
    from docker.types import DeviceRequest

    kwargs = {"detach": True, "volumes": volumes or {}, "user": user}
    if gpus:
        kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if ipc_host:
        kwargs["ipc_mode"] = "host"
    container = client.containers.run(image, command, **kwargs)
    try:
        status = container.wait(timeout=timeout)["StatusCode"]
        output = container.logs(stdout=True, stderr=stderr).decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    return status, output


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


def mounted(path) -> dict:
    return {str(path): {"bind": "/root/workspace", "mode": "rw"}}


def test_image_metadata(docker_client, image):
    config = docker_client.images.get(image).attrs["Config"]
    assert config["WorkingDir"] == "/root/workspace"
    assert config["Entrypoint"][0].endswith("tini")
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["DLENV_IMAGE"] == "1" and env["PATH"].startswith("/opt/conda/envs/dl/bin:")
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "dlenv"
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


def test_files_in_the_mount_belong_to_the_user_passed_with_user(docker_client, image, tmp_path):
    uid, gid = (os.getuid(), os.getgid()) if os.getuid() != 0 else (4321, 4321)
    tmp_path.chmod(0o777)  # so the test also works when the host side runs as root
    code = "open('/root/workspace/written.txt', 'w').write('x')"
    status, output = run(docker_client, image, ["python", "-c", code], volumes=mounted(tmp_path),
                         user=f"{uid}:{gid}")
    assert status == 0, output
    st = (tmp_path / "written.txt").stat()
    assert (st.st_uid, st.st_gid) == (uid, gid)
    # the same user can still run the tasks (HOME is made writable, /root is readable)
    status, output = run(docker_client, image, ["invoke", "--list"], volumes=mounted(tmp_path),
                         user=f"{uid}:{gid}")
    assert status == 0 and "verify-env" in output, output


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


@pytest.mark.parametrize("workdir", ["/root/workspace", "/workspace"])
def test_a_project_with_its_own_tasks_mounted_anywhere_reaches_dlenvs(docker_client, image, tmp_path, workdir):
    (tmp_path / "tasks.py").write_text("from invoke import task\n\n@task\ndef hello(c):\n    print('hello')\n")
    container = docker_client.containers.run(image, ["sh", "-c", "invoke --list && invoke -r . hello"],
                                             detach=True, working_dir=workdir,
                                             volumes={str(tmp_path): {"bind": workdir, "mode": "rw"}})
    try:
        status = container.wait(timeout=300)["StatusCode"]
        output = container.logs().decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    assert status == 0, output
    assert "verify-env" in output and "train" in output and output.strip().endswith("hello")


def test_docker_stop_with_dataloader_workers_saves_last_pth(docker_client, image, tmp_path):
    import time

    tmp_path.chmod(0o777)
    cmd = ["sh", "-c", "dlenv demo-data --dest data/demo --train-per-class 20 --val-per-class 2 --size 32 && "
           "exec dlenv train --data data/demo --model squeezenet1_1 --img-size 32 --batch-size 4 --workers 2 "
           "--epochs 1000 --device cpu"]
    container = docker_client.containers.run(image, cmd, detach=True, ipc_mode="host",
                                             volumes=mounted(tmp_path), user=f"{os.getuid() or 4321}:0")
    try:
        last = tmp_path / "runs" / "exp" / "last.pth"
        deadline = time.time() + 600
        while not last.exists() and time.time() < deadline:
            container.reload()
            assert container.status == "running", container.logs().decode()[-3000:]
            time.sleep(1)
        container.stop(timeout=120)  # SIGTERM to tini, as `docker stop` does
        status = container.wait(timeout=180)["StatusCode"]
        output = container.logs().decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    assert status == 143, output[-3000:]
    assert output.count("SIGTERM: saving last.pth") == 1 and "DataLoader worker" not in output, output[-3000:]
    assert "Resume with: dlenv train --resume" in output
    assert (tmp_path / "runs" / "exp" / "last.pth.hmac").is_file()
