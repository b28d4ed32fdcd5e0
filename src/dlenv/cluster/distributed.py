"""Inside each process of a multi-GPU run: the process group, DDP, and the shard samplers.

`join(cfg)` reads torchrun's environment once and returns this process's `DistInfo` (rank 0 of 1
outside torchrun); in a run of several it joins the process group through `init_from_env()`: NCCL
on GPUs, gloo on CPUs, with a timeout, so a dead or stuck rank stops the run with a clear message
(`PeerFailure`) instead of hanging it. The rest is small glue for the trainer: `wrap_ddp`
(optionally with SyncBatchNorm), `no_sync_context` for accumulation, `EvalShardSampler` and
`reduce_metrics` so validation covers the whole val set exactly once, `agree` and `vote` for decisions
every rank must share (a stop signal, an auto batch size), and `gather` for what rank 0 saves of every
rank (its random streams). Every helper is a no-op in a single process, so
the trainer calls them unconditionally. Starting the processes is `dlenv.cluster.launch`'s job; the batch
arithmetic for another number of GPUs is `dlenv.engine.batchsplit`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from dlenv import compat
from dlenv.cluster.launch import EXIT_PEER, needs_launch
from dlenv.errors import UserError, first_line, host_memory_short

#: seconds a process waits in a collective before the run is declared dead (see --dist-timeout)
DEFAULT_TIMEOUT_S = 600
#: the timeout this process joined with (for messages)
_timeout_s: float | None = None


class PeerFailure(UserError):
    """A collective failed or timed out: another process of the run died or is stuck."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=EXIT_PEER)


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


def join(cfg: Any) -> DistInfo:
    """This process's place in the run: the only one, or a torchrun worker joining its process group.

    The one place that reads the world size from the environment; afterwards the returned DistInfo
    says it. Raises UserError for --gpus N outside torchrun (`dlenv train` launches it through
    dlenv.cluster.launch; `train()` alone cannot).
    """
    if _env_int("WORLD_SIZE", 1) > 1:
        return init_from_env(timeout_s=cfg.dist_timeout, device=cfg.device)
    if needs_launch(cfg):
        raise UserError(f"--gpus {cfg.gpus} --nnodes {cfg.nnodes} needs one process per GPU: run `dlenv train` "
                        "(it launches them through torchrun), or call dlenv.cluster.launch.launch(cfg)")
    return DistInfo()


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
                              f"{timeout_s:g} s ({first_line(e, 300, named=False)}); check --master-addr/"
                              "--master-port, that every node was started and that the port is open") from None
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


def is_peer_error(e: BaseException) -> bool:
    """Whether an exception from a collective (or from DDP's backward) means a peer failed or timed out."""
    if type(e).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    if host_memory_short(e) is not None:  # the CPU allocator's refusal also says "[enforce fail at"
        return False
    text = str(e)
    return isinstance(e, RuntimeError) and any(m in text for m in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out",
        "NCCL communicator was aborted", "ProcessGroupNCCL", "ProcessGroupGloo", "[enforce fail at"))


def lost_peer(e: BaseException, rank: int, world: int) -> str:
    """Which process of the run `e` lost, as far as can be told: in a run of two the other rank; otherwise
    the address gloo names in its message ('[10.0.0.2]:41234'), which is the peer's node; '' when unknown."""
    if world == 2:
        return f"rank {1 - rank} of 2"
    m = re.search(r"\[([0-9A-Za-z.:_-]+)\]:\d+", str(e))
    return f"a process on {m[1]}" if m else ""


def peer_failure(e: BaseException, what: str) -> PeerFailure:
    """The PeerFailure that explains `e` (raised by `what`) to the user, naming the lost peer where known."""
    waited = f" or did not answer within {_timeout_s:g} s" if _timeout_s else ""
    peer = lost_peer(e, rank(), world_size())
    return PeerFailure(f"rank {rank()}: {what} failed: another process of this run stopped{waited} "
                       f"({f'the lost peer: {peer}; ' if peer else ''}{first_line(e, 300, named=False)}); "
                       "its own error is printed above (or in its node's log)")


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


def vote(signum: int, period: int) -> tuple[int, int]:
    """(the largest `signum` of any process, 0 for none; the smallest `period` any proposes): one all_reduce
    for the stop vote and the steps to the next one (dlenv.train.console.Stop). Unchanged alone."""
    if not _active():
        return signum, period
    # MAX of (signum, -period): the signal any rank heard, and the smallest period
    t = torch.tensor([float(signum), -float(period)], dtype=torch.float64, device=_comm_device())
    with peer_errors("voting on a stop"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    heard, neg = t.tolist()
    return int(heard), int(-neg)


def gather(obj: Any) -> list[Any]:
    """`obj` of every process, in rank order (a collective: every rank calls it at the same point);
    `[obj]` alone. Used for each rank's RNG states, which rank 0 saves."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    with peer_errors("gathering the ranks' random states"):
        dist.all_gather_object(out, obj)
    return out


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


def wrap_ddp(model: nn.Module, device: torch.device, sync_bn: bool = False, find_unused: bool = False) -> nn.Module:
    """`model` in DistributedDataParallel (parameters broadcast from rank 0 now); unchanged alone.

    `find_unused`: some parameters take no part in some steps (a backbone --freeze-epochs holds frozen,
    dlenv.model.finetune): DDP then finds them after each forward and leaves them without a gradient, at the
    cost of a walk over the autograd graph per step.

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
                                       gradient_as_bucket_view=True, find_unused_parameters=find_unused)


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

    kwargs: dict[str, Any] = dict(batch_size=loader.batch_size, num_workers=loader.num_workers,
                                  pin_memory=loader.pin_memory, generator=loader.generator,
                                  sampler=EvalShardSampler(len(loader.dataset), rank, world_size))
    if loader.num_workers > 0:
        kwargs.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    if type(loader) is not DataLoader:
        # a subclass brings its own collate function (dlenv.data.loaders.SafeLoader): built as itself, so
        # this module needs no import of the data package above it
        return type(loader)(loader.dataset, **kwargs)
    return DataLoader(loader.dataset, collate_fn=loader.collate_fn, **kwargs)
