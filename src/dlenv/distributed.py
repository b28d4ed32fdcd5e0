"""Several GPUs (or nodes): the torchrun launch, the process group, and what DDP training needs.

`dlenv train --gpus N` runs `launch(cfg)`, which starts the same command again through torchrun
(`torch.distributed.run`, N processes per node; the multi-node flags go to its rendezvous) and
forwards SIGTERM/SIGINT to it once, so rank 0 saves one checkpoint. Each process then calls
`init_from_env()`: NCCL on GPUs, gloo on CPUs, with a timeout, so a dead or stuck rank stops the run
with a clear message (`PeerFailure`) instead of hanging it. The rest is small glue for the trainer:
`wrap_ddp` (optionally with SyncBatchNorm), `no_sync_context` for accumulation, `EvalShardSampler`
and `reduce_metrics` so validation covers the whole val set exactly once, `agree` for decisions every
rank must share (a stop signal, an auto batch size) and `plan_for_world` for resuming on another
number of GPUs. Every helper is a no-op in a single process, so the trainer calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from dlenv import compat, config
from dlenv.errors import UserError

log = logging.getLogger(__name__)

#: seconds a process waits in a collective before the run is declared dead (see --dist-timeout)
DEFAULT_TIMEOUT_S = 600
#: exit status of a process whose peers failed (distinct from OOM 3 and non-finite 4)
EXIT_PEER = 5
#: torchrun checks its workers this often (seconds): how fast a dead rank takes the job down
MONITOR_INTERVAL_S = 1
#: the timeout this process joined with (for messages)
_timeout_s: float | None = None


class PeerFailure(UserError):
    """A collective failed or timed out: another process of the run died or is stuck."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=EXIT_PEER)


# ---------------------------------------------------------------------------------------------------
# Launching through torchrun.


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
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise UserError(f"--gpus {cfg.gpus}: no CUDA GPU is visible (run verify-env); use --gpus 1, or "
                        f"--device cpu to try {cfg.gpus} CPU processes")
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
    return [sys.executable, "-m", "dlenv.distributed", *torchrun_args(cfg, port),
            "-m", "dlenv.cli", "train", *train_flags(cfg)]


def launch(cfg: Any) -> int:
    """Run `dlenv train` with `cfg` as torchrun workers on this node; return the exit status.

    The launcher is a process of its own session, so a Ctrl-C in the terminal reaches only this
    process, which forwards it (and SIGTERM, SIGHUP) to torchrun, which passes it to every worker
    once: the workers finish the step and rank 0 saves last.pth (exit 130/143). A second signal is
    forwarded too and stops them at once. Raises UserError for options that cannot launch.
    """
    check_launch(cfg)
    env = dict(os.environ)
    # torchrun would set 1 and print a banner about it; a share of the cores is the better default
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.gpus)))
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


def _torchrun(argv: list[str]) -> int:
    """torch.distributed.run's main, ending in an exit status and one line instead of a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as e:  # the workers got the signal and are done (or were killed)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(_failure_line(e), file=sys.stderr, flush=True)
        rank, failure = _root_failure(e)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


# ---------------------------------------------------------------------------------------------------
# Inside a worker: the process group.


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the run. A single process is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0) writes files, logs and progress bars."""
        return self.rank == 0


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise UserError(f"{name} is not set: start several processes with `dlenv train --gpus N` "
                            "(or torchrun), which sets RANK, WORLD_SIZE and LOCAL_RANK")
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} in the environment is not an integer") from None


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                  device: str = "auto") -> DistInfo:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); returns this process's DistInfo.

    `device` 'auto' or 'cuda' gives each process cuda:LOCAL_RANK and NCCL where a GPU is visible;
    'cpu' (or no GPU) gives gloo. `timeout_s` bounds every collective (NCCL honours it through the
    variable compat.nccl_timeout_env names). Joining twice returns the same info. Raises UserError
    for a bad environment or device, and PeerFailure when the rendezvous does not complete in time.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if device.startswith("cuda:"):
        raise UserError(f"--device {device}: each of the {world} processes uses its own GPU "
                        f"(cuda:LOCAL_RANK); use --device cuda")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA GPU is visible (run verify-env); use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible "
                            f"on this node; use at most --gpus {torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    elif device not in ("auto", "cpu"):
        raise UserError(f"--device {device!r}: distributed training runs on cuda or cpu")
    else:
        dev = torch.device("cpu")
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl":
        for key, value in compat.nccl_timeout_env().items():
            os.environ.setdefault(key, value)
    global _timeout_s
    if not dist.is_initialized():
        _timeout_s = timeout_s
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise PeerFailure(f"rank {rank}: could not join the run's rendezvous at {where} within "
                              f"{timeout_s:g} s ({_first_line(e)}); check --master-addr/--master-port, that "
                              "every node was started and that the port is open") from None
    return DistInfo(rank, local_rank, world, dev, local_world)


def cleanup() -> None:
    """Leave the process group (at the end of a run; harmless when there is none).

    All ranks meet at a barrier first: a rank that tears gloo down while a peer is still talking to it
    can abort the peer at exit ("terminate called without an active exception", seen with PyTorch 2.14).
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank; 0 without a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the run; 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this process writes files (rank 0, or the only process)."""
    return rank() == 0


# ---------------------------------------------------------------------------------------------------
# Collectives with a clear message when a peer is gone.


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def is_peer_error(e: BaseException) -> bool:
    """Whether an exception from a collective (or from DDP's backward) means a peer failed or timed out."""
    if type(e).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(m in text for m in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
        "NCCL communicator was aborted", "ProcessGroupNCCL", "ProcessGroupGloo", "[enforce fail at"))


def peer_failure(e: BaseException, what: str) -> PeerFailure:
    """The PeerFailure that explains `e` (raised by `what`) to the user."""
    waited = f" or did not answer within {_timeout_s:g} s" if _timeout_s else ""
    return PeerFailure(f"rank {rank()}: {what} failed: another process of this run stopped{waited} "
                       f"({_first_line(e)}); its own error is printed above (or in its node's log)")


@contextlib.contextmanager
def peer_errors(what: str) -> Iterator[None]:
    """Turn a collective's failure inside the block into a PeerFailure naming `what`."""
    try:
        yield
    except RuntimeError as e:
        if _active() and is_peer_error(e):
            raise peer_failure(e, what) from None
        raise


def _comm_device() -> torch.device:
    """Where collective tensors live: the current GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait until every process gets here. Raises PeerFailure when one never does."""
    if not _active():
        return
    with peer_errors("a barrier"):
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all processes, in place; returns it. Raises PeerFailure when a peer is gone."""
    if _active():
        with peer_errors("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def agree(value: float, op: str = "max") -> float:
    """The max (or min, or sum) of a number over all processes: a decision every rank shares.

    Used for a stop signal that reached some ranks only (max of 0/1) and a measured batch size (min).
    """
    if not _active():
        return value
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    with peer_errors(f"agreeing on a value ({op})"):
        dist.all_reduce(t, op=ops[op])
    return t.item()


def reduce_metrics(sums: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Each value summed over all processes (one all_reduce); returns plain floats.

    Pass sums, never means: correct predictions, summed loss and the sample count of each rank's
    shard, so the ratios computed afterwards weigh every sample once however unevenly the val set
    was split. A no-op in a single process.
    """
    keys = list(sums)
    if not keys:
        return {}
    tensors = [v for v in sums.values() if isinstance(v, torch.Tensor)]
    device = _comm_device() if _active() else (tensors[0].device if tensors else torch.device("cpu"))
    values = torch.stack([torch.as_tensor(sums[k]).detach().to(device, torch.float64).reshape(())
                          for k in keys])
    all_reduce_sum(values)
    return dict(zip(keys, values.tolist(), strict=True))


# ---------------------------------------------------------------------------------------------------
# The model.


def wrap_ddp(model: nn.Module, device: torch.device, sync_bn: bool = False) -> nn.Module:
    """`model` in DistributedDataParallel (parameters broadcast from rank 0 now); unchanged alone.

    `sync_bn` converts BatchNorm layers to SyncBatchNorm in place first (batch statistics over all
    GPUs: worth it for small per-GPU batches); the parameters stay the same objects, so an optimizer
    built before still holds them. Raises UserError for --sync-bn on CPU (it has no CPU kernels).
    """
    if not _active():
        return model
    if sync_bn:
        if device.type != "cuda":
            raise UserError("--sync-bn needs CUDA GPUs (SyncBatchNorm has no CPU implementation); "
                            "drop --sync-bn for CPU processes")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets (one copy less, less memory)
    with peer_errors("wrapping the model in DDP (broadcasting rank 0's weights)"):
        return DistributedDataParallel(model, device_ids=ids, output_device=ids[0] if ids else None,
                                       gradient_as_bucket_view=True)


def no_sync_context(model: nn.Module, is_last_micro: bool) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce on the non-final micro-batches of an accumulation window.

    Gradients then accumulate locally and the final micro-batch all-reduces the sum once. A no-op
    context for the last micro-batch and for models not wrapped in DDP.
    """
    no_sync = getattr(model, "no_sync", None)
    if is_last_micro or no_sync is None:
        return contextlib.nullcontext()
    return no_sync()


# ---------------------------------------------------------------------------------------------------
# Data.


class EvalShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank` on, with no padding: the shards cover each sample once.

    Unlike DistributedSampler (which repeats samples so every rank gets the same count), shards may
    differ by one; sum the per-rank counts with `reduce_metrics`. Raises ValueError for a bad rank.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.indices = range(rank, num_samples, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def shard_eval_loader(loader: Any, rank: int, world_size: int) -> Any:
    """A copy of an evaluation DataLoader that reads only this rank's `EvalShardSampler` shard.

    Keeps the dataset, batch size, workers and pinning (and dlenv's bad-image handling); `loader`
    itself is unchanged. Returns `loader` in a single process.
    """
    if world_size == 1:
        return loader
    from torch.utils.data import DataLoader

    from dlenv.data.loaders import SafeLoader

    kwargs: dict[str, Any] = dict(batch_size=loader.batch_size, num_workers=loader.num_workers,
                                  pin_memory=loader.pin_memory,
                                  sampler=EvalShardSampler(len(loader.dataset), rank, world_size))
    if loader.num_workers > 0:
        kwargs.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    if isinstance(loader, SafeLoader):  # it brings its own collate function
        return SafeLoader(loader.dataset, **kwargs)
    return DataLoader(loader.dataset, collate_fn=loader.collate_fn, **kwargs)


def workers_per_process(workers: int, local_world_size: int) -> int:
    """DataLoader workers for each of `local_world_size` processes of a node sharing its CPUs."""
    return max(1, workers // max(1, local_world_size)) if workers else 0


# ---------------------------------------------------------------------------------------------------
# Batch arithmetic for another number of GPUs.


def plan_for_world(effective_batch: int, micro_batch: int, world: int) -> tuple[int, int, str | None]:
    """(micro-batch per GPU, accumulation, note) that keep `effective_batch` images per step on `world` GPUs.

    The micro-batch is never raised (it is what fits in memory) and is lowered where that makes the
    split exact (dlenv.autobatch.plan_accumulation). `note` is None when the effective batch is kept
    and otherwise one line saying what is trained instead. Raises UserError when the effective batch
    is smaller than the number of GPUs.
    """
    from dlenv.autobatch import plan_accumulation

    autobatch_log = logging.getLogger("dlenv.autobatch")
    was = autobatch_log.disabled
    autobatch_log.disabled = True  # the note below says it once, on rank 0, instead of on every rank
    try:
        micro, accum = plan_accumulation(effective_batch, micro_batch, world)
    finally:
        autobatch_log.disabled = was
    actual = micro * accum * world
    if actual == effective_batch:
        return micro, accum, None
    return micro, accum, (f"the effective batch {effective_batch} cannot be split exactly over {world} GPU(s) "
                          f"with micro-batches of at most {micro_batch}; training with {micro} x {accum} "
                          f"accumulation x {world} = {actual} images per step")


def resume_split(micro_batch: int, accum_steps: int, saved_world: int, world: int) -> tuple[int, int, str | None]:
    """(micro-batch, accumulation, note) to resume a run of `saved_world` GPUs on `world` GPUs.

    The same world keeps the split (note None). Another keeps the effective batch through
    accumulation where it divides (`plan_for_world`), and the note says what changed, or that the
    effective batch could not be kept.
    """
    if saved_world == world:
        return micro_batch, accum_steps, None
    effective = micro_batch * accum_steps * saved_world
    micro, accum, inexact = plan_for_world(effective, micro_batch, world)
    head = f"resuming a run of {saved_world} GPU(s) on {world}"
    if inexact:
        return micro, accum, f"{head}: {inexact}"
    return micro, accum, (f"{head}: micro-batch {micro} x {accum} accumulation x {world} keeps the "
                          f"effective batch {effective}")


if __name__ == "__main__":  # `python -m dlenv.distributed <torchrun options> ...`, as launch() runs it
    raise SystemExit(_torchrun(sys.argv[1:]))
