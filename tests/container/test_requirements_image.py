"""A project's requirements.txt through real `docker run` (issue 44 item 2): `pytest tests/container --image NAME`.

A project folder mounted at /root/workspace with a requirements.txt and a folder of wheels made here (pip
reads `--no-index --find-links wheels` from the file itself; every container has networking off): the
first container installs it into the workspace's .dlenv/ under the profile's PyTorch pins and runs the
command; a new container finds it there without installing; a requirement that would replace torch is one
line naming it and the modern profile, and the command still runs; verify-env reports each state.
tests/envcheck/test_projectreqs.py is the host's fast simulation of the same.
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


def _sneaky(folder: Path, name: str, module: str) -> Path:
    """A wheel that installs `module`/ (a fake of the stack) under the distribution name `name`."""
    import zipfile

    wheel = make_wheel(folder, name)
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr(f"{module}/__init__.py", "EVIL = 1\n__version__ = '0+evil'\n")
    return wheel


TORCH_NOW = ["python", "-c", "import torch, numpy; print('torch', getattr(torch, 'EVIL', torch.__version__), "
             "getattr(numpy, 'EVIL', 'numpy-real'))"]


@pytest.mark.parametrize("how", ["another name", "a fake numpy wheel by path", "a direct URL", "a pinned dependency"])
def test_a_fake_torch_is_not_importable_after_start_and_is_named(docker_client, image, tmp_path, how):
    """Issue 52 item 3: the image's user site comes before its env on sys.path, so a fake that pip put there
    would be the next `import torch`; the check by content removes it and names it, the real torch imports."""
    folder = project(tmp_path / "project", "")
    wheels = folder / "wheels"
    if how == "another name":
        _sneaky(wheels, "sneaky", "torch")
        line = "sneaky"
    elif how == "a fake numpy wheel by path":
        line = "./" + make_wheel(tmp_path / "w", "numpy", "1.26.4", code="EVIL = 1\n").relative_to(tmp_path).as_posix()
        (folder / "w").mkdir()
        (tmp_path / line[2:]).rename(folder / line[2:])
    elif how == "a direct URL":
        make_wheel(wheels, "torch", "1.13.1", code="EVIL = 1\n")
        line = "torch @ file:///root/workspace/wheels/torch-1.13.1-py3-none-any.whl"
    else:
        make_wheel(wheels, "torch", "1.13.1+evil", code="EVIL = 1\n")
        make_wheel(wheels, "needsevil", requires=("torch==1.13.1+evil",))
        line = "needsevil"
    (folder / "requirements.txt").write_text(INDEX + line + "\n")
    status, output = run(docker_client, image, TORCH_NOW, volumes=mounted(folder))
    assert status == 0 and "torch 1.13.1" in output and "numpy-real" in output, output[-3000:]
    said = [ln for ln in output.splitlines() if ln.startswith("dlenv:") and "installing" not in ln]
    assert len(said) == 1 and ("torch" in said[0] or "numpy" in said[0]) and "Traceback" not in output, output
    assert not list((folder / ".dlenv").glob("cu*/lib/python3.*/site-packages/torch")), output


def test_a_workspace_uploaded_with_a_fake_torch_in_its_user_site_starts_with_the_real_one(docker_client, image,
                                                                                          tmp_path):
    """The user site lives in the mount: a workspace from elsewhere can bring one, stamp and all. Each start
    checks it by content."""
    folder = project(tmp_path / "project", INDEX + "dlenvtiny==1.0\n")
    status, output = run(docker_client, image, IMPORT, volumes=mounted(folder))  # installs, stamps
    assert status == 0 and "value 7" in output, output[-3000:]
    site = next((folder / ".dlenv").glob("cu*/lib/python3.*/site-packages"))
    import zipfile

    with zipfile.ZipFile(_sneaky(tmp_path / "w", "planted", "torch")) as z:
        z.extractall(site)
    status, output = run(docker_client, image, TORCH_NOW, volumes=mounted(folder))
    assert status == 0 and "torch 1.13.1" in output, output[-3000:]
    said = [ln for ln in output.splitlines() if ln.startswith("dlenv:")]
    assert len(said) == 1 and "torch" in said[0] and "removed" in said[0], output
    assert not (site / "torch").exists() and (site / "dlenvtiny").is_dir()
