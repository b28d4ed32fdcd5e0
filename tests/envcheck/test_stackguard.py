"""The PyTorch stack kept as built (issue 52 item 3), on the host: the exact pins, requirement lines judged by
the name they install, a user site checked by content (hand-made wheels unpacked into it, as pip installs a
pure wheel), and the bounded install (a wall-clock limit that kills pip's process group; an index that
accepts and never answers). tests/container/test_requirements_image.py runs the attack through docker run."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from test_projectreqs import project, start  # noqa: F401 (a fixture)
from wheelmaker import make_wheel

from dlenv.envcheck import projectreqs, stackguard
from dlenv.envcheck.stackguard import Stack, intruders, pin_lines, remove, requirement_names, user_site

STACK = Stack({"torch": "1.13.1", "numpy": "1.26.4", "torchvision": "0.14.1+cu117"},
              frozenset({"torch", "numpy", "torchvision", "functorch"}))


@pytest.mark.parametrize(("line", "names"), [
    ("torch @ file:///w/torch-1.13.1+evil-py3-none-any.whl", ["torch"]),
    ("./wheels/numpy-1.24.0-py3-none-any.whl", ["numpy"]),
    ("/abs/TORCH-1.0-cp310-cp310-linux_x86_64.whl", ["torch"]),
    ("https://example.invalid/pkgs/numpy-1.0.tar.gz", ["numpy"]),
    ("Torch[extra]>=1", ["torch"]),
    ("NumPy==1.24 ; python_version >= '3'", ["numpy"]),
    ("torch_vision", ["torch-vision"]),  # another project than torchvision, as pip reads it
    ("TorchVision", ["torchvision"]),
    ("-e git+https://example.invalid/x.git#egg=torch", ["torch"]),
    ("--find-links wheels", []), ("./a-folder/", []), ("# torch", []),
])
def test_a_line_is_judged_by_the_name_it_installs(line, names):
    assert requirement_names(line) == names


def test_pins_hold_the_exact_version_string():
    assert pin_lines(STACK) == ["torch===1.13.1", "numpy===1.26.4", "torchvision==0.14.1+cu117"]
    from packaging.requirements import Requirement

    for pin, evil in [("torch===1.13.1", "1.13.1+evil"), ("torchvision==0.14.1+cu117", "0.14.1+evil")]:
        assert not Requirement(pin).specifier.contains(evil, prereleases=True)
        assert Requirement(pin).specifier.contains(evil.split("+")[0] + ("+cu117" if "cu" in pin else ""))


def test_the_stack_is_read_from_the_installed_metadata():
    stack = stackguard.protected_stack()
    assert "torch" in stack.versions and "torch" in stack.modules and "numpy" in stack.modules
    from importlib import metadata

    assert stack.versions["torch"] == metadata.version("torch")


REFUSED = ["torch==1.13.1+evil", "torch @ file:///w/torch-1.13.1-py3-none-any.whl", "./w/numpy-1.26.4-py3-none-any.whl",
           "Torch>=99", "numpy[extra]<1", "TorchVision==0.0.1"]


@pytest.mark.parametrize("line", REFUSED)
def test_a_line_that_would_replace_the_stack_is_refused(line):
    versions = {"torch": "1.13.1", "numpy": "1.26.4", "torchvision": "0.14.1"}
    said = projectreqs.direct_conflicts(f"dlenvtiny\n{line}\n", versions)
    assert len(said) == 1 and "would replace" in said[0] and line in said[0]


@pytest.mark.parametrize("line", ["torch", "torch===1.13.1", "torch==1.13.1", "torch_vision", "numpy>=1"])
def test_a_line_the_stack_satisfies_is_left_to_pip(line):
    assert projectreqs.direct_conflicts(line, {"torch": "1.13.1", "numpy": "1.26.4", "torchvision": "0.14.1"}) == []


def _install_wheel(site: Path, wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)


# (what pip put into the user site, what must go, what must stay)
CASES = {
    "a fake torch": ([("torch", "1.13.1+evil", {})], ["torch"], []),
    "an uppercase name": ([("Torch", "1.13.1", {})], ["Torch"], []),
    "a fake numpy": ([("numpy", "1.24.0", {})], ["numpy"], []),
    "torch under another name": ([("notorch", "1.0", {"module": "torch"})], ["torch"], []),
    "a project's own package": ([("dlenvtiny", "1.0", {})], [], ["dlenvtiny"]),
    "both": ([("dlenvtiny", "1.0", {}), ("numpy", "9.0", {})], ["numpy"], ["dlenvtiny"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_user_site_is_checked_by_content(tmp_path, case):
    base = tmp_path / "base"
    site = user_site(base)
    site.mkdir(parents=True)
    put, gone, stays = CASES[case]
    for name, version, kw in put:
        wheel = make_wheel(tmp_path / "wheels", name, version)
        if "module" in kw:  # the same files under another top-level name
            wheel = make_wheel(tmp_path / "w2", name, version)
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
            (site / name).rename(site / kw["module"])
            rec = next(site.glob(f"{name}-*.dist-info")) / "RECORD"
            rec.write_text(rec.read_text().replace(f"{name}/", f"{kw['module']}/"))
            continue
        _install_wheel(site, wheel)
    found = intruders(site, STACK)
    assert len(found) == len(gone) and all(any(g.lower() in i.what.lower() for i in found) for g in gone)
    for i in found:
        remove(i, base)
    assert intruders(site, STACK) == []
    left = {p.name for p in site.iterdir()}
    assert all(g not in left for g in gone) and all(s in left for s in stays), left
    assert not [p for p in left if p.lower().startswith(tuple(g.lower() for g in gone))], left


def test_a_loose_torch_folder_no_distribution_owns_goes_and_a_namespace_part_stays(tmp_path):
    site = user_site(tmp_path)
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("EVIL = 1\n")
    (site / "numpy.py").write_text("EVIL = 1\n")
    (site / "functorch").mkdir()  # no __init__: shadows nothing
    found = intruders(site, STACK)
    assert sorted(i.what.split()[0] for i in found) == ["numpy.py", "torch"]
    for i in found:
        remove(i, tmp_path)
    assert sorted(p.name for p in site.iterdir()) == ["functorch"]


def test_removal_never_reaches_outside_the_user_base(tmp_path):
    """A RECORD naming ../../outside, and a torch/ link to a folder outside: only the link goes."""
    outside = tmp_path / "outside"
    (outside / "torch").mkdir(parents=True)
    (outside / "torch" / "__init__.py").write_text("REAL = 1\n")
    (outside / "keep.txt").write_text("mine")
    base = tmp_path / "base"
    site = user_site(base)
    _install_wheel(site, make_wheel(tmp_path / "w", "torch", "9.0"))
    import shutil

    shutil.rmtree(site / "torch")
    (site / "torch").symlink_to(outside / "torch")
    rec = next(site.glob("torch-*.dist-info")) / "RECORD"
    rec.write_text(rec.read_text() + f"{os.path.relpath(outside / 'keep.txt', site)},,\n")
    for i in intruders(site, STACK):
        remove(i, base)
    assert (outside / "keep.txt").read_text() == "mine" and (outside / "torch" / "__init__.py").is_file()
    assert not (site / "torch").is_symlink() and not list(site.glob("torch-*"))


def test_a_limit_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild"
    cmd = [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
           "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); print('started', "
           "flush=True); time.sleep(60)", str(pidfile)]
    t = time.monotonic()
    code, out = projectreqs.run_bounded(cmd, cwd=tmp_path, env=dict(os.environ), limit=2)
    assert code is None and "started" in out and time.monotonic() - t < 10
    pid = int(pidfile.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize(("value", "limit"), [("", projectreqs.INSTALL_LIMIT_S), ("5", 5), ("0", 900), ("x", 900),
                                              ("-3", 900), ("inf", 900)])
def test_the_install_limit_from_the_environment(monkeypatch, value, limit):
    monkeypatch.setenv(projectreqs.LIMIT_ENV, value)
    assert projectreqs.install_limit() == limit


def test_pip_is_given_a_timeout_and_retries(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(projectreqs, "run_bounded", lambda cmd, **kw: (seen.update(cmd=cmd, **kw), (0, ""))[1])
    monkeypatch.setattr(projectreqs, "guard", lambda base, env=None: [])
    (tmp_path / "requirements.txt").write_text("dlenvtiny\n")
    assert projectreqs.install(tmp_path, tmp_path / "base", say=lambda _: None) == 0
    cmd = seen["cmd"]
    assert cmd[cmd.index("--timeout") + 1] == str(projectreqs.PIP_TIMEOUT_S)
    assert cmd[cmd.index("--retries") + 1] == str(projectreqs.PIP_RETRIES) and seen["limit"] > 0


@pytest.fixture
def silent_index():
    """A TCP server on 127.0.0.1 that accepts and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    for c in held:
        c.close()
    srv.close()


@pytest.mark.slow
def test_an_index_that_never_answers_is_cut_and_the_command_starts(project, silent_index):  # noqa: F811
    ws, base, env = project
    env = {k: v for k, v in env.items() if k not in ("PIP_NO_INDEX", "PIP_FIND_LINKS")}
    env[projectreqs.LIMIT_ENV] = "4"
    (ws / "requirements.txt").write_text(f"--index-url http://127.0.0.1:{silent_index}/simple\nsomething\n")
    t = time.monotonic()
    proc = start(env, "import torch; print('ran')")
    assert proc.stdout.strip() == "ran" and time.monotonic() - t < 60, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "was cut" in ln]
    assert len(said) == 1 and "after 4 s" in said[0] and projectreqs.LIMIT_ENV in said[0], proc.stderr
    assert projectreqs.status(ws, base).state == "failed"


@pytest.mark.slow
def test_a_dependency_pinning_a_fake_torch_leaves_the_stack_as_built(project, tmp_path):  # noqa: F811
    """`torch==X+evil` through a dependency, a fake torch by direct URL, a wheel shipping torch/ under
    another name: the stack stays, the user site holds no torch, one line names what happened."""
    ws, base, env = project
    version = projectreqs.protected_versions()["torch"]
    wheels = Path(env["PIP_FIND_LINKS"])
    make_wheel(wheels, "torch", f"{version}+evil", code="EVIL = 1\n")
    make_wheel(wheels, "needsevil", requires=(f"torch=={version}+evil",))
    fake = make_wheel(tmp_path / "direct", "torch", version, code="EVIL = 1\n")
    sneaky = make_wheel(tmp_path / "sneak", "sneaky")
    with zipfile.ZipFile(sneaky, "a") as z:
        z.writestr("torch/__init__.py", "EVIL = 1\n")
    for req in ["needsevil", f"torch @ {fake.as_uri()}", str(sneaky)]:
        (ws / "requirements.txt").write_text(req + "\n")
        proc = start(env, "import torch; print(getattr(torch, 'EVIL', 'real'))")
        assert proc.returncode == 0 and proc.stdout.strip() == "real", proc.stderr
        said = [ln for ln in proc.stderr.splitlines() if ln.startswith("dlenv:") and "torch" in ln
                and "installing" not in ln]
        assert len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr
        site = user_site(base)
        assert not (site / "torch").exists() and not list(site.glob("torch-*")), sorted(os.listdir(site))
