"""`dlenv train --gpus N`: start the same command again as N torchrun workers per node.

`launch(cfg)` runs `python -m dlenv.cluster.launch <torchrun options> -m dlenv.cli train <flags>`: torchrun
(`torch.distributed.run`) with N processes per node, the multi-node flags going to its rendezvous,
and forwards SIGTERM/SIGINT/SIGHUP to it once, so rank 0 saves one run file. `python -m dlenv.cluster.launch` is
torchrun's main ending in one line that names the rank that failed, instead of a traceback.

Nothing here imports torch at module level: the launching process only parses flags and waits.
Inside each worker, `dlenv.cluster.distributed` joins the process group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from dlenv.errors import EXIT_PEER, UserError
from dlenv.options import config
from dlenv.options.cpus import usable_cpus

#: torchrun checks its workers this often (seconds): how fast a dead rank takes the job down
MONITOR_INTERVAL_S = 1


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def needs_launch(cfg: Any) -> bool:
    """Whether `cfg` asks for several processes and this process is not one of them yet."""
    return (cfg.gpus > 1 or cfg.nnodes > 1) and not in_torchrun()


def check_launch(cfg: Any) -> None:
    """Refuse launch options that cannot work, before any process starts. Raises UserError."""
    if cfg.node_rank >= cfg.nnodes:
        raise UserError(f"--node-rank {cfg.node_rank} must be below --nnodes {cfg.nnodes} "
                        f"(nodes are numbered 0..{cfg.nnodes - 1})")
    device = cfg.device
    if device.startswith("cuda:"):
        raise UserError(f"--device {device} picks one GPU, but --gpus {cfg.gpus} gives each process its "
                        "own (cuda:0..); use --device cuda, and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if device == "cpu":
        return  # N CPU processes talking gloo: how the CI tests run, and a way to try a setup
    if device not in ("auto", "cuda"):
        raise UserError(f"--device {device!r} is not a device; use cuda, cpu or auto with --gpus")
    import torch  # the one question only torch answers: how many GPUs this process sees

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        asked = f"--gpus {cfg.gpus}" + (f" --nnodes {cfg.nnodes}" if cfg.nnodes > 1 else "")
        procs = f"{cfg.gpus} CPU process{'es' if cfg.gpus > 1 else ''}" + (" on each node" if cfg.nnodes > 1 else "")
        alone = ", or leave --gpus out for one process" if cfg.gpus > 1 and cfg.nnodes == 1 else ""
        raise UserError(f"{asked}: no CUDA GPU is visible (run verify-env); use --device cpu to run {procs}{alone}")
    if cfg.gpus > visible:
        raise UserError(f"--gpus {cfg.gpus}: only {visible} GPU(s) visible on this node; use --gpus {visible} "
                        "(or check CUDA_VISIBLE_DEVICES and nvidia-smi)")


def train_flags(cfg: Any) -> list[str]:
    """The `dlenv train` flags that rebuild `cfg` (options at their default are left out)."""
    flags: list[str] = []
    for f in config.options(type(cfg)):
        value = getattr(cfg, f.name)
        if value == f.default or value is None:
            continue
        name = config.flag(f.name)
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple):
            flags += [name, ",".join(str(v) for v in value)]
        else:
            flags += [name, str(value)]
    return flags


#: the options that say how a run was launched (torchrun's share of `train_flags`): a resume names them again
LAUNCH_OPTIONS = ("gpus", "nnodes", "node_rank", "master_addr", "master_port", "dist_timeout")


def relaunch_flags(cfg: Any) -> list[str]:
    """The flags of `cfg`'s launch options not at their default (`--gpus 2`, `--nnodes 2 --node-rank 0 ...`):
    what a resume line adds to `--resume PATH` so that the run goes on as it was launched (a resume takes
    them from its command, dlenv.runfolder.trainstate.RESUME_FROM_COMMAND)."""
    flags: list[str] = []
    for f in config.options(type(cfg)):
        value = getattr(cfg, f.name)
        if f.name in LAUNCH_OPTIONS and value != f.default and value is not None:
            flags += [config.flag(f.name), str(value)]
    return flags


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), for a single node's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(cfg: Any, port: int | None = None) -> list[str]:
    """torchrun's options for `cfg` (underscore spellings: 1.13 knows no others).

    One node: a static rendezvous on 127.0.0.1 and a free port (or `port`), so runs started side by
    side never meet. Several nodes: --nnodes/--node_rank/--master_addr/--master_port as given.
    """
    if cfg.nnodes == 1:
        addr, port = "127.0.0.1", port or free_port()
    else:
        addr, port = cfg.master_addr, cfg.master_port
    return ["--nproc_per_node", str(cfg.gpus), "--nnodes", str(cfg.nnodes), "--node_rank", str(cfg.node_rank),
            "--master_addr", addr, "--master_port", str(port), "--max_restarts", "0",
            "--monitor_interval", str(MONITOR_INTERVAL_S)]


def launch_command(cfg: Any, port: int | None = None) -> list[str]:
    """The command `launch` runs: this module's torchrun wrapper, then `-m dlenv.cli train <flags>`."""
    return [sys.executable, "-m", "dlenv.cluster.launch", *torchrun_args(cfg, port),
            "-m", "dlenv.cli", "train", *train_flags(cfg)]


def launch(cfg: Any) -> int:
    """Run `dlenv train` with `cfg` as torchrun workers on this node; return the exit status.

    The launcher is a process of its own session, so a Ctrl-C in the terminal reaches only this
    process, which forwards it (and SIGTERM, SIGHUP) to torchrun, which passes it to every worker
    once: the workers finish the step and rank 0 saves last.pth (exit 130/143/129). A second signal is
    forwarded too and stops them at once; the same signal within a second of the first is taken as
    the same request (dlenv.train.console): where systemd or scancel signal every process, a rank hears
    it from them and again from torchrun. Raises UserError for options that cannot launch.
    """
    check_launch(cfg)  # the caller gives the resumed run's own device (runfolder.resumed_device)
    env = dict(os.environ)
    # torchrun would set 1 and print a banner about it; a share of the cores is the better default
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // cfg.gpus)))  # affinity and cgroup quota
    proc = subprocess.Popen(launch_command(cfg), env=env, start_new_session=True)

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, forward) for s in forwarded}
    try:
        rc = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc


def _root_failure(err: Any) -> tuple[int, Any]:
    """(rank, failure) of torchrun's ChildFailedError that caused the others: not a rank that only saw
    its peer go (EXIT_PEER) or was stopped by torchrun (SIGTERM), where another failed differently."""
    def key(item: tuple[int, Any]) -> tuple[bool, float, int]:
        rank, f = item
        return f.exitcode in (EXIT_PEER, -signal.SIGTERM, 128 + signal.SIGTERM), f.timestamp, rank

    return min(err.failures.items(), key=key)


def _failure_line(err: Any) -> str:
    """One line for torchrun's ChildFailedError: which rank failed, and how."""
    rank, failure = _root_failure(err)
    who = f"dlenv train: rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    if failure.exitcode == EXIT_PEER:  # torchrun saw only a rank that lost its peer, not the peer itself
        return (f"{who} stopped because another process of the run failed; the first 'dlenv train: error' "
                "line above names the cause")
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with status {failure.exitcode}")
    hint = " (out of host memory? see dmesg)" if failure.exitcode == -signal.SIGKILL else ""
    return f"{who} {how}{hint}; the other processes were stopped. Its own error is printed above"


#: torchrun's log lines that dlenv's own lines say already: that a stop signal came and was passed on to the
#: workers (twice where a scheduler signals torchrun itself as well as the launcher that forwards it), and
#: that a worker failed (_failure_line names it). Its other warnings (a worker it had to kill after the
#: grace time) still show.
_ROUTINE = ("death signal, shutting down workers", "closing signal", "failed (exitcode:")


class _RoutineFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _ROUTINE)


def _quiet_routine_lines() -> None:
    """Drop _ROUTINE's lines from torchrun's loggers (imported by now: torch.distributed.run)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]
    for name in names:
        logging.getLogger(name).addFilter(_RoutineFilter())


def _no_exit_barrier_after_a_failure() -> None:
    """After its workers failed, PyTorch 1.13's torchrun agent still waits at the exit barrier, up to 300 s,
    for the agents of the other nodes, which may be the ones that died: a node's task then outlives its
    ranks by five minutes (a Slurm job holds its nodes that long). PyTorch 2.x returns at once after a
    failure; with this 1.13 does too. A run that succeeded still waits for every node."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

    barrier = SimpleElasticAgent._exit_barrier

    def exit_barrier(self: Any) -> None:
        if self._worker_group.state != WorkerState.FAILED:
            barrier(self)

    SimpleElasticAgent._exit_barrier = exit_barrier


#: how long the workers may take to finish their step and save after a stop signal before the agent kills
#: them (torchrun's own grace is 30 s; a rank 0 writing a large last.pth to a slow disk can need more, and a
#: scheduler's or Docker's own SIGKILL comes first where they set a shorter one)
STOP_GRACE_S = 60.0


def _signals_reach_the_workers_not_the_agent() -> list[int]:
    """torchrun's agent turns SIGTERM/SIGINT/SIGHUP into an exception raised wherever its main thread is.
    Raised inside subprocess's poll(), between taking a lock and the `try` that frees it, the lock stays
    held and the agent's final wait() blocks for good: CI saw a Slurm task that never ended after `scancel
    --signal=TERM` (its rank a zombie, torchrun "unable to shutdown" it, the job RUNNING 12 minutes later).
    From here on the agent's signals go to `_StopForwarder` instead. Returns the list of the signals it
    received (_torchrun's exit status)."""
    import threading

    from torch.distributed.elastic.multiprocessing import api

    forwarder = _StopForwarder(api.SignalException)
    start = api.PContext.start

    def start_then_take_the_signals(self: Any) -> None:
        start(self)  # starts the workers, with torch's handlers in place
        forwarder.contexts.append(self)
        if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, forwarder)

    api.PContext.start = start_then_take_the_signals
    return forwarder.received


class _StopForwarder:
    """The agent's handler of a stop signal: it passes the signal to the workers and lets the agent carry
    on. The ranks finish the step, rank 0 saves, they exit 143 (or 130/129), and the agent sees them end.
    Workers still running STOP_GRACE_S after the first signal are killed, as torchrun does after its grace.
    Only once every worker has been waited for (the agent polls no more: the exit barrier, its shutdown)
    does a signal end the agent as torchrun's own handler does, by raising `signal_exception`; a worker
    that has exited but is not yet waited for is one the agent is about to poll."""

    def __init__(self, signal_exception: type[Exception]):
        self.signal_exception = signal_exception
        self.contexts: list[Any] = []  # torchrun's process contexts: pids() gives {local rank: pid}
        self.received: list[int] = []

    def _states(self) -> list[str]:
        states = (_child_state(pid) for ctx in self.contexts for pid in ctx.pids().values())
        return [s for s in states if s is not None]

    def workers(self) -> list[int]:
        """The workers still running (not exited)."""
        return [pid for ctx in self.contexts for pid in ctx.pids().values()
                if _child_state(pid) not in (None, "Z", "X")]

    def __call__(self, signum: int, frame: Any) -> None:
        import threading

        if not self._states():
            raise self.signal_exception(f"Process {os.getpid()} got signal: {signum}", signal.Signals(signum))
        if not self.received:
            timer = threading.Timer(STOP_GRACE_S, self.kill_the_rest)
            timer.daemon = True  # the agent's exit does not wait for it
            timer.start()
        self.received.append(signum)
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def kill_the_rest(self) -> None:
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _child_state(pid: int) -> str | None:
    """The state letter /proc gives `pid` (R, S, D, ..., Z for exited but not waited for) when it is a child
    of this process, else None: a pid reused after the child was waited for is never taken for it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces: state, ppid, ...
    return fields[0] if len(fields) > 1 and int(fields[1]) == os.getpid() else None


def _torchrun(argv: list[str]) -> int:
    """torch.distributed.run's main, ending in an exit status and one line instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _quiet_routine_lines()
    _no_exit_barrier_after_a_failure()
    received = _signals_reach_the_workers_not_the_agent()
    try:
        torchrun_main(argv)
    except SignalException as e:  # a signal with no worker running (before they started, or after)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if received:  # the workers stopped on the signal passed to them, and printed their own lines
            return 128 + received[0]
        print(_failure_line(e), file=sys.stderr, flush=True)
        rank, failure = _root_failure(e)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


if __name__ == "__main__":  # `python -m dlenv.cluster.launch <torchrun options> ...`, as launch() runs it
    status = _torchrun(sys.argv[1:])
    # The workers have ended and torchrun has shut its agent down: nothing here is left to tidy, and PyTorch
    # 2.x's interpreter teardown took 5 s on a loaded 2-core machine, time a scheduler's KillWait counts
    # after a stop (the batch script that says how to resume comes after it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
