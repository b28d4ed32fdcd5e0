"""A project's requirements.txt through real `docker run` (issue 44 item 2): `pytest tests/container --image NAME`.

A project folder mounted at /root/workspace with a requirements.txt and a folder of wheels made here (pip
reads `--no-index --find-links wheels` from the file itself; every container has networking off): the
first container installs it into the workspace's .dlenv/ under the profile's PyTorch pins and runs the
command; a new container finds it there without installing; a requirement that would replace torch is one
line naming it and the modern profile, and the command still runs; verify-env reports each state.
tests/test_projectreqs.py is the host's fast simulation of the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_image import mounted, owned_by, run
from wheelmaker import make_wheel

INDEX = "--no-index\n--find-links wheels\n"
IMPORT = ["python", "-c", "import dlenvtiny; print('value', dlenvtiny.VALUE)"]


def project(folder: Path, requirements: str, uid: int = 0, gid: int = 0) -> Path:
    folder = owned_by(folder, uid, gid)
    make_wheel(folder / "wheels", "dlenvtiny", code="VALUE = 7\n")
    make_wheel(folder / "wheels", "needsnewtorch", requires=("torch>=99",))
    (folder / "requirements.txt").write_text(requirements)
    for p in [folder, *folder.rglob("*")]:
        os.chown(p, uid, gid)
    return folder


def requirements_check(client, image: str, folder: Path, **kw) -> dict:
    status, output = run(client, image, ["dlenv", "verify-env", "--json", "--allow-cpu"], stderr=False,
                         volumes=mounted(folder), **kw)
    rows = [c for c in json.loads(output)["checks"] if c["name"] == "requirements"]
    assert status == 0 and len(rows) == 1, output[-2000:]
    return rows[0]


@pytest.mark.parametrize(("user", "uid"), [(None, 0), ("1234:1234", 1234)], ids=["root", "user"])
def test_requirements_install_once_into_the_mount_and_a_new_container_finds_them(docker_client, image, tmp_path,
                                                                                  user, uid):
    folder = project(tmp_path / "project", INDEX + "dlenvtiny==1.0\n", uid, uid)
    kw = {"user": user} if user else {}
    status, output = run(docker_client, image, IMPORT, volumes=mounted(folder), **kw)
    assert status == 0 and "value 7" in output, output[-3000:]
    assert "dlenv: requirements.txt installed (dlenvtiny-1.0)" in output, output[-3000:]
    installed = list((folder / ".dlenv").glob("cu*/lib/python3.*/site-packages/dlenvtiny/__init__.py"))
    assert len(installed) == 1 and installed[0].stat().st_uid == uid  # in the mount, the user's
    pins = (installed[0].parents[4] / "constraints.txt").read_text()
    assert "torch===1.13.1" in pins.splitlines() and "numpy==" in pins, pins  # exactly: no local label taken

    status, output = run(docker_client, image, IMPORT, volumes=mounted(folder), **kw)  # a new container
    assert status == 0 and output.strip() == "value 7", output[-3000:]  # nothing installed, nothing said
    assert requirements_check(docker_client, image, folder, **kw)["status"] == "ok"

    (folder / "requirements.txt").write_text(INDEX + "dlenvtiny==1.0\n# a comment changes the file\n")
    # out of date, as a container started with the install turned off sees it (any other installs it first)
    off = requirements_check(docker_client, image, folder, environment={"DLENV_REQUIREMENTS": "off"}, **kw)
    assert off["status"] == "warn" and "changed since it was installed" in off["detail"], off
    status, output = run(docker_client, image, IMPORT, volumes=mounted(folder), **kw)
    assert status == 0 and "installed (everything was already there)" in output, output[-3000:]


def test_a_requirement_that_would_replace_torch_is_one_line_and_torch_stays(docker_client, image, tmp_path):
    folder = project(tmp_path / "project", INDEX + "needsnewtorch\n")
    check = ["python", "-c", "import torch; print('torch', torch.__version__)"]
    status, output = run(docker_client, image, check, volumes=mounted(folder))
    assert status == 0 and "torch 1.13.1" in output, output[-3000:]
    said = [ln for ln in output.splitlines() if "would replace" in ln]
    assert len(said) == 1 and said[0].startswith("dlenv: requirements.txt: needsnewtorch 1.0 (it depends on "
                                                 "torch>=99) would replace torch 1.13.1"), output[-3000:]
    assert "modern profile" in said[0] and "Traceback" not in output
    row = requirements_check(docker_client, image, folder)
    assert row["status"] == "warn" and "needsnewtorch" in row["detail"], row
    assert not list((folder / ".dlenv").glob("cu*/lib/python3.*/site-packages/torch"))
