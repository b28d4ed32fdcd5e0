"""What the trainer says and hears: the progress bar, the epoch line, the data-wait advice, and the stop
signals SIGINT (Ctrl-C), SIGTERM (docker stop, systemd, scancel, timeout) and SIGHUP (the terminal or
SSH session closed).

A signal does not stop the run where it lands: `Stop` only notes it, and says at once how the run will go
on (`way_on`: under Slurm the resubmission, in Docker the `docker run` line, else the command), before
anything is saved, so a kill during the save still leaves the way on in the log. The loop asks
`at_step()` after each optimizer step (and `requested()` after each epoch's validation and saves), so the
run stops at a step boundary, says where it goes on from, saves last.pth and exits 130 / 143 / 129. In a
run of several processes a signal may reach some ranks only (or at another step), so the ranks vote at
points every rank passes: every k steps, k adapting to the step time so that votes come about VOTE_S
apart (a stop is taken within about a second of the signal, plus the step under way). A second signal
stops at once (Python's default behaviour), except the same signal again within DUPLICATE_S: that is
one request that came twice (a shell passes its hangup on to the jobs the kernel already told; a
cgroup-wide stop reaches a rank and also its launcher, which forwards it). Before the loop there is
nothing to save yet: `StartUp` ends the run at once, in one line. The DataLoader workers leave these
signals to the main process (dlenv.data.loaders), which shuts them down itself when it stops.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dlenv import invocation, progress
from dlenv.cluster import distributed
from dlenv.errors import EXIT_SIGHUP, EXIT_SIGINT, EXIT_SIGTERM, stop

#: exit status for each stop signal (128 + its number, as shells report it)
SIGNAL_EXIT = {signal.SIGINT: EXIT_SIGINT, signal.SIGTERM: EXIT_SIGTERM, signal.SIGHUP: EXIT_SIGHUP}
#: seconds within which the same signal again is the same request, not "stop at once"
DUPLICATE_S = 1.0
#: data-wait share of an epoch above which the trainer explains the bottleneck
WAIT_LIMIT = 0.2
#: seconds between the ranks' stop votes, about (the vote's period in steps adapts to the step time)
VOTE_S = 1.0
#: the most steps between two votes (steps of microseconds: a vote every second is still cheap)
MAX_VOTE_PERIOD = 10_000


def printer(enabled: bool) -> Callable[[str], None]:
    """`say(msg)`: print and flush on the main process, nothing elsewhere. A console that is gone (the
    terminal or SSH session closed: EIO; a log pipe closed: EPIPE) is silenced, not a reason to stop."""
    def say(msg: str) -> None:
        if enabled:
            try:
                print(msg, flush=True)
            except OSError as e:
                if e.errno not in _GONE:
                    raise
                silence_console()

    return say


def _hung_up(fd: int) -> bool:
    """Whether `fd` is a terminal that hung up: still a character device, no longer answering as a tty."""
    import stat

    try:
        return stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd) and not os.path.samefile(
            f"/proc/self/fd/{fd}", os.devnull)
    except OSError:
        return False


#: what writing to a console that is no longer there fails with
_GONE = (errno.EIO, errno.EPIPE, errno.ENXIO)


def silence_console() -> None:
    """Point stdout, which just failed, at /dev/null for the rest of the process (and stderr too where
    it is the same hung-up terminal): after a hangup every write to the terminal fails, and a progress
    line must not end the run that SIGHUP is saving. A stderr that still works (a log file) is kept."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                fd = stream.fileno()
            except (AttributeError, ValueError, OSError):  # not a real file (captured): nothing to silence
                continue
            if stream is sys.stderr and not _hung_up(fd):
                continue
            os.dup2(null, fd)
            # what the buffer still holds goes nowhere too, instead of failing again at the next write
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    finally:
        os.close(null)


class _Handlers:
    """A context manager that puts `self._handle` on the stop signals (SIGNAL_EXIT) in the main thread and
    gives the previous handlers back at its end."""

    _old: dict[int, Any]

    def _handle(self, signum: int, frame: Any) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNAL_EXIT:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class Stop(_Handlers):
    """SIGINT/SIGTERM/SIGHUP handlers that ask the loop to stop at the next optimizer step; a second
    signal stops at once (the same one within DUPLICATE_S counts once). `moment` names where the run
    is, for the line the signal gets ("this optimizer step", "this epoch's validation"), which also says
    how to go on from `last` (`way_on`). A context manager: the previous handlers come back at its end."""

    def __init__(self, say: Callable[[str], None], world_size: int = 1, last: Path | None = None,
                 flags: Sequence[str] = ()):
        self.signum: int | None = None
        self.say, self.world_size = say, world_size
        self.moment = "this optimizer step"
        self.way_on = way_on(last, flags) if last is not None else ""  # made now: the handler only prints it
        self._pid = os.getpid()
        self._old: dict[int, Any] = {}
        self._at = 0.0
        self._order = itertools.count()
        self._countdown, self._period, self._voted = 1, 1, 0.0  # the first vote after the first step
        self._peers: int = 0  # the signal another rank heard, as the vote told this one

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:
            # a DataLoader worker that has not reached its own start-up yet (dlenv.data.loaders); the
            # trainer stops the workers itself once it has saved
            return
        # next() is one C call: a second signal whose handler runs inside this one (Python may switch at
        # any bytecode) gets 1 even before self.signum is set, and is not taken for the first
        if next(self._order):
            if self.signum is None or (signum == self.signum and time.monotonic() - self._at < DUPLICATE_S):
                return  # the first is being handled this very moment, or a duplicate of it
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum, self._at = signum, time.monotonic()
        on = f"; to go on afterwards: {self.way_on}" if self.way_on else ""
        self.say(f"\n{signal.Signals(signum).name}: saving last.pth at the end of {self.moment} "
                 f"(send it again to stop at once){on}")

    @property
    def stopped_by(self) -> int | None:
        """The signal that stops the run: this process's, or the one another rank heard (by the votes)."""
        return self.signum or self._peers or None

    def requested(self) -> bool:
        """Whether to stop here. With several processes the ranks agree (a collective: call it only at
        points every rank passes in the same order)."""
        if self.world_size == 1:
            return self.signum is not None
        self._peers = int(distributed.agree(self.signum or 0, "max"))
        return self._peers > 0

    def at_step(self) -> bool:
        """After each optimizer step: whether to stop here. Alone, whether a signal came. With several
        processes the ranks vote every `period` steps (every rank counts the same steps), and each vote
        also sets the next period: the fewest steps any rank measured to fill VOTE_S, so a signal is
        acted on about VOTE_S after it came (plus the step under way) however long a step takes."""
        if self.world_size == 1:
            return self.signum is not None
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now = time.monotonic()
        per_step = (now - self._voted) / self._period if self._voted else VOTE_S
        proposed = max(1, min(MAX_VOTE_PERIOD, int(VOTE_S / max(per_step, 1e-9))))
        self._peers, self._period = distributed.vote(self.signum or 0, proposed)
        self._countdown, self._voted = self._period, time.monotonic()
        return self._peers > 0



class StartUp(_Handlers):
    """The stop signals from the start of a run to its loop (loading data, building the model, the
    --batch-size auto probe): nothing is trained yet, so a signal ends the run at once by raising
    errors.Stopped (errors.stop: a BaseException, and noted where no library can lose it);
    `stopped_early_line` says so. A context manager: the previous handlers come back at
    its end. The loop's `Stop` replaces it for the epochs."""

    def __init__(self):
        self._pid = os.getpid()
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if os.getpid() == self._pid:  # not in a DataLoader worker before its start-up (dlenv.data.loaders)
            stop(signum)



def resume_args(last_path: Any, flags: Sequence[str] = ()) -> str:
    """`--resume PATH` and `flags`, the launch options the run was started with (`--gpus 2`,
    dlenv.cluster.launch.relaunch_flags): the arguments that resume it as it was launched."""
    return " ".join([f"--resume {last_path}", *(shlex.quote(f) for f in flags)])


def stopped_early_line(signum: int, resume: str | None, flags: Sequence[str] = ()) -> str:
    """What a run stopped before its first step says: nothing was trained, and what to run again."""
    name = signal.Signals(signum).name
    if resume:
        return (f"stopped by {name} while starting, before the first step; the run to resume is as it was. "
                f"Resume with: {invocation.again('train', resume_args(resume, flags))}")
    return f"stopped by {name} while starting, before the first step; nothing was trained or saved"


def new_end_line(old: int, new: int, step: int) -> str:
    """What a resume with --epochs `new` (the run's: `old`) says: its new end and how the schedule follows."""
    return (f"--epochs {new}: the run now ends after epoch {new} instead of {old}; from optimizer step {step} on, "
            f"the learning rate is that of a {new}-epoch run's warmup-cosine at the same step (as if it had been "
            "started with this --epochs); optimizer, scaler, sampler and random states go on as saved")


def stopped_line(signum: int | None, last_path: Path | None, flags: Sequence[str] = ()) -> str:
    """What the run says when a signal stopped it: where it saved, and how to resume (with `flags`, the
    launch options it was started with)."""
    return (f"stopped by {signal.Signals(signum).name if signum else 'a signal'}; saved {last_path}. "
            f"Resume with: {invocation.again('train', resume_args(last_path, flags))}")  # where: `way_on`, said first


def stopping_line(epoch: int, batch_in_epoch: int, batches: int, step: int, last_path: Path | None,
                  flags: Sequence[str] = ()) -> str:
    """What a stop says before it saves (a kill during the save still leaves it): where the run goes on
    from (`epoch` done, `batch_in_epoch` of `batches` of the next) and how."""
    where = (f"epoch {epoch + 1}, batch {batch_in_epoch + 1} of {batches}" if batch_in_epoch
             else f"the start of epoch {epoch + 1}")
    return (f"stopping after optimizer step {step}; saving {last_path}, which goes on from {where}, "
            f"with: {way_on(last_path, flags)}")


def way_on(last_path: Path | None, flags: Sequence[str] = ()) -> str:
    """How to go on from `last_path` where this process runs, launched with `flags` as the run was (`--gpus
    2`, `resume_args`). Under Slurm (SLURM_JOB_ID), the resubmission scripts/tools/slurm_train.sbatch names
    (DLENV_SLURM_RESUBMIT) and whether the job requeues itself (DLENV_SLURM_REQUEUE); in dlenv's image under
    Docker (/.dockerenv), the `docker run` line; else the command."""
    resume = invocation.again("train", resume_args(last_path, flags))
    if os.environ.get("SLURM_JOB_ID"):
        again = os.environ.get("DLENV_SLURM_RESUBMIT")
        if not again:  # a batch script of the user's own
            return f"submit the job again with `{resume}` as its command"
        if os.environ.get("DLENV_SLURM_REQUEUE") == "1":
            return (f"Slurm job {os.environ['SLURM_JOB_ID']} requeues itself and resumes after scancel --signal=TERM "
                    f"or its time limit; after a plain scancel, submit it again: {again}")
        return f"Slurm job {os.environ['SLURM_JOB_ID']} does not requeue (--no-requeue); submit it again: {again}"
    if os.environ.get("DLENV_IMAGE") and Path("/.dockerenv").exists():  # in dlenv's image (its Dockerfile sets it)
        tag = "dlenv:cu" + os.environ.get("DLENV_TORCH_CUDA", "11.6").replace(".", "")  # the README's tags
        return f'docker run --gpus all --ipc=host -v "$PWD":/root/workspace {tag} {resume}'
    return resume


class Progress:
    """The epoch's progress: a tqdm bar with its ETA on a terminal; in a log, a line after the first
    step and then every `interval` seconds (`dlenv.progress`), whatever a step costs. With `run_eta`
    (a progress.RunEta) both also show the time left in the whole run. Its img/s is the epoch's so far
    over all `world` processes, the number the epoch line and results.csv give at the epoch's end."""

    def __init__(self, total: int, start: int, desc: str, enabled: bool, interval: float = progress.LOG_INTERVAL_S,
                 run_eta: progress.RunEta | None = None, world: int = 1):
        self.total, self.done, self.run_eta, self.world = total, start, run_eta, world
        if run_eta is not None:
            run_eta.start()  # the first step's time then gives the first line its run ETA
        self.shown = progress.Progress(total, desc, start=start, enabled=enabled, unit="batch", interval=interval)

    def update(self, done: int, loss: float, ips: float, mem_gib: float) -> None:
        eta = ""
        if self.run_eta is not None:
            self.run_eta.trained(done - self.done)
            eta = f"  {self.run_eta.text()}"
        self.done = done
        self.shown.update(done, f"loss {loss:.4f}  {ips * self.world:,.0f} img/s  {mem_gib:.1f} GiB{eta}")

    def close(self) -> None:
        self.shown.close()


def epoch_line(row: dict[str, Any], epochs: int, improved: bool, compile_s: float = 0.0,
               run_eta: progress.RunEta | None = None) -> str:
    """The line printed after each epoch, from its results.csv row (and the seconds torch.compile took
    in it, a phase apart: img/s and data wait leave it out), with the time left in the run when more
    epochs follow."""
    val = (f"val loss {row['val_loss']:.4f}  top-1 {row['top1']:.2f}%  top-5 {row['top5']:.2f}%"
           if row["top1"] is not None else "no validation data")
    return (f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f}  {val}  lr {row['lr']:.3g}  "
            f"{row['img_per_s']:,.0f} img/s  data wait {row['data_wait']:.0%}  {row['epoch_s']:.1f} s  "
            + (f"(compile {compile_s:.1f} s)  " if compile_s else "") +
            f"peak {row['mem_alloc_gib']:.2f}/{row['mem_reserved_gib']:.2f} GiB alloc/reserved"
            + ("  *best*" if improved else "")
            + (f"  {run_eta.text()}" if run_eta is not None and row["epoch"] < epochs else ""))


def run_eta(epochs: int, batches_per_epoch: int, epoch: int, batch_in_epoch: int, val: Any) -> progress.RunEta:
    """The whole run's clock from where a (possibly resumed) run starts: its batches and validations left."""
    left = epochs - epoch
    val_batches = len(val) if val is not None and hasattr(val, "__len__") else 0
    return progress.RunEta(left * batches_per_epoch - batch_in_epoch, left if val is not None else 0, val_batches,
                           batches_per_epoch=batches_per_epoch)


def done_line(epochs: int, seconds: float, metric: str, best_metric: float | None, best: Path | None,
              run_dir: Path | None) -> str:
    """The run's last line: what it did, where its weights are, and the commands to look at them."""
    head = f"done: {epochs} epoch{'' if epochs == 1 else 's'} in {progress.clock_text(seconds)}"
    if best_metric is not None:
        head += f"; best {metric} {best_metric:.2f}"
    if best is None:
        return f"{head}; no best_model.pth was written"
    return (f"{head}; weights in {best}. Next: {invocation.command('val', f'--weights {best}')} (per-class "
            f"report, confusion matrix), {invocation.command('plot', f'--log-dir {run_dir}')} (curves)")


def data_wait_advice(share: float, cache: bool, gpu_augment: bool, workers: int,
                     device: str = "cuda") -> str | None:
    """The trainer's one-time explanation when `share` of an epoch was spent waiting for data, or None
    below WAIT_LIMIT. `device`: the type of the device that trained ('cuda', 'cpu', ...)."""
    if share <= WAIT_LIMIT:
        return None
    tips = []
    on_gpu = device == "cuda"  # caching and GPU augmentation move work onto a GPU: no help to a CPU run
    if on_gpu and not cache:
        tips.append("--cache (decode the dataset once; crops and flips then run on the GPU)")
    if on_gpu and not gpu_augment:
        tips.append("--gpu-augment on (uint8 batches, augmented on the GPU)")
    tips.append(f"more --workers than {workers} if CPU cores are idle")
    tips.append(f"`{invocation.command('bench-data', '')}` to measure loader and model speed apart")
    who = "the GPU" if on_gpu else "training"
    return (f"{who} waited for data {share:.0%} of this epoch: the input pipeline, not the model, sets the "
            "pace. Try: " + "; ".join(tips) + ".")
