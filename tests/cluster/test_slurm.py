"""The scheduler lane (.ci/slurm-lane): scripts/tools/slurm_train.sbatch as written on a real one-host Slurm cluster
(munged, slurmctld and two slurmd on 127.0.0.1: two node names of one CPU each), with its venv line, its two
nodes x one task as two ranks talking gloo on the CPU.

Each case submits the script with sbatch exactly as a user would (its own #SBATCH lines, no option but the
case's own), trains on the demo data and checks what a user sees and keeps: the job's
state and exit code, the lines in its log (one line per stop, nothing that looks like a crash), results.csv
with every epoch once, and the weights every rank ends with (equal, and equal to last.pth):

- the script as written: trains to the end, both ranks agree;
- `scancel --signal=TERM` mid-epoch, and the time limit with `--signal=TERM@N`: every process of the step
  gets SIGTERM (the launchers, torchrun, the ranks, their DataLoader workers); rank 0 saves last.pth once,
  every task exits 143, the job requeues itself and the requeued job resumes, and (--deterministic) ends with
  exactly the weights of the uninterrupted job (max difference 0.0);
- plain `scancel`: the same stop within Slurm's KillWait, the job is cancelled, the log says how to go on
  (the resubmission, and that a plain scancel does not requeue) before the save, and submitting it again
  with DLENV_RUN resumes;
- SIGTERM to `srun` itself (as `timeout srun` sends it): srun kills its tasks with SIGKILL, so nothing is
  saved and last.pth stays the last one saved, whole;
- one task killed with SIGKILL (its node lost): the other rank stops with one line naming the lost peer
  (exit 6), the job ends without a requeue, and submitting again with DLENV_RUN resumes.

The moment of a stop is exact, not a race: a sitecustomize on PYTHONPATH (in the ranks only, only here) holds
rank 0 at the 3rd optimizer step of epoch 2 until the test has sent its signal (or, for the time limit, until
Slurm's SIGTERM has arrived). The same file saves each rank's weights when the run leaves its process group.
Skipped unless DLENV_SLURM_LANE names the running cluster's folder (the lane sets it, SLURM_CONF and
DLENV_SLURM_VENV, the venv the script's DLENV_VENV line runs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "slurm_train.sbatch"
LANE = os.environ.get("DLENV_SLURM_LANE")
EPOCHS = 3
#: the demo data, 16 + 4 images a class: 20 optimizer steps an epoch at 4 images a rank (the ranks vote on a
#: stop about every second: a stop held at step 3 of epoch 2 is taken a few steps later, mid-epoch);
#: --deterministic: a stopped and resumed job must end bit-equal to the uninterrupted one
TRAIN_ARGS = ["--data", "data/demo", "--device", "cpu", "--epochs", str(EPOCHS), "--batch-size", "4",
              "--workers", "1", "--dist-timeout", "300", "--deterministic"]
STEPS_PER_EPOCH = 20
#: what a crash, not a stop, looks like
# The states a job ends in. COMPLETING is not one: the job's processes are gone but Slurm is still
# running its epilog, so ExitCode and the final state may not be set yet (a CI run saw COMPLETING
# right after the requeued job's last line).
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL")
CRASH = ("Traceback", "bug in dlenv", "DataLoader worker", "killed by signal", "exited unexpectedly")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not LANE, reason="needs the Slurm cluster of .ci/slurm-lane (DLENV_SLURM_LANE)")]

_SITECUSTOMIZE = textwrap.dedent("""
    import os

    if "LOCAL_RANK" in os.environ and os.environ.get("DLENV_TEST_MARKS"):
        import time
        from pathlib import Path

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        marks = Path(os.environ["DLENV_TEST_MARKS"])
        if os.environ.get("DLENV_TEST_HOLD") and os.environ["RANK"] == "0" and not (marks / "reached").exists():
            from dlenv.train import loop

            real_step, steps = loop.optimizer_step, []

            def optimizer_step(*args, **kwargs):
                steps.append(1)
                # a step of at least 0.1 s, so that the ranks' stop vote (about every second: every 10 steps
                # here) falls inside an epoch of 20 steps, as on a loaded machine; on an idle one a step
                # takes ~7 ms, the vote comes every ~140 steps, and the stop would wait for the epoch's end
                time.sleep(0.1)
                if len(steps) == int(os.environ["DLENV_TEST_HOLD"]):
                    (marks / "reached").write_text(str(os.getpid()))
                    t = time.monotonic()
                    while not (marks / "sent").exists() and time.monotonic() - t < 240:
                        time.sleep(0.05)
                return real_step(*args, **kwargs)

            loop.optimizer_step = optimizer_step

        wrapped = []
        real_init = DistributedDataParallel.__init__

        def record(self, module, *args, **kwargs):
            real_init(self, module, *args, **kwargs)
            wrapped.append(module)

        real_destroy = dist.destroy_process_group

        def dump(*args, **kwargs):
            if wrapped:
                module = wrapped[-1]
                state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
                torch.save({"state": state, "parameters": [n for n, _ in module.named_parameters()]},
                           marks / f"rank{os.environ['RANK']}.pt")
            return real_destroy(*args, **kwargs)

        DistributedDataParallel.__init__ = record
        dist.destroy_process_group = dump
""")


def _slurm(*args: str, check: bool = True) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The demo data, small, written by the CLI as a user would."""
    folder = tmp_path_factory.mktemp("demo")
    subprocess.run(["dlenv", "demo-data", "--dest", str(folder / "demo"), "--train-per-class", "16",
                    "--val-per-class", "4", "--size", "32"], check=True, capture_output=True, timeout=120)
    return folder / "demo"


class Job:
    """One submission of the script from `project` (the submit folder, with the demo data in data/)."""

    def __init__(self, project: Path, job_id: str):
        self.project, self.id = project, job_id
        self.marks = project / "marks"
        self.log_path = project / f"dlenv-train-{job_id}.log"
        self.last = project / "runs" / f"slurm-{job_id}" / "last.pth"

    @classmethod
    def submit(cls, project: Path, options: list[str] = (), hold: int | None = None,
               env: dict[str, str] | None = None) -> Job:
        site = project / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        (project / "marks").mkdir(exist_ok=True)
        job_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        job_env.update(DLENV_VENV=os.environ["DLENV_SLURM_VENV"], DLENV_TEST_MARKS=str(project / "marks"),
                       PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        job_env.pop("DLENV_TEST_HOLD", None)
        if hold:
            job_env["DLENV_TEST_HOLD"] = str(hold)
        job_env.update(env or {})
        r = subprocess.run(["sbatch", "--parsable", *options, str(SCRIPT), *TRAIN_ARGS], cwd=project,
                           env=job_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return cls(project, r.stdout.strip().split(";")[0])

    def info(self) -> dict[str, str]:
        out = _slurm("scontrol", "show", "job", "-o", self.id)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, done, timeout: float = 300, what: str = "") -> dict[str, str]:
        """The job's info once `done(info)` holds; fails after `timeout` s with the log's tail."""
        t = time.monotonic()
        while True:
            info = self.info()
            if done(info):
                return info
            if time.monotonic() - t > timeout:
                pytest.fail(f"job {self.id}: {what or 'waited'} for {timeout:g} s; state {info.get('JobState')}, "
                            f"restarts {info.get('Restarts')}:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def ended(self, timeout: float = 300) -> dict[str, str]:
        return self.wait(lambda i: i["JobState"] in FINAL, timeout, "the end")

    def reach(self, timeout: float = 180) -> None:
        """Wait until rank 0 is held at its moment."""
        self.wait(lambda i: (self.marks / "reached").exists() or i["JobState"] not in ("PENDING", "RUNNING"),
                  timeout, "the moment")
        assert (self.marks / "reached").exists(), f"the job ended before the moment:\n{self.log()[-3000:]}"

    def release(self) -> None:
        (self.marks / "sent").write_text("")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def epochs(self, run: str | None = None) -> list[int]:
        from dlenv.runfolder import results

        path = self.project / "runs" / (run or f"slurm-{self.id}") / "results.csv"
        return results.read_results(path)["epoch"].tolist()

    def pids(self, task: int | None) -> list[int]:
        """This job's processes: of its task `task` (the task's launcher, torchrun, its rank and the rank's
        DataLoader workers), or with None those of the batch script (the script's shell and srun)."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                env = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(errors="replace")
                           .split("\0") if "=" in item)
            except (OSError, ValueError):  # not a process, or one gone
                continue
            if env.get("SLURM_JOB_ID") != self.id:
                continue
            if (task is None and "SLURM_STEP_ID" not in env) or (
                    task is not None and "SLURM_STEP_ID" in env and env.get("SLURM_PROCID") == str(task)):
                found.append(int(proc.name))
        return found


@pytest.fixture
def project(tmp_path, demo) -> Path:
    shutil.copytree(demo, tmp_path / "data" / "demo")
    return tmp_path


def _assert_ranks_agree(job: Job) -> None:
    """Both ranks ended with the same weights, and rank 0's whole state is last.pth. (BatchNorm's running
    statistics are each rank's own: DDP broadcasts rank 0's at each forward, and the last one updates them.)"""
    import torch

    from dlenv.files import runstate

    saved = runstate.load_state(job.last)
    assert saved["world_size"] == 2 and saved["epoch"] == EPOCHS
    ranks = [torch.load(job.marks / f"rank{r}.pt", map_location="cpu") for r in (0, 1)]
    assert set(ranks[0]["state"]) == set(ranks[1]["state"]) == set(saved["model"])
    assert ranks[0]["parameters"] == ranks[1]["parameters"] and ranks[0]["parameters"]
    for name in ranks[0]["parameters"]:
        assert torch.equal(ranks[0]["state"][name], ranks[1]["state"][name]), f"{name} differs between the ranks"
    for name, tensor in ranks[0]["state"].items():
        assert torch.equal(tensor, saved["model"][name]), f"{name} differs from last.pth"


def _task_exits(log: str) -> dict[int, str]:
    """How each task ended, from srun's lines ('srun: error: vm: tasks 0-1: Exited with exit code 143', or
    one line a task); a task listed twice fails."""
    ends: dict[int, str] = {}
    for first, last, how in re.findall(r"^srun: error: \S+: tasks? (\d+)(?:-(\d+))?: (.+)$", log, re.M):
        for task in range(int(first), int(last or first) + 1):
            assert task not in ends, f"task {task} ended twice:\n{log[-3000:]}"
            ends[task] = how.strip()
    return ends


def _assert_stopped_once(log: str, job: Job) -> None:
    """One stop by SIGTERM: rank 0 saved once, both tasks exited 143, nothing that looks like a crash."""
    assert log.count("SIGTERM: saving last.pth") == 1, log[-3000:]
    assert log.count(f"stopped by SIGTERM; saved runs/slurm-{job.id}/last.pth. Resume with: ") == 1, log[-3000:]
    assert _task_exits(log) == {0: "Exited with exit code 143", 1: "Exited with exit code 143"}, log[-3000:]
    assert not any(c in log for c in CRASH), log[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo) -> Job:
    """One job of the script as written, never stopped: the weights the stopped ones must end with."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(demo, folder / "data" / "demo")
    job = Job.submit(folder)
    job.ended()
    return job


def _assert_same_weights_as(job: Job, reference: Job) -> None:
    """The job's final last.pth holds exactly the uninterrupted job's weights (and buffers)."""
    from dlenv.files import runstate

    got, want = runstate.load_state(job.last)["model"], runstate.load_state(reference.last)["model"]
    assert set(got) == set(want)
    diff = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    assert diff == 0.0, f"max weight difference {diff} from the uninterrupted job"


def test_the_script_as_written_trains_two_ranks_to_equal_weights(uninterrupted):
    job = uninterrupted
    project = job.project
    info = job.ended()
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "batch 4 x 1 accum x 2 GPU = 8" in log, log[-3000:]  # one run of two ranks
    assert log.count(f"done: {EPOCHS} epochs") == 1 and not any(c in log for c in CRASH), log[-3000:]
    assert job.epochs() == list(range(1, EPOCHS + 1))
    assert [p.name for p in (project / "runs").iterdir()] == [f"slurm-{job.id}"], "only rank 0 writes"
    _assert_ranks_agree(job)


def _requeued_and_finished(job: Job) -> str:
    """The job requeued itself once, resumed and completed; returns its log."""
    info = job.wait(lambda i: i["Restarts"] != "0" and i["JobState"] in FINAL, 300, "the requeued job's end")
    log = job.log()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    assert log.count(f"requeueing job {job.id}, which resumes runs/slurm-{job.id}/last.pth") == 1, log[-3000:]
    assert log.count(f"resuming runs/slurm-{job.id}/last.pth (restart 1 of job {job.id})") == 1, log[-3000:]
    assert job.epochs() == list(range(1, EPOCHS + 1)), log[-3000:]  # each epoch once
    _assert_ranks_agree(job)
    return log


def _resubmitted_and_finished(job: Job) -> None:
    """Submitting the script again with DLENV_RUN resumes the run of `job` and completes it."""
    assert f"submit it again with DLENV_RUN=slurm-{job.id}" in job.log(), job.log()[-3000:]
    again = Job.submit(job.project, env={"DLENV_RUN": f"slurm-{job.id}"})
    info = again.ended()
    log = again.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert f"resuming runs/slurm-{job.id}/last.pth (restart 0 of job {again.id})" in log, log[-3000:]
    assert not any(c in log for c in CRASH), log[-3000:]
    assert job.epochs() == list(range(1, EPOCHS + 1))  # each epoch once
    _assert_ranks_agree(job)


def _slurm_listens_on_loopback_only() -> None:
    """The daemons, the step's slurmstepd and srun listen on 127.0.0.1 only (during a job: srun and
    slurmstepd have their ports open then)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    ours = [ln.split() for ln in out.splitlines()
            if re.search(r'\(\("(slurmctld|slurmd|slurmstepd|srun|munged)"', ln)]
    assert any("srun" in ln[-1] for ln in ours), out  # a job is running: its srun is there to check
    assert all(ln[3].startswith("127.0.0.1:") for ln in ours), out


def test_scancel_signal_term_mid_epoch_saves_once_then_the_job_requeues_and_resumes_exactly(project, uninterrupted):
    job = Job.submit(project, hold=STEPS_PER_EPOCH + 3)
    job.reach()
    _slurm_listens_on_loopback_only()
    _slurm("scancel", "--signal=TERM", job.id)
    job.release()
    log = _requeued_and_finished(job)
    _assert_stopped_once(log, job)
    # taken mid-epoch 2, at the ranks' next vote after the held step: epoch 1's row before it, 2 and 3 after
    assert log.index("epoch 1/3:") < log.index("SIGTERM: saving last.pth") < log.index("epoch 2/3:"), log[-3000:]
    assert "goes on from epoch 2, batch " in log, log[-3000:]
    _assert_same_weights_as(job, uninterrupted)


def test_the_time_limit_signal_saves_once_then_the_job_requeues_and_resumes(project, uninterrupted):
    # two minutes, SIGTERM 30 s before their end: Slurm checks time limits every 30 s, so the signal comes
    # 60-90 s in, long after the held step; the script's own TERM@120 would have come at once
    job = Job.submit(project, ["--time=2", "--signal=TERM@30"], hold=STEPS_PER_EPOCH + 3)
    job.reach()
    job.wait(lambda i: "SIGTERM: saving last.pth" in job.log(), 150, "the time limit's SIGTERM")
    job.release()
    # the requeued job would get its SIGTERM 60-90 s in again: time enough to finish, unless the machine is slow
    job.wait(lambda i: i["Restarts"] != "0", 120, "the requeue")
    _slurm("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    log = _requeued_and_finished(job)
    _assert_stopped_once(log, job)
    _assert_same_weights_as(job, uninterrupted)


def test_scancel_ends_the_job_after_a_save_and_a_resubmission_resumes_exactly(project, uninterrupted):
    """Plain scancel: the job is cancelled (no requeue); its steps get SIGTERM and KillWait's grace. The way on
    is in the log before the save: the resubmission, as the user submitted it, with DLENV_RUN."""
    job = Job.submit(project, hold=STEPS_PER_EPOCH + 3)
    job.reach()
    _slurm("scancel", job.id)
    job.release()
    info = job.ended()
    log = job.log()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log[-3000:]
    _assert_stopped_once(log, job)
    again = (f"after a plain scancel, submit it again: DLENV_RUN=slurm-{job.id} DLENV_VENV="
             f"{os.environ['DLENV_SLURM_VENV']} sbatch {SCRIPT} {' '.join(TRAIN_ARGS)}")
    first = next(ln for ln in log.splitlines() if ln.startswith("SIGTERM: saving last.pth"))
    assert first.endswith(again), first
    stopping = next(ln for ln in log.splitlines() if ln.startswith("stopping after optimizer step"))
    assert "goes on from epoch 2, batch " in stopping and stopping.endswith(again), stopping
    assert log.index(stopping) < log.index(f"stopped by SIGTERM; saved runs/slurm-{job.id}/last.pth"), log[-3000:]
    _resubmitted_and_finished(job)
    _assert_same_weights_as(job, uninterrupted)


def test_srun_sent_sigterm_kills_the_tasks_and_last_pth_stays_the_last_saved(project):
    """SIGTERM to srun itself (`timeout srun ...`, a closed terminal) makes srun kill its tasks with SIGKILL at
    once (Slurm's design): nothing is saved, and nothing saved is lost."""
    from dlenv.files import runstate

    job = Job.submit(project, hold=STEPS_PER_EPOCH + 3)
    job.reach()
    srun = [p for p in job.pids(None) if Path(f"/proc/{p}/comm").read_text().strip() == "srun"]
    assert srun, "no srun process found"
    os.kill(min(srun), signal.SIGTERM)
    job.release()
    info = job.ended()
    log = job.log()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log[-3000:]
    assert _task_exits(log) == {0: "Killed", 1: "Killed"} and "srun: forcing job termination" in log, log[-3000:]
    assert "saving last.pth" not in log and not any(c in log for c in CRASH), log[-3000:]
    saved = runstate.load_state(job.last)
    assert (saved["epoch"], saved["batch_in_epoch"]) == (1, 0) and job.epochs() == [1]
    assert not list(job.last.parent.glob(".last.pth.*.tmp"))


def test_a_task_killed_stops_the_other_rank_in_one_line_and_a_resubmission_resumes(project):
    job = Job.submit(project, hold=STEPS_PER_EPOCH + 3)
    job.reach()
    pids = job.pids(1)
    assert pids, "no process of task 1 found"
    for pid in pids:  # its node lost: every process of the task at once
        os.kill(pid, signal.SIGKILL)
    job.release()
    info = job.ended(timeout=120)  # not torchrun's 300 s exit barrier of PyTorch 1.13 (dlenv.cluster.launch)
    log = job.log()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log[-3000:]
    lost = [ln for ln in log.splitlines() if "another process of this run stopped" in ln]
    assert len(lost) == 1 and "rank 0:" in lost[0] and "the lost peer: rank 1 of 2" in lost[0], log[-3000:]
    assert _task_exits(log) == {0: "Exited with exit code 6", 1: "Killed"}, log[-3000:]
    assert "Traceback" not in log and "bug in dlenv" not in log, log[-3000:]
    assert job.epochs() == [1]
    _resubmitted_and_finished(job)
