"""dlenv.cluster.launch: the torchrun command a --gpus N run starts, the options it refuses, and the one line
that names a failed rank instead of torchrun's traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dlenv import cli
from dlenv.cluster import launch
from dlenv.errors import UserError
from dlenv.options import config
from dlenv.options.config import TrainConfig

WORKER = Path(__file__).resolve().parents[1] / "_distributed_worker.py"


@pytest.mark.slow
def test_torchrun_wrapper_names_the_failed_rank_and_its_status(tmp_path):
    port = launch.free_port()
    cmd = [sys.executable, "-m", "dlenv.cluster.launch", "--nproc_per_node", "2", "--nnodes", "1",
           "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(port), "--max_restarts", "0",
           "--monitor_interval", "1", str(WORKER), "torchrun_fail"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 3, p.stderr[-2000:]
    assert "dlenv train: rank 1 (local rank 1" in p.stderr and "exited with status 3" in p.stderr
    assert "Traceback" not in p.stderr.split("dlenv train: rank 1")[-1]
    assert time.perf_counter() - t0 < 60


def _failures(**codes):
    from types import SimpleNamespace

    fs = {int(r[1:]): SimpleNamespace(exitcode=c, local_rank=int(r[1:]), pid=100 + int(r[1:]), timestamp=0,
                                      signal_name=lambda c=c: signal.Signals(-c).name) for r, c in codes.items()}
    return SimpleNamespace(failures=fs)


def test_failure_line_blames_the_cause_not_the_ranks_that_lost_it():
    line = launch._failure_line(_failures(r0=launch.EXIT_PEER, r1=3, r2=-signal.SIGTERM))
    assert line.startswith("dlenv train: rank 1 (local rank 1, pid 101) exited with status 3")
    line = launch._failure_line(_failures(r0=launch.EXIT_PEER, r3=-signal.SIGKILL))
    assert "rank 3" in line and "killed by SIGKILL (out of host memory" in line
    line = launch._failure_line(_failures(r0=launch.EXIT_PEER))
    assert "rank 0" in line and "stopped because another process of the run failed" in line


@pytest.mark.parametrize("message, shown", [
    ("Received 15 death signal, shutting down workers", False),
    ("Sending process 4242 closing signal SIGTERM", False),
    ("failed (exitcode: 6) local_rank: 0 (pid: 4242) of binary: /usr/bin/python", False),  # _failure_line's
    ("Unable to shutdown process 4242 via 15, forcefully exitting via 9", True),  # a real problem: shown
], ids=["received", "forwarded", "failed", "killed-after-grace"])
def test_torchruns_routine_lines_are_dropped_and_others_kept(message, shown):
    import logging

    record = logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.WARNING, __file__, 1,
                               message, None, None)
    assert launch._RoutineFilter().filter(record) is shown


def test_after_a_failure_torchrun_does_not_wait_for_the_other_nodes(monkeypatch):
    """PyTorch 1.13's agent waited 300 s at the exit barrier after its workers failed (for nodes that may be
    dead); with dlenv's wrapper only a run that succeeded waits for every node, as 2.x does."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

    waited = []
    monkeypatch.setattr(SimpleElasticAgent, "_exit_barrier", lambda self: waited.append(self._worker_group.state))
    launch._no_exit_barrier_after_a_failure()
    for state in (WorkerState.FAILED, WorkerState.SUCCEEDED):
        SimpleElasticAgent._exit_barrier(SimpleNamespace(_worker_group=SimpleNamespace(state=state)))
    assert waited == [WorkerState.SUCCEEDED]


class _Ctx:
    """Stands in for torchrun's process context: what _StopForwarder reads of it."""

    def __init__(self, *procs: subprocess.Popen):
        self.procs = procs

    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in enumerate(self.procs)}


class _Stop(Exception):
    def __init__(self, msg, sigval):
        super().__init__(msg)
        self.sigval = sigval


def _child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"import signal, sys, time\n{code}\nprint('ready', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # its handlers are in place
    return proc


def test_a_stop_signal_goes_to_the_workers_and_the_agent_carries_on(monkeypatch):
    """torchrun raised SignalException wherever its main thread was: inside subprocess's poll() that left a
    lock held and the agent hung in its last wait(). The forwarder raises nothing while workers run: it
    passes the signal to them and records it; a worker that ignores it is killed after the grace time."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.5)
    polite = _child("")
    stubborn = _child("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    forwarder = launch._StopForwarder(_Stop)
    forwarder.contexts.append(_Ctx(polite, stubborn))
    assert forwarder(signal.SIGTERM, None) is None  # no exception in the agent's main thread
    assert forwarder.received == [signal.SIGTERM]
    while launch._child_state(polite.pid) != "Z":  # ended on the signal; not yet waited for
        time.sleep(0.02)
    assert launch._child_state(stubborn.pid) not in (None, "Z")  # still running, within the grace time
    while launch._child_state(stubborn.pid) != "Z":
        time.sleep(0.02)  # killed after the grace time
    # exited but not waited for: the agent is about to poll them, so a signal now still raises nothing
    assert forwarder(signal.SIGTERM, None) is None and forwarder.received == [signal.SIGTERM] * 2
    assert polite.wait(10) == -signal.SIGTERM and stubborn.wait(10) == -signal.SIGKILL
    with pytest.raises(_Stop) as stopped:  # every worker waited for: the agent stops as torchrun's handler does
        forwarder(signal.SIGTERM, None)
    assert stopped.value.sigval == signal.SIGTERM


@pytest.mark.parametrize("state", ["running", "zombie", "reaped", "not a child"])
def test_a_childs_state_is_read_only_for_this_processs_children(state):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)" if state == "running" else ""])
    pid = proc.pid
    if state in ("zombie", "reaped"):
        while launch._child_state(pid) != "Z":
            time.sleep(0.02)  # exited, not yet waited for
        if state == "reaped":
            proc.wait()
    if state == "not a child":
        proc.wait()
        pid = os.getppid()
    try:
        seen = launch._child_state(pid)
        assert {"running": seen not in (None, "Z"), "zombie": seen == "Z", "reaped": seen is None,
                "not a child": seen is None}[state], seen
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------------
# The launch command.


def test_train_flags_rebuild_the_same_config():
    cfg = config.build(TrainConfig, data="d s", amp=True, channels_last=False, batch_size="auto", gpus=2,
                       lr=0.05, clip_grad=1.0, epochs=3, max_steps=5, name="a b")
    flags = launch.train_flags(cfg)
    assert "--no-channels-last" in flags and "--amp" in flags and "--model" not in flags
    args = vars(cli.build_parser().parse_args(["train", *flags]))
    args.pop("command")
    args.pop("cfg")
    assert config.build(TrainConfig, **args) == cfg


@pytest.mark.parametrize("opts,flags", [
    ({}, []),
    ({"gpus": 2, "amp": True, "epochs": 4}, ["--gpus", "2"]),  # only how it was launched, not what it computes
    ({"gpus": 8, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29600, "dist_timeout": 900},
     ["--gpus", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
      "--dist-timeout", "900"]),
])
def test_relaunch_flags_are_the_launch_options_given(opts, flags):
    """What a resume line adds to --resume PATH so that the run goes on as launched (issue 53 item 6)."""
    assert launch.relaunch_flags(config.build(TrainConfig, **opts)) == flags


def test_launch_command_single_node_uses_a_private_port():
    cfg = config.build(TrainConfig, gpus=4, amp=True, master_port=1234)
    cmd = launch.launch_command(cfg, port=4321)
    assert cmd[:3] == [sys.executable, "-m", "dlenv.cluster.launch"]
    opts = dict(zip(cmd[3:-5:2], cmd[4:-4:2], strict=False))
    assert opts["--nproc_per_node"] == "4" and opts["--master_port"] == "4321"
    assert opts["--master_addr"] == "127.0.0.1" and opts["--max_restarts"] == "0"
    assert cmd[cmd.index("-m", 3):] == ["-m", "dlenv.cli", "train", "--amp", "--gpus", "4", "--master-port", "1234"]


def test_launch_command_several_nodes_goes_to_the_rendezvous():
    cfg = config.build(TrainConfig, gpus=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600)
    args = launch.torchrun_args(cfg)
    assert args[:10] == ["--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1",
                         "--master_addr", "10.0.0.1", "--master_port", "29600"]


@pytest.mark.parametrize("opts,match", [
    (dict(gpus=2, nnodes=2, node_rank=2), "--node-rank 2 must be below --nnodes 2"),
    (dict(gpus=2, device="cuda:1"), "--device cuda:1 picks one GPU"),
    (dict(gpus=2, device="mps"), "not a device"),
])
def test_check_launch_refuses_what_cannot_work(opts, match):
    with pytest.raises(UserError, match=match):
        launch.check_launch(config.build(TrainConfig, **opts))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_check_launch_without_gpus_names_the_cpu_option():
    with pytest.raises(UserError, match="no CUDA GPU is visible.*--device cpu"):
        launch.check_launch(config.build(TrainConfig, gpus=2))
    launch.check_launch(config.build(TrainConfig, gpus=2, device="cpu"))


def test_needs_launch_only_outside_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch.needs_launch(config.build(TrainConfig, gpus=2))
    assert launch.needs_launch(config.build(TrainConfig, nnodes=2))
    assert not launch.needs_launch(config.build(TrainConfig))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not launch.needs_launch(config.build(TrainConfig, gpus=2))


@pytest.mark.gpu
def test_gpu_check_launch_counts_the_visible_gpus():
    n = torch.cuda.device_count()
    launch.check_launch(config.build(TrainConfig, gpus=n))
    with pytest.raises(UserError, match=f"only {n} GPU"):
        launch.check_launch(config.build(TrainConfig, gpus=n + 1))
