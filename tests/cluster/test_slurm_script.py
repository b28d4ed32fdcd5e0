"""scripts/tools/slurm_train.sbatch with stand-ins for Slurm's commands: what each task runs, on every host lane in
seconds. (The script on a real Slurm cluster, stopped and requeued: tests/cluster/test_slurm.py, in .ci/slurm-lane.)

The stand-ins: `scontrol` answers for a 2-node allocation (gpu-a at 10.0.0.1, gpu-b) and logs a requeue;
`srun` runs its command once per task with that task's SLURM_PROCID and exits with $SRUN_EXIT; `docker`,
`apptainer` and a venv's `dlenv` print the command they were given.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "slurm_train.sbatch"

_SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    case "$1 $2" in
        "show hostnames") printf 'gpu-a\\ngpu-b\\n' ;;
        "show node") addr=10.0.0.2; [ "$4" = gpu-a ] && addr=10.0.0.1; echo "NodeName=$4 NodeAddr=$addr" ;;
        "show job") echo "JobId=7 JobName=dlenv-train Requeue=$REQUEUE Restarts=0 JobState=RUNNING" \\
            "Command=/home/u/proj/scripts/slurm_train.sbatch WorkDir=/home/u/proj" ;;
        "requeue "*) echo "scontrol requeue $2" >> "$LOG" ;;
        *) echo "scontrol: unexpected $*" >&2; exit 1 ;;
    esac
""")
_SRUN = textwrap.dedent("""\
    #!/bin/bash
    while [[ "$1" == --* ]]; do echo "srun-option $1" >> "$LOG"; shift; done
    for id in 0 1; do SLURM_PROCID=$id "$@" >> "$LOG" || exit; done
    [ -z "$CANCEL" ] || kill -TERM "$PPID"  # a plain scancel: the batch script gets SIGTERM too
    exit "${SRUN_EXIT:-0}"
""")
_PRINT = '#!/bin/bash\necho "$(basename "$0") $* (in $PWD)"\n'


@pytest.fixture
def slurm(tmp_path) -> dict[str, str]:
    """The environment of a job of 2 tasks on 2 nodes, with the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"scontrol": _SCONTROL, "srun": _SRUN, "docker": _PRINT, "apptainer": _PRINT}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "project").mkdir()
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"), "REQUEUE": "1",
            "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_NTASKS": "2", "SLURM_GPUS_ON_NODE": "8",
            "DLENV_PROJECT": str(tmp_path / "project")}


def _run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """The script's result, and the command lines its tasks ran (one per task)."""
    r = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60,
                       cwd=env["DLENV_PROJECT"])
    log = Path(env["LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    return r, [shlex.split(ln.split(" (in ")[0]) for ln in lines if not ln.startswith(("srun-option", "scontrol"))]


def _flags(words: list[str]) -> dict[str, str]:
    args = words[words.index("train") + 1:]
    return {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}


def test_each_task_is_one_node_of_the_run_with_the_rendezvous_from_slurm(slurm):
    r, tasks = _run(slurm, "--amp", "--data", "data/pets")
    assert r.returncode == 0, r.stderr
    assert len(tasks) == 2 and "srun-option" not in Path(slurm["LOG"]).read_text()
    for rank, words in enumerate(tasks):
        assert words[:2] == ["docker", "run"] and "--network" in words and "--ipc=host" in words, words
        assert f"{slurm['DLENV_PROJECT']}:/root/workspace" in words and "dlenv:cu128" in words
        flags = _flags(words)
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank)
        # the first node's address as Slurm knows it; the port from the job ID, so jobs on one node never meet
        assert flags["--master-addr"] == "10.0.0.1" and flags["--master-port"] == "20007"
        assert flags["--gpus"] == "8" and flags["--name"] == "slurm-7" and flags["--data"] == "data/pets"
        assert flags["--project"] == "runs"  # given, so a --cfg file's project: cannot move the run folder
        assert "--amp" in words and "--resume" not in words


def test_the_venv_line_runs_the_venvs_dlenv_in_the_project(slurm, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "dlenv").write_text(_PRINT)
    (venv / "bin" / "dlenv").chmod(0o755)
    r, tasks = _run({**slurm, "DLENV_VENV": str(venv)}, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    lines = Path(slurm["LOG"]).read_text().splitlines()
    assert len(tasks) == 2 and all(ln.endswith(f"(in {slurm['DLENV_PROJECT']})") for ln in lines)
    assert [_flags(w)["--node-rank"] for w in tasks] == ["0", "1"] and tasks[0][:2] == ["dlenv", "train"]


def test_the_apptainer_line_binds_the_project(slurm):
    r, tasks = _run({**slurm, "DLENV_SIF": "/images/dlenv.sif"})
    assert r.returncode == 0, r.stderr
    words = tasks[0]
    assert words[:3] == ["apptainer", "exec", "--nv"] and "/images/dlenv.sif" in words
    assert f"{slurm['DLENV_PROJECT']}:/root/workspace" in words and _flags(words)["--node-rank"] == "0"


def test_a_run_with_a_last_pth_is_resumed(slurm):
    run = Path(slurm["DLENV_PROJECT"]) / "runs" / "slurm-3"
    run.mkdir(parents=True)
    (run / "last.pth").write_bytes(b"")
    r, tasks = _run({**slurm, "DLENV_RUN": "slurm-3"})
    assert r.returncode == 0, r.stderr
    assert "resuming runs/slurm-3/last.pth" in r.stdout
    assert all(_flags(w)["--resume"] == "runs/slurm-3/last.pth" and _flags(w)["--name"] == "slurm-3" for w in tasks)


@pytest.mark.parametrize("requeue, rc, cancel, requeued, line", [
    ("1", 143, "", True, "stopped by SIGTERM; requeueing job 7, which resumes runs/slurm-7/last.pth"),
    ("0", 143, "", False, "the run ended with exit status 143; to resume it, submit it again with DLENV_RUN=slurm-7"),
    ("1", 143, "1", False, "the run ended with exit status 143; to resume it, submit it again with DLENV_RUN=slurm-7"),
    ("1", 6, "", False, "the run ended with exit status 6; to resume it, submit it again with DLENV_RUN=slurm-7"),
    ("1", 0, "", False, None),
], ids=["stopped-requeue", "stopped-no-requeue", "cancelled", "failed", "done"])
def test_a_job_stopped_by_sigterm_requeues_itself_only_when_it_may(slurm, requeue, rc, cancel, requeued, line):
    r, _ = _run({**slurm, "REQUEUE": requeue, "SRUN_EXIT": str(rc), "CANCEL": cancel})
    assert r.returncode == rc, r.stderr
    assert ("scontrol requeue 7" in Path(slurm["LOG"]).read_text()) == requeued
    if line:
        assert f"slurm_train.sbatch: {line}" in r.stdout, r.stdout
    else:
        assert "slurm_train.sbatch" not in r.stdout


@pytest.mark.parametrize("env, args, message", [
    ({}, ["--name", "x"], "--name: the run folder is runs/$DLENV_RUN"),
    ({}, ["--project=elsewhere"], "--project=elsewhere: the run folder is runs/$DLENV_RUN"),
    ({}, ["--amp", "--nam", "x"], "--nam: the run folder is runs/$DLENV_RUN"),  # an abbreviation (issue 43)
    ({}, ["--proj=elsewhere"], "--proj=elsewhere: the run folder is runs/$DLENV_RUN"),
    ({}, ["--na=x"], "--na=x: the run folder is runs/$DLENV_RUN"),
    ({"DLENV_VENV": "/venv", "DLENV_SIF": "/x.sif"}, [], "DLENV_VENV and DLENV_SIF are both set"),
    ({"DLENV_VENV": "/no/such/venv"}, [], "DLENV_VENV=/no/such/venv has no bin/dlenv"),
    ({"SLURM_JOB_ID": ""}, [], "no Slurm job here (SLURM_JOB_ID, SLURM_NTASKS unset): submit it, sbatch "),
], ids=["name", "project", "abbreviated-name", "abbreviated-project", "shortest-name", "venv-and-sif",
        "venv-without-dlenv", "not-in-a-job"])
def test_bad_settings_stop_before_srun_in_one_line(slurm, env, args, message):
    r, tasks = _run({**slurm, **env}, *args)
    assert r.returncode == 2 and tasks == []
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("slurm_train.sbatch: ") and message in r.stderr, r.stderr


@pytest.mark.parametrize("requeue", ["1", "0"])
def test_each_task_knows_how_the_job_goes_on_after_a_stop(slurm, tmp_path, requeue):
    """dlenv's stop line says it before the save (dlenv.train.console.way_on): this script again, with the
    submission's variables and arguments, and whether the job requeues itself; docker passes both in."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "dlenv").write_text('#!/bin/bash\necho "dlenv-env $DLENV_SLURM_REQUEUE|$DLENV_SLURM_RESUBMIT"\n')
    (venv / "bin" / "dlenv").chmod(0o755)
    r, _ = _run({**slurm, "DLENV_VENV": str(venv), "REQUEUE": requeue}, "--device", "cpu", "--data", "my data")
    assert r.returncode == 0, r.stderr
    envs = [ln.split(" ", 1)[1] for ln in Path(slurm["LOG"]).read_text().splitlines() if ln.startswith("dlenv-env ")]
    want = (f"{requeue}|DLENV_RUN=slurm-7 DLENV_VENV={venv} DLENV_PROJECT={slurm['DLENV_PROJECT']} sbatch "
            "/home/u/proj/scripts/slurm_train.sbatch --device cpu --data my\\ data")
    assert envs == [want, want]
    r, tasks = _run({**slurm, "REQUEUE": requeue, "LOG": str(tmp_path / "docker-log")})
    passed = {"-e", "SLURM_JOB_ID", "DLENV_SLURM_RESUBMIT", "DLENV_SLURM_REQUEUE"}
    assert len(tasks) == 2 and all(passed <= set(w) for w in tasks), tasks
