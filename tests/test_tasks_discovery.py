"""`invoke VERB` in the image reaches dlenv's tasks whatever project is mounted, and wherever.

The image installs docker/etc/invoke.yaml as /etc/invoke.yaml, invoke's system-wide configuration; its
`tasks.search_root` points at the folder the Dockerfile copies the package (and tasks.py) to. Here the
very file is used as invoke's system configuration, with that one image path mapped back to this
checkout through the Dockerfile's COPY lines (tests/dockerfile.py), and invoke runs from folders that
stand for mounted projects: one with its own tasks.py, one with a tasks/ package, one with neither (a
project mounted at /workspace has no tasks file above it either).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from dockerfile import ROOT, STAGES, host_path

CONFIG = ROOT / "docker" / "etc" / "invoke.yaml"

# runs the real invoke program with its system configuration read from argv[1] instead of /etc/
_DRIVER = textwrap.dedent("""
    import sys
    from invoke import Config
    from invoke.main import program

    class SystemConfig(Config):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("system_prefix", sys.argv[1])
            super().__init__(*args, **kwargs)

    program.config_class = SystemConfig
    program.run(["invoke", *sys.argv[2:]])
""")


def test_the_dockerfile_installs_the_config_where_invoke_reads_its_system_file():
    from invoke import Config

    copies = [a for i, a in STAGES["runtime"] if i == "COPY" and a.endswith(" /etc/invoke.yaml")]
    assert copies and "docker/etc/invoke.yaml" in copies[0]
    assert Config()._system_prefix + (Config.file_prefix or Config.prefix) + ".yaml" == "/etc/invoke.yaml"


@pytest.fixture(scope="module")
def system_dir(tmp_path_factory) -> Path:
    """A folder holding invoke.yaml: the image's file, its search root mapped to this checkout."""
    conf = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    image_root = conf["tasks"]["search_root"]
    tasks_file = host_path(f"{image_root}/tasks.py")
    assert tasks_file is not None and tasks_file.is_file(), f"the image has no tasks.py in {image_root}"
    conf["tasks"]["search_root"] = str(tasks_file.parent)
    d = tmp_path_factory.mktemp("etc")
    (d / "invoke.yaml").write_text(yaml.safe_dump(conf), encoding="utf-8")
    return d


def invoke(cwd: Path, *args: str, system: Path | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": str(cwd)}  # no ~/.invoke.yaml
    prefix = str(system) + "/" if system else "/nonexistent/"
    return subprocess.run([sys.executable, "-c", _DRIVER, prefix, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


USER_TASK = textwrap.dedent('''
    from invoke import task

    @task
    def hello(c):
        """The project's own task."""
        print("hello from the project")
''')


def project(root: Path, kind: str) -> Path:
    """A folder as a user might mount it: with its own tasks.py, its own tasks/ package, or neither."""
    root.mkdir()
    (root / "notes.txt").write_text("a user's project\n")
    if kind == "tasks.py":
        (root / "tasks.py").write_text(USER_TASK)
    elif kind == "tasks/":
        (root / "tasks").mkdir()
        (root / "tasks" / "__init__.py").write_text(USER_TASK + "\nfrom invoke import Collection\n"
                                                    "ns = Collection(hello)\n")
    return root


KINDS = ["tasks.py", "tasks/", "no tasks (mounted at /workspace)"]


@pytest.mark.parametrize("kind", KINDS)
def test_invoke_reaches_dlenvs_tasks_whatever_the_project_has(tmp_path, system_dir, kind):
    folder = project(tmp_path / "workspace", kind)
    listed = invoke(folder, "--list", system=system_dir)
    assert listed.returncode == 0, listed.stderr
    for verb in ("verify-env", "train", "val", "test"):
        assert verb in listed.stdout, listed.stdout
    assert "hello" not in listed.stdout
    helped = invoke(folder, "train", "--help", system=system_dir)
    assert helped.returncode == 0 and "--amp" in helped.stdout and "--trust-pickle" in helped.stdout
    # a verb that really runs: a tiny demo dataset written into the project
    ran = invoke(folder, "demo-data", "--dest", "data/demo", "--train-per-class", "1", "--val-per-class", "1",
                 "--size", "16", system=system_dir)
    assert ran.returncode == 0, ran.stderr
    assert (folder / "data" / "demo" / "train").is_dir()


@pytest.mark.parametrize("kind", KINDS[:2])
def test_the_projects_own_tasks_run_with_search_root_dot(tmp_path, system_dir, kind):
    folder = project(tmp_path / "workspace", kind)
    listed = invoke(folder, "-r", ".", "--list", system=system_dir)
    assert listed.returncode == 0 and "hello" in listed.stdout, listed.stderr
    ran = invoke(folder, "-r", ".", "hello", system=system_dir)
    assert ran.returncode == 0 and ran.stdout.strip() == "hello from the project", ran.stderr


@pytest.mark.parametrize("kind, error", [("tasks.py", "No idea what 'train' is!"),
                                         ("no tasks (mounted at /workspace)", "Can't find any collection")])
def test_without_the_system_config_invoke_fails_as_the_issue_says(tmp_path, kind, error):
    # the control: these are the failures the config file prevents
    folder = project(tmp_path / "workspace", kind)
    r = invoke(folder, "train", "--help", system=None)
    assert r.returncode != 0 and error in r.stderr + r.stdout


def workspace_copy(root: Path) -> Path:
    """A copy of workspace/ as a user makes one outside the image (without a run's files)."""
    import shutil

    shutil.copytree(ROOT / "workspace", root, ignore=shutil.ignore_patterns("runs", "__pycache__", "data", ".dlenv"))
    return root


def test_a_copy_of_workspace_lists_dlenvs_verbs_without_the_image_and_imports_no_torch(tmp_path):
    folder = workspace_copy(tmp_path / "myproject")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": str(folder)}  # no ~/.invoke.yaml
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "invoke", "--list"], cwd=folder, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:] if line.startswith("  ") and line.split()
              and not line.startswith("   ")]
    for verb in ("verify-env", "train", "val", "predict", "test"):
        assert listed.count(verb) == 1, r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "dlenv.tasks" in imported


@pytest.mark.parametrize("search", [(), ("-r", ".")], ids=["image config", "-r ."])
def test_in_the_image_a_copy_of_workspace_has_dlenvs_verbs_once(tmp_path, system_dir, search):
    """The image's /etc/invoke.yaml loads /opt/dlenv's tasks and never the workspace's tasks.py; `-r .` loads
    the workspace's, which is the same collection: each verb is listed once either way, and runs."""
    folder = workspace_copy(tmp_path / "workspace")
    listed = invoke(folder, *search, "--list", system=system_dir)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ") and line.split()
             and not line.startswith("   ")]
    assert names.count("train") == 1 and names.count("verify-env") == 1, listed.stdout
    helped = invoke(folder, *search, "val", "--help", system=system_dir)
    assert helped.returncode == 0 and "--weights" in helped.stdout, helped.stderr
