"""The image's ENTRYPOINT, run on this machine exactly as the Dockerfile writes it, around a real training.

The ENTRYPOINT line is read from the Dockerfile and each image path mapped back to what the image puts
there (tests/dockerfile.py): /usr/local/bin/dlenv-entrypoint is scripts/tools/entrypoint.sh, and tini, which
the image installs from conda-forge, is the tini on PATH (.ci/run installs Debian's when it is missing).
So a flag added to tini or a line added to the entrypoint is tested here as the image will run it.

- `docker stop` sends SIGTERM to PID 1 (tini); `docker run` without -t proxies Ctrl-C to PID 1 as SIGINT;
  in `docker run -it` the terminal sends Ctrl-C's SIGINT to its foreground process group, the trainer
  and its DataLoader workers. Each must save a loadable last.pth once, exit 143/130 and name the resume
  command, and `--resume` must then finish the run.
- `docker run --user UID:GID` with a UID that has no passwd entry, dropped to with setpriv (as root): the
  run's files in the mounted folder belong to that UID and are readable by its group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dockerfile import ROOT, host_entrypoint
from imagedata import make_train_val

IN_CI = bool(os.environ.get("DLENV_CI_LANE") or os.environ.get("CI"))


def entry() -> list[str]:
    try:
        return host_entrypoint()
    except LookupError as e:
        if IN_CI:  # .ci/run installs tini: a CI run without it is broken, not skipped
            raise AssertionError(f"{e} is not installed; .ci/run installs it (apt-get install tini)") from None
        pytest.skip(f"{e} is not on PATH (apt-get install {e}); CI installs it")


def dlenv_cmd() -> list[str]:
    """`dlenv` as a user runs it: this lane's console script, else python -m dlenv."""
    script = Path(sys.executable).parent / "dlenv"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dlenv"]


def env_for(home: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": str(home), "OMP_NUM_THREADS": "1",
           "TINI_SUBREAPER": "1"}  # tini is not PID 1 here: it reaps as a subreaper instead (and says nothing)
    return env


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ds")
    make_train_val(root, per_class=6, size=(32, 32))
    return root


TRAIN = ["train", "--model", "squeezenet1_1", "--img-size", "32", "--batch-size", "2", "--workers", "2",
         "--epochs", "8", "--max-steps", "2", "--device", "cpu"]

# (what a user does, whom the signal reaches, the signal, the exit status)
STOPS = [("docker stop", "tini", signal.SIGTERM, 143),
         ("Ctrl-C, docker run -it", "foreground group", signal.SIGINT, 130),
         ("Ctrl-C, docker run (proxied)", "tini", signal.SIGINT, 130)]


@pytest.mark.slow
@pytest.mark.parametrize("what, target, signum, code", STOPS, ids=[s[0] for s in STOPS])
def test_stop_with_dataloader_workers_saves_once_and_resumes(tmp_path, dataset, what, target, signum, code):
    stop_and_resume(entry(), tmp_path, dataset, target, signum, code)


def stop_and_resume(entry_cmd: list[str], tmp_path: Path, dataset: Path, target: str, signum: int,
                    code: int) -> None:
    """Train with 2 workers under `entry_cmd`, stop as `target` receives `signum`, check, resume."""
    from dlenv.files import runstate
    from dlenv.runfolder import results

    project = tmp_path / "runs"
    last = project / "exp" / "last.pth"
    cmd = [*entry_cmd, *dlenv_cmd(), *TRAIN, "--data", str(dataset), "--project", str(project)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env_for(tmp_path), cwd=tmp_path)
    try:
        deadline = time.time() + 240
        trainer, workers = None, []
        while time.time() < deadline and proc.poll() is None:
            kids = children(proc.pid)
            trainer = kids[0] if kids else None
            workers = children(trainer) if trainer else []
            if last.exists() and len(workers) >= 2:  # an epoch is saved and the workers are running
                break
            time.sleep(0.02)
        assert proc.poll() is None and trainer and len(workers) >= 2, (
            f"no trainer with workers to stop: {proc.communicate()[0][-3000:] if proc.poll() is not None else ''}")
        if target == "tini":
            proc.send_signal(signum)
        else:  # tini made the trainer a process group leader, the terminal's foreground group
            assert os.getpgid(trainer) == trainer and os.getpgid(workers[0]) == trainer
            os.killpg(trainer, signum)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    name = signal.Signals(signum).name
    assert proc.returncode == code, out[-3000:]
    assert out.count(f"{name}: saving last.pth") == 1, out[-3000:]  # once, not once per worker
    assert "DataLoader worker" not in out and "Traceback" not in out, out[-3000:]
    # the dlenv command, after python -m dlenv too (where there is no console script): -m reads the working folder
    typed = "dlenv train"
    assert f"stopped by {name}; saved {last}. Resume with: {typed} --resume {last}" in out, out[-2000:]
    saved = runstate.load_state(last)  # dlenv wrote it: it loads without consent on any PyTorch
    assert saved["format"] == runstate.FORMAT and 1 <= saved["epoch"] < 8

    resumed = subprocess.run([*entry_cmd, *dlenv_cmd(), "train", "--resume", str(last), "--device", "cpu"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env_for(tmp_path),
                             cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert results.read_results(project / "exp" / "results.csv")["epoch"].tolist() == list(range(1, 9))


# ---------------------------------------------------------------------------------------------------
# --user with a UID that has no passwd entry


UID = GID = 4321


def _reachable_by_others(path: Path) -> bool:
    """Whether a user who is neither owner nor group can reach `path` (search every folder above it)."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(path.stat().st_mode & 0o004)


def _setpriv() -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("dropping to another UID needs root (CI runs as root)")
    tool = shutil.which("setpriv")
    if tool is None:
        pytest.skip("setpriv (util-linux) is not installed")
    cmd = [tool, f"--reuid={UID}", f"--regid={GID}", "--clear-groups"]
    if not (_reachable_by_others(Path(sys.executable)) and _reachable_by_others(ROOT / "src" / "dlenv" / "cli.py")):
        # this machine keeps the venv under a root-only /root (the image does not): keep only
        # CAP_DAC_READ_SEARCH across exec, which lets the user read, never write or own
        cmd += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return [*cmd, "--"]


@contextlib.contextmanager
def user_folder() -> Iterator[Path]:
    """A folder of UID:GID that the user reaches by its absolute path, as it reaches a mount point: under
    the system's temporary folder (searchable by all), not under pytest's, which is root's alone (0700)
    and would stop every absolute path the trainer opens. Removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dlenv-user-"))
    try:
        base.chmod(0o755)
        mount = base / "workspace"
        mount.mkdir()
        os.chown(mount, UID, GID)
        yield mount
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_an_unknown_user_trains_into_a_mount_and_the_files_are_theirs_and_group_readable(dataset):
    user_run(entry(), dataset)


def user_run(entry_cmd: list[str], dataset: Path) -> None:
    """Train, validate and plot as UID 4321 (no passwd entry) under `entry_cmd`; check the files."""
    with user_folder() as mount:
        _user_run(entry_cmd, mount, dataset)


def _user_run(entry_cmd: list[str], mount: Path, dataset: Path) -> None:
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwuid(UID)  # the point of the test: no passwd entry
    # The user's data in its own folder (mounted at /root/workspace), as users keep it: pytest's dataset
    # lies in root's temporary folder, which this user cannot read.
    shutil.copytree(dataset, mount / "data")
    for p in mount.rglob("*"):
        os.chown(p, UID, GID)
    data = set(mount.rglob("*"))
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME")}
    env.update(HOME="/", PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    probe = [sys.executable, "-c", "import getpass, os; print(getpass.getuser(), os.environ['HOME'])"]
    r = subprocess.run([*_setpriv(), *entry_cmd, *probe], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       env={**env, "TINI_SUBREAPER": "1"}, cwd=mount, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"user{UID}", f"/tmp/home-{UID}"]

    r = subprocess.run([*_setpriv(), *entry_cmd, *dlenv_cmd(), "train", "--data", "data", "--model",
                        "squeezenet1_1", "--img-size", "32", "--batch-size", "2", "--workers", "0", "--epochs", "1",
                        "--max-steps", "1", "--device", "cpu", "--tensorboard"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, env={**env, "TINI_SUBREAPER": "1"},
                       cwd=mount, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = mount / "runs" / "exp"
    # the same user validates (val reports, figures) and plots (PNGs) what it trained
    for verb in (["val", "--weights", "runs/exp/best_model.pth", "--workers", "0", "--device", "cpu"],
                 ["plot"]):
        r = subprocess.run([*_setpriv(), *entry_cmd, *dlenv_cmd(), *verb], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, env={**env, "TINI_SUBREAPER": "1"}, cwd=mount,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    written = [p for p in mount.rglob("*") if p.is_file() and p not in data]
    names = {p.name for p in written}
    assert {"config.yaml", "results.csv", "last.pth", "best_model.pth", "metrics.json", "results.png"} <= names, names
    assert any(n.endswith(".png") for n in {p.name for p in (run / "val").iterdir()})
    for p in written:
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (UID, GID), f"{p} belongs to {st.st_uid}:{st.st_gid}"
        assert st.st_mode & 0o040, f"{p.relative_to(mount)} is {oct(st.st_mode & 0o777)}, not group-readable"
    assert not (mount / ".dlenv").exists()  # no project key any more: dlenv's files load without one
    assert (run / "config.yaml").stat().st_mode & 0o777 == 0o644  # the default umask 022, as open() gives
