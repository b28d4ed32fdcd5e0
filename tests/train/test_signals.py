"""Stop signals sent to the trainer's whole process group, as `timeout`, `kill -- -PGID`, a terminal's Ctrl-C
or hangup, systemd and scancel send them: the DataLoader workers get the signal too.

Each case runs a real `dlenv train` on a CPU with two DataLoader workers in a session of its own, stops
it at one moment (start-up, mid-epoch, validation, the save of last.pth) with `os.killpg`, and checks what
a user sees and keeps: the exit status 143 / 130 / 129, one line about the stop and nothing that looks
like a crash (no traceback, no "DataLoader worker ... killed by signal", no "bug in dlenv"), a last.pth
that loads, and the printed resume command finishing the run with each epoch once in results.csv.

The moment is exact, not a race: the trainer runs with a hook (the script below) that, at the moment,
writes a marker file and waits until the test has sent the signal, so the signal is handled right there.
"""

from __future__ import annotations

import os
import pty
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dlenv.files import runstate
from dlenv.runfolder import results

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 3

# The trainer with the tiny model (tests/tinymodels.py) and, when DLENV_TEST_MOMENT names one, the hook.
_SCRIPT = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import dlenv.model.models
from tinymodels import build_tiny
dlenv.model.models.build_model = build_tiny

moment, marks = os.environ.get("DLENV_TEST_MOMENT"), Path(os.environ.get("DLENV_TEST_MARKS", "."))


def reached():
    # the test sends its signal once it sees `reached`, then writes `sent`: the signal lands in here
    (marks / "reached").write_text(str(os.getpid()))
    t = time.monotonic()
    while not (marks / "sent").exists() and time.monotonic() - t < 60:
        time.sleep(0.01)


if moment == "start-up":  # data and model built, no run folder yet
    from dlenv.train import parts
    real_parts = parts.build_parts
    def build_parts(*a, **k):
        reached()
        return real_parts(*a, **k)
    parts.build_parts = build_parts
elif moment == "mid-epoch":  # the 3rd optimizer step of epoch 2, its workers running
    from dlenv.train import loop
    real_step, steps = loop.optimizer_step, []
    def optimizer_step(*a, **k):
        steps.append(1)
        if len(steps) == 8 + 3:
            reached()
        return real_step(*a, **k)
    loop.optimizer_step = optimizer_step
elif moment == "validation":  # epoch 2's validation, after its first batch (the val workers running)
    from dlenv.train import loop
    real_validate, passes = loop.validate, []
    def validate(model, batches, *a, **k):
        passes.append(1)
        def hooked():
            for i, batch in enumerate(batches):
                yield batch
                if i == 0 and len(passes) == 2:
                    reached()
        return real_validate(model, hooked(), *a, **k)
    loop.validate = validate
elif moment == "save":  # epoch 2's last.pth: its temporary file written, not yet renamed into place
    from dlenv.files import runstate
    real_write, saves = runstate.write_file, []
    def write_file(path, write, durable=False):
        if Path(path).name != "last.pth":
            return real_write(path, write, durable)
        saves.append(1)
        def hooked(fh):
            write(fh)
            if len(saves) == 2:
                reached()
        return real_write(path, hooked, durable)
    runstate.write_file = write_file

from dlenv.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""

SIGNALS = [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
MOMENTS = ["start-up", "mid-epoch", "validation", "save"]
# every signal at every moment; the quick run (`dlenv test`) takes SIGTERM at each moment and each signal
# mid-epoch, about 10 s a case on 2 cores (two trainer processes); CI runs them all
CASES = [pytest.param(signum, code, moment, id=f"{signum.name}-{moment}",
                      marks=() if signum == signal.SIGTERM or moment == "mid-epoch" else pytest.mark.slow)
         for signum, code in SIGNALS for moment in MOMENTS]
#: what a crash, not a stop, looks like
CRASH = ("Traceback", "bug in dlenv", "DataLoader worker", "killed by signal", "exited unexpectedly")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from imagedata import make_train_val

    return make_train_val(tmp_path_factory.mktemp("ds"), per_class=8)  # 16 images: 8 batches of 2


class Trainer:
    """The script above, in `folder`, trained on `dataset`."""

    def __init__(self, folder: Path, dataset: Path):
        self.folder, self.marks = folder, folder / "marks"
        self.marks.mkdir(parents=True, exist_ok=True)
        self.script = folder / "train.py"
        self.script.write_text(textwrap.dedent(_SCRIPT.format(tests=str(REPO / "tests"))))
        self.project = folder / "runs"
        self.last = self.project / "exp" / "last.pth"
        self.args = [sys.executable, str(self.script), "--data", str(dataset), "--project", str(self.project),
                     "--img-size", "16", "--batch-size", "2", "--workers", "2", "--epochs", str(EPOCHS),
                     "--device", "cpu"]

    def env(self, moment: str | None) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DLENV_TEST_MARKS": str(self.marks),
               "PYTHONPATH": str(REPO / "src")}
        env.pop("DLENV_TEST_MOMENT", None)
        if moment:
            env["DLENV_TEST_MOMENT"] = moment
        return env

    def start(self, moment: str, **streams) -> subprocess.Popen:
        """The trainer as the leader of a new session and process group (as a terminal's job is)."""
        streams = streams or {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        return subprocess.Popen(self.args, stdin=subprocess.DEVNULL, text=True, env=self.env(moment),
                                cwd=self.folder, start_new_session=True, **streams)

    def wait_for_moment(self, proc: subprocess.Popen, timeout: float = 120) -> None:
        t = time.monotonic()
        while not (self.marks / "reached").exists():
            if proc.poll() is not None:
                out = proc.communicate()[0] or ""
                pytest.fail(f"the trainer ended (status {proc.returncode}) before the moment: {out[-3000:]}")
            assert time.monotonic() - t < timeout, "the moment never came"
            time.sleep(0.01)

    def signal_group(self, proc: subprocess.Popen, signum: int) -> None:
        os.killpg(proc.pid, signum)  # the trainer and its DataLoader workers alike
        (self.marks / "sent").write_text("")

    def run_again(self, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=self.env(None), cwd=self.folder, timeout=300)

    def epochs(self) -> list[int]:
        return results.read_results(self.project / "exp" / "results.csv")["epoch"].tolist()


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out or ""


def _no_process_left(pgid: int) -> None:
    """No worker of the stopped trainer lingers (its group is empty once it has ended)."""
    t = time.monotonic()
    while time.monotonic() - t < 10:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"processes of group {pgid} are still running 10 s after the trainer ended")


def _resume_command(out: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if "Resume with: " in ln)
    command = shlex.split(line.split("Resume with: ", 1)[1])
    assert command[0] == "python" and command[1].endswith("train.py"), line
    return [sys.executable, *command[1:]]  # `python SCRIPT ...` as printed, by this lane's python


@pytest.mark.parametrize("signum, code, moment", CASES)
def test_a_signal_to_the_whole_group_stops_in_one_line_and_the_run_resumes(tmp_path, dataset, signum, code, moment):
    trainer = Trainer(tmp_path, dataset)
    proc = trainer.start(moment)
    trainer.wait_for_moment(proc)
    trainer.signal_group(proc, signum)
    out = _finish(proc)
    name = signal.Signals(signum).name
    assert proc.returncode == code, out[-3000:]
    assert not any(c in out for c in CRASH), out[-3000:]
    _no_process_left(proc.pid)

    if moment == "start-up":  # nothing trained yet: it says so, writes nothing, and the command starts over
        assert out.count(f"stopped by {name} while starting") == 1, out[-3000:]
        assert "saving last.pth" not in out and not trainer.last.exists(), out[-3000:]
        again = trainer.run_again(trainer.args)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert trainer.epochs() == list(range(1, EPOCHS + 1))
        return

    assert out.count(f"{name}: saving last.pth") == 1, out[-3000:]  # once: not once per worker
    # the way on comes first, before the save: with the signal, and with where the run goes on from
    lines = out.splitlines()
    first = next(ln for ln in lines if ln.startswith(f"{name}: saving last.pth"))
    assert "to go on afterwards: python " in first and first.endswith(f"--resume {trainer.last}"), first
    stopping = [i for i, ln in enumerate(lines) if ln.startswith("stopping after optimizer step")]
    if moment == "mid-epoch":
        assert len(stopping) == 1 and "goes on from epoch 2, batch 4 of " in lines[stopping[0]], out[-3000:]
        assert stopping[0] < next(i for i, ln in enumerate(lines) if ln.startswith(f"stopped by {name}; saved"))
    assert out.count(f"stopped by {name}; saved {trainer.last}. Resume with: ") == 1, out[-3000:]
    saved = runstate.load_state(trainer.last)
    # mid-epoch: the step boundary of epoch 2; in validation or the save: epoch 2 complete
    assert (saved["epoch"], saved["batch_in_epoch"]) == ((1, 3) if moment == "mid-epoch" else (2, 0))
    assert not list(trainer.last.parent.glob(".last.pth.*.tmp"))
    assert trainer.epochs() == ([1] if moment == "mid-epoch" else [1, 2])
    resumed = trainer.run_again(_resume_command(out))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert trainer.epochs() == list(range(1, EPOCHS + 1))  # each epoch once
    assert runstate.load_state(trainer.last)["epoch"] == EPOCHS


def test_the_terminal_closing_saves_the_epoch_in_progress(tmp_path, dataset):
    """The SSH session ends: the terminal hangs up (every later write to it fails with EIO) and the kernel
    sends SIGHUP to its process group. The run saves and exits 129 all the same, without writing a word."""
    trainer = Trainer(tmp_path, dataset)
    master, slave = pty.openpty()
    try:
        proc = trainer.start("mid-epoch", stdout=slave, stderr=subprocess.PIPE)
    finally:
        os.close(slave)
    try:
        trainer.wait_for_moment(proc)
    finally:
        os.close(master)  # the hangup
    trainer.signal_group(proc, signal.SIGHUP)
    err = _finish(proc)
    assert proc.returncode == 129, err[-3000:]
    assert not any(c in err for c in CRASH), err[-3000:]
    assert runstate.load_state(trainer.last)["batch_in_epoch"] == 3
    resumed = trainer.run_again([*trainer.args, "--resume", str(trainer.last)])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert trainer.epochs() == list(range(1, EPOCHS + 1))


def test_the_same_signal_again_at_once_is_one_request(tmp_path, dataset):
    """A shell passes the hangup on to jobs the kernel already told; a cgroup stop reaches a rank and its
    launcher: the same signal twice in a moment is one request (saved, 143), not "stop at once"."""
    trainer = Trainer(tmp_path, dataset)
    proc = trainer.start("mid-epoch")
    trainer.wait_for_moment(proc)
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGTERM)
    (trainer.marks / "sent").write_text("")
    out = _finish(proc)
    assert proc.returncode == 143, out[-3000:]
    assert out.count("SIGTERM: saving last.pth") == 1 and "Traceback" not in out, out[-3000:]
    assert runstate.load_state(trainer.last)["batch_in_epoch"] == 3


def test_a_second_signal_during_the_save_stops_at_once_and_last_pth_is_the_previous_one(tmp_path, dataset):
    """The second SIGTERM (later than a duplicate) in the middle of writing last.pth kills the trainer there:
    the file in place is epoch 1's, whole, and --resume finishes the run from it."""
    trainer = Trainer(tmp_path, dataset)
    proc = trainer.start("save")
    trainer.wait_for_moment(proc)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(1.5)  # past console.DUPLICATE_S: a second request, "stop at once"
    trainer.signal_group(proc, signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == -signal.SIGTERM, out[-3000:]
    assert runstate.load_state(trainer.last)["epoch"] == 1  # the previous file, whole
    _no_process_left(proc.pid)
    resumed = trainer.run_again([*trainer.args, "--resume", str(trainer.last)])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert trainer.epochs() == list(range(1, EPOCHS + 1))
    assert not list(trainer.last.parent.glob(".last.pth.*.tmp"))  # the resume removed the killed write's


def test_a_worker_ignores_stop_signals_from_others_and_ends_when_its_parent_terminates_it(tmp_path):
    """The mechanism underneath: a SafeLoader's worker survives SIGINT, SIGHUP and SIGTERM sent by another
    process (the group's sender), and still exits at once when its parent terminates it, as torch's
    shutdown and multiprocessing's exit do with a worker that does not stop when told."""
    from imagedata import make_image_folder

    from dlenv.data.loaders import ImageDataset, build_transforms, make_loader

    make_image_folder(tmp_path / "ds", per_class=4)
    samples = [(str(p), 0) for p in sorted((tmp_path / "ds").rglob("*.png"))]
    assert samples
    loader = make_loader(ImageDataset(samples, build_transforms(16, False)), 2, 2, False, True)
    batches = iter(loader)
    next(batches)
    workers = list(loader._iterator._workers)  # persistent: the loader keeps its iterator
    try:
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            for w in workers:  # sent by another process, as `timeout` or a terminal sends it
                subprocess.run(["kill", f"-{signal.Signals(s).name[3:]}", str(w.pid)], check=True)
        time.sleep(0.5)
        assert all(w.is_alive() for w in workers)
        assert len(list(batches)) == 3  # they still serve the rest of the pass
        workers[0].terminate()  # SIGTERM from the parent
        workers[0].join(timeout=5)
        assert workers[0].exitcode == 0
    finally:
        loader.close()
    assert not any(w.is_alive() for w in workers)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["TERM", "HUP"])
def test_a_signal_while_pytorch_loads_is_one_line(tmp_path, signum, code):
    """Before the trainer has handlers of its own (torch takes seconds to import): one line and the code,
    whether the signal lands during the import (the CLI's guard) or just after (the trainer's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", "train", "--device", "cpu", "--workers", "0",
                             "--epochs", "1", "--project", str(tmp_path / "runs")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().startswith("dlenv train: loading PyTorch")
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert "stopped by " + signum.name in out + err and not any(c in out + err for c in CRASH), (out, err)


# ---------------------------------------------------------------------------------------------------
# The parts of a stop, one at a time.


def test_the_ranks_vote_about_once_a_second_whatever_a_step_takes(monkeypatch):
    """Each vote proposes the steps that fill VOTE_S at the step time measured since the last one; the ranks
    take the smallest proposal (distributed.vote), so all of them vote at the same steps."""
    from dlenv.cluster import distributed
    from dlenv.train import console

    clock = [100.0]
    votes: list[tuple[int, int]] = []
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])

    def vote(signum, period):
        votes.append((signum, period))
        return signum, period

    monkeypatch.setattr(distributed, "vote", vote)
    stop = console.Stop(lambda msg: None, world_size=2)
    voted_at = []
    for step, seconds in enumerate([0.25] * 12 + [2.0] * 3 + [0.001] * 5000, start=1):
        clock[0] += seconds
        if stop.at_step():
            break
        if votes and len(votes) > len(voted_at):
            voted_at.append(step)
        if step == 2014:
            stop.signum = signal.SIGTERM  # as the handler notes it
    assert voted_at[:6] == [1, 2, 6, 10, 14, 15]  # the first at once, then every 4 steps of 0.25 s, then each 2 s step
    assert [p for _, p in votes[:6]] == [1, 4, 4, 4, 1, 1]
    assert votes[-1][0] == signal.SIGTERM and stop.stopped_by == signal.SIGTERM
    assert 2014 < step <= 2014 + 1000 + 1  # within about a second of 1 ms steps
    assert max(p for _, p in votes) <= console.MAX_VOTE_PERIOD


def test_a_vote_carries_the_signal_to_a_rank_that_did_not_hear_it(monkeypatch):
    from dlenv.cluster import distributed
    from dlenv.train import console

    monkeypatch.setattr(distributed, "vote", lambda signum, period: (int(signal.SIGHUP), 1))
    stop = console.Stop(lambda msg: None, world_size=2)
    assert stop.signum is None and stop.at_step() and stop.stopped_by == signal.SIGHUP


WAY_ON_CASES = [  # (environment, in dlenv's Docker image, what the way on says)
    ({}, False, "dlenv train --resume runs/x/last.pth"),
    ({"DLENV_IMAGE": "1", "DLENV_TORCH_CUDA": "12.8"}, True,
     'docker run --gpus all --ipc=host -v "$PWD":/root/workspace dlenv:cu128 dlenv train --resume runs/x/last.pth'),
    ({"DLENV_IMAGE": "1"}, False, "dlenv train --resume runs/x/last.pth"),  # the image's variable outside Docker
    ({"SLURM_JOB_ID": "9", "DLENV_SLURM_RESUBMIT": "DLENV_RUN=x sbatch s.sbatch --amp", "DLENV_SLURM_REQUEUE": "1"},
     True,
     "Slurm job 9 requeues itself and resumes after scancel --signal=TERM or its time limit; after a plain scancel, "
     "submit it again: DLENV_RUN=x sbatch s.sbatch --amp"),
    ({"SLURM_JOB_ID": "9", "DLENV_SLURM_RESUBMIT": "DLENV_RUN=x sbatch s.sbatch", "DLENV_SLURM_REQUEUE": "0"}, False,
     "Slurm job 9 does not requeue (--no-requeue); submit it again: DLENV_RUN=x sbatch s.sbatch"),
    ({"SLURM_JOB_ID": "9"}, False, "submit the job again with `dlenv train --resume runs/x/last.pth` as its command"),
]


@pytest.mark.parametrize("env, docker, line", WAY_ON_CASES,
                         ids=["shell", "docker", "not-docker", "slurm-requeue", "slurm-no-requeue", "own-sbatch"])
def test_the_way_on_is_for_where_the_run_is(monkeypatch, env, docker, line):
    from dlenv.train import console

    for var in ("SLURM_JOB_ID", "DLENV_SLURM_RESUBMIT", "DLENV_SLURM_REQUEUE", "DLENV_IMAGE", "DLENV_TORCH_CUDA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DLENV_COMMAND", "dlenv train")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: docker if str(p) == "/.dockerenv" else real_exists(p))
    assert console.way_on(Path("runs/x/last.pth")) == line


def test_the_stop_says_where_it_goes_on_from_before_it_saves(monkeypatch):
    from dlenv.train import console

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("DLENV_COMMAND", "dlenv train")
    last = Path("runs/x/last.pth")
    assert console.stopping_line(1, 3, 20, 23, last) == (
        "stopping after optimizer step 23; saving runs/x/last.pth, which goes on from epoch 2, batch 4 of 20, "
        "with: dlenv train --resume runs/x/last.pth")
    assert "goes on from the start of epoch 3," in console.stopping_line(2, 0, 20, 40, last)


def test_every_resume_line_names_the_launch_options(monkeypatch):
    """A run launched with --gpus 2 (and more) is told to resume with them, not on one process (issue 53 item 6)."""
    from dlenv.train import console

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("DLENV_COMMAND", "python train.py")
    last, flags = Path("runs/x/last.pth"), ["--gpus", "2", "--master-addr", "node 0"]
    again = "python train.py --resume runs/x/last.pth --gpus 2 --master-addr 'node 0'"
    assert console.way_on(last, flags) == again
    assert console.stopping_line(1, 3, 20, 23, last, flags).endswith(f"with: {again}")
    assert console.stopped_line(signal.SIGTERM, last, flags).endswith(f"Resume with: {again}")
    assert console.stopped_early_line(signal.SIGTERM, str(last), flags).endswith(f"Resume with: {again}")
    assert console.Stop(lambda msg: None, 2, last, flags).way_on == again


@pytest.mark.parametrize("device, who, gpu_tips", [("cuda", "the GPU waited", True), ("cpu", "training waited", False)])
def test_the_data_wait_advice_names_the_device_that_waited(device, who, gpu_tips):
    from dlenv.train import console

    advice = console.data_wait_advice(0.4, cache=False, gpu_augment=False, workers=2, device=device)
    assert advice.startswith(f"{who} for data 40% of this epoch")
    assert ("--gpu-augment" in advice) == gpu_tips and ("GPU" in advice) == gpu_tips
