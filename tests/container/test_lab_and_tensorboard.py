"""`dlenv lab` and `dlenv tensorboard` in a running container, as users start them:
`pytest tests/container --image dlenv:cu116`.

Networking is off (`--network none`), so nothing outside a container reaches its ports: each check runs
a client inside the container with `docker exec` (tests/container/inside_lab.py for the lab), against the
server on the container's loopback. For the lab, as root, as `--user UID:GID` on a folder of theirs, and on
`--read-only` with a tmpfs /tmp: the server answers its API with the token it printed once, opens the
mounted folder, and a kernel started through its REST API runs from the `dl` env, imports torch and dlenv
and runs one training step over the websocket. TensorBoard lists a run trained with --tensorboard. Then
`docker stop` ends each server with 0 or 143 within 10 s (the server is the process tini signals).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
from test_image import DEMO, TINY, mounted, owned_by, start

INSIDE_LAB = (Path(__file__).parent / "inside_lab.py").read_text(encoding="utf-8")
STOP_WITHIN = 10  # seconds, `docker stop`'s own default grace period


def wait_for_line(container, pattern: str, timeout: float = 600) -> re.Match:
    """The first match of `pattern` in the container's output, failing at once if the container ends."""
    deadline = time.time() + timeout
    while True:
        logs = container.logs().decode("utf-8", "replace")
        m = re.search(pattern, logs)
        if m:
            return m
        container.reload()
        assert container.status == "running", logs[-3000:]
        assert time.time() < deadline, f"no {pattern!r} in {timeout} s: {logs[-2000:]}"
        time.sleep(0.3)


def inside(container, argv: list[str], user: str | None = None) -> str:
    """Run `argv` in the running container (as its user); fail with its output unless it exits 0."""
    result = container.exec_run(argv, user=user or "")
    output = result.output.decode("utf-8", "replace")
    assert result.exit_code == 0, output[-3000:]
    return output


def stop_in_time(container) -> tuple[int, float, str]:
    """`docker stop` (SIGTERM to tini, SIGKILL after STOP_WITHIN s): (exit status, seconds, output)."""
    t = time.time()
    container.stop(timeout=STOP_WITHIN)
    status = container.wait(timeout=60)["StatusCode"]
    return status, time.time() - t, container.logs().decode("utf-8", "replace")


@pytest.mark.parametrize("how", ["dlenv as root", "invoke as --user", "dlenv on --read-only",
                                 "dlenv without the entrypoint, as --user on --read-only"])
def test_the_lab_answers_inside_runs_a_training_step_and_stops(docker_client, image, tmp_path, how):
    verb = how.split()[0]
    kwargs: dict = {}
    user = None
    folder = tmp_path
    if "--user" in how:
        user = "1234:1234"
        folder = owned_by(tmp_path / "project", 1234, 1234)
        kwargs["user"] = user
    if "--read-only" in how:
        kwargs.update(read_only=True, tmpfs={"/tmp": ""})
    if "without the entrypoint" in how:
        # HOME=/ (not writable) and no name for the UID: dlenv lab moves Jupyter's folders to /tmp itself
        kwargs["entrypoint"] = [verb]
    (folder / "notes-of-mine.txt").write_text("the user's project\n")
    command = ["lab"] if "entrypoint" in kwargs else [verb, "lab"]
    container = start(docker_client, image, command, volumes=mounted(folder), **kwargs)
    try:
        token = wait_for_line(container, r"dlenv lab: open http://127\.0\.0\.1:8888/lab\?token=(\w+) ").group(1)
        said = json.loads(inside(container, ["python", "-c", INSIDE_LAB, "8888", token], user).splitlines()[-1])
        status, took, output = stop_in_time(container)
    finally:
        container.remove(force=True)
    assert said["status"]["started"], said
    assert "notes-of-mine.txt" in said["root_listing"]  # the lab opens /root/workspace, the mounted folder
    assert said["default_kernel"] == "python3" and said["kernel_argv"][0] == "/opt/conda/envs/dl/bin/python"
    run = said["run"]
    assert run["reply"] == "ok" and run["error"] is None, run
    step = json.loads(run["stdout"].strip().splitlines()[-1])
    assert step["prefix"] == "/opt/conda/envs/dl", step  # the kernel is the dl env's Python
    assert math.isfinite(step["loss"]) and step["params_moved"] > 0, step
    assert said["kernels_left"] == 0
    assert output.count(token) == 1, output[-3000:]  # printed once, by dlenv; Jupyter's own lines mask it
    if "without the entrypoint" in how:
        assert "is not writable: Jupyter's files go to /tmp/jupyter-1234" in output, output[:2000]
    assert "Traceback" not in output, output[-3000:]
    assert status in (0, 143) and took < STOP_WITHIN, (status, took, output[-2000:])


def test_the_lab_refuses_an_empty_token_in_one_line(docker_client, image):
    container = start(docker_client, image, ["dlenv", "lab"], environment={"JUPYTER_TOKEN": ""})
    try:
        status = container.wait(timeout=120)["StatusCode"]
        output = container.logs().decode("utf-8", "replace")
    finally:
        container.remove(force=True)
    assert status == 2 and output.strip().splitlines() == [
        line for line in output.strip().splitlines() if "JUPYTER_TOKEN is set but empty" in line], output


def test_tensorboard_lists_the_run_inside_and_stops(docker_client, image, tmp_path):
    script = (DEMO + "dlenv train --data data/demo --workers 0 --epochs 1 --max-steps 2 --tensorboard "
              + " ".join(TINY) + " && exec dlenv tensorboard")
    container = start(docker_client, image, ["sh", "-c", script], volumes=mounted(tmp_path))
    try:
        wait_for_line(container, r"dlenv tensorboard: open http://127\.0\.0\.1:6006/ ")
        fetch = ("import json, time, urllib.request\n"
                 "for _ in range(300):\n"
                 "    try:\n"
                 "        runs = json.load(urllib.request.urlopen('http://127.0.0.1:6006/data/runs', timeout=5))\n"
                 "        tags = json.load(urllib.request.urlopen('http://127.0.0.1:6006/data/plugin/scalars/tags',"
                 " timeout=5))\n"
                 "        if runs: break\n"
                 "    except OSError: pass\n"
                 "    time.sleep(0.3)\n"
                 "print(json.dumps({'runs': runs, 'tags': tags}))\n")
        said = json.loads(inside(container, ["python", "-c", fetch]).splitlines()[-1])
        status, took, output = stop_in_time(container)
    finally:
        container.remove(force=True)
    assert said["runs"] == ["exp"], said
    assert any("loss" in tag for tag in said["tags"]["exp"]), said  # the epoch's scalars are there
    assert "dlenv tensorboard: serving runs/ (1 run(s) with event files: exp)" in output, output[-2000:]
    assert status in (0, 143) and took < STOP_WITHIN, (status, took, output[-2000:])
