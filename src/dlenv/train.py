"""The training loop: `dlenv train` / `invoke train` / `dlenv.train.train(cfg)`.

Read it top to bottom: `train(cfg)` resolves the run (device, precision, data, batch), writes
config.yaml, builds the model, optimizer, schedule and one `Precision`, then runs epochs. Each
micro-batch is an autocast forward and a backward of loss / (micro-batches in the window); every
`accum` micro-batches (and at the end of an epoch) the optimizer steps through the precision object,
then the schedule and the EMA. Each epoch validates, appends a row to results.csv and saves
last.pth (and best_model.pth on improvement), atomically.

Nothing is lost: SIGINT/SIGTERM finish the current optimizer step, save a mid-epoch last.pth (with
sampler position and RNG states) and exit 130/143; `--resume` continues at that step, bit for bit
on a CPU with --deterministic and --workers 0. CUDA out of memory stops with advice (exit 3; with
--batch-size auto the batch is split and retried instead); a run of non-finite losses or skipped
fp16 steps stops with exit 4. Neither overwrites the last good checkpoint.

The loop reads the GPU's numbers (loss, finiteness) only every few steps, so the CPU stays ahead of
the GPU as in a plain loop. With --gpus N, `main` launches N processes through torchrun
(dlenv.distributed): each trains its share under DDP, validation sums are reduced over all of them,
and only rank 0 writes (one `is_main` flag).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlenv import checkpoint as ckpt_io
from dlenv import compat, config, distributed, results, runs
from dlenv.atomic import write_text
from dlenv.config import TrainConfig
from dlenv.devices import resolve_device
from dlenv.errors import UserError
from dlenv.memory import MemoryMonitor, oom_message

#: consecutive non-finite losses (or skipped fp16 steps) that stop a run
NONFINITE_LIMIT = 20
#: micro-batches between reads of the loss from the GPU (each read waits for the GPU)
CHECK_EVERY = 10
EXIT_OOM, EXIT_NONFINITE = 3, 4
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: micro-batches per epoch of --synthetic data without --max-steps
SYNTHETIC_BATCHES = 100


# ---------------------------------------------------------------------------------------------------
# The state that changes during a run (and is saved in a checkpoint).


@dataclass
class TrainState:
    """Counters of a run. `micro_batch` x `accum_steps` images per optimizer step per GPU.

    A loader batch of `micro_batch` images is split into `chunks` pieces (1 unless an OOM was
    retried), so the micro-batch that meets the GPU is micro_batch / chunks.
    """

    micro_batch: int
    accum_steps: int
    epoch: int = 0              # completed epochs
    step: int = 0               # optimizer steps done
    batch_in_epoch: int = 0     # loader batches trained on in the current epoch
    position: int = 0           # samples of the current epoch trained on (the sampler position)
    best_metric: float | None = None
    chunks: int = 1
    oom_retries: int = 0
    skipped_run: int = 0        # consecutive skipped (fp16 overflow) optimizer steps

    def saved(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps, "chunks": self.chunks,
                "oom_retries": self.oom_retries}


@dataclass
class Parts:
    """The objects a step needs, passed explicitly instead of the whole config."""

    model: nn.Module            # what runs forward (compiled / wrapped for DDP)
    bare: nn.Module             # the plain module: state dicts, EMA, checkpoints
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Any
    criterion: nn.Module
    ema: Any
    device: torch.device
    memory_format: torch.memory_format
    clip: float | None


class NonFiniteLoss(Exception):
    """A run of non-finite losses or skipped steps; the trainer turns it into exit 4."""


# ---------------------------------------------------------------------------------------------------
# Resolving the run.


def setup_distributed(cfg: TrainConfig) -> distributed.DistInfo:
    """This process's place in the run: the only one, or a torchrun worker joining its process group.

    Raises UserError for --gpus N outside torchrun (`main` launches it; `train()` alone cannot).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return distributed.init_from_env(timeout_s=cfg.dist_timeout, device=cfg.device)
    if distributed.needs_launch(cfg):
        raise UserError(f"--gpus {cfg.gpus} --nnodes {cfg.nnodes} needs one process per GPU: run `dlenv train` "
                        "(it launches them through torchrun), or call dlenv.distributed.launch(cfg)")
    return distributed.DistInfo()


def resolve_batch(batch_size: int | str, accum_steps: int, effective_batch: int | None, world_size: int,
                  find_max: Callable[[], int]) -> tuple[int, int]:
    """(micro-batch per GPU, accumulation steps) from the options. `find_max` measures 'auto'.

    Raises UserError when --effective-batch is not a multiple of micro-batch x GPUs.
    """
    micro = find_max() if batch_size == "auto" else int(batch_size)
    if not effective_batch:
        return micro, accum_steps
    if batch_size == "auto":
        from dlenv.autobatch import plan_accumulation

        return plan_accumulation(effective_batch, micro, world_size)
    per_step = micro * world_size
    if effective_batch % per_step:
        near = max(1, round(effective_batch / per_step)) * per_step
        raise UserError(f"--effective-batch {effective_batch} is not a multiple of --batch-size {micro} x "
                        f"{world_size} GPU(s) = {per_step}; use --effective-batch {near} or another "
                        "--batch-size")
    return micro, effective_batch // per_step


def _auto_batch(model_name: str, num_classes: int, precision_mode: str, checkpoint: float | bool,
                img_size: int, device: torch.device, channels_last: bool, upper: int, say) -> int:
    """The largest micro-batch whose real training steps fit on this GPU (dlenv.autobatch)."""
    if device.type != "cuda":
        raise UserError("--batch-size auto measures GPU memory and needs a CUDA device; "
                        "give a number, e.g. --batch-size 32")
    from dlenv.autobatch import find_max_batch, make_train_step_probe
    from dlenv.models import build_model

    probe = make_train_step_probe(lambda: build_model(model_name, num_classes), precision_mode, checkpoint,
                                  img_size, num_classes, device, channels_last=channels_last)
    try:
        n = find_max_batch(probe, start=8, upper=upper, what=model_name)
    finally:
        probe.close()
    say(f"--batch-size auto: {n} fits ({precision_mode}, checkpointing "
        f"{'on' if checkpoint else 'off'}, {img_size} px)")
    return n


def _seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every GPU
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible matmuls (read when cuBLAS starts)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: a few CUDA backward kernels have no deterministic version; warn, don't stop
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        # cuDNN autotuning picks the fastest convolution for the fixed training shape
        torch.backends.cudnn.benchmark = device.type == "cuda"


class _GlobalSettings:
    """Restores the process-wide torch settings a run changes, so train() can be called repeatedly."""

    def __enter__(self):
        self.det = torch.are_deterministic_algorithms_enabled()
        self.warn = torch.is_deterministic_algorithms_warn_only_enabled()
        self.bench = torch.backends.cudnn.benchmark
        return self

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.det, warn_only=self.warn)
        torch.backends.cudnn.benchmark = self.bench


# ---------------------------------------------------------------------------------------------------
# Data.


@dataclass
class Data:
    train: Any                  # iterable of (images, targets)
    val: Any                    # iterable, or None
    sampler: Any                # ResumableSampler, or None for synthetic data
    classes: list[str]
    img_size: int
    workers: int
    source: str                 # what to print and store: folder path, "demo", "synthetic"


def _is_demo(source: str, layout: Any) -> bool:
    """The built-in demo data, or a folder of it given as --data: 64 px images, gentler crops."""
    from dlenv.data.demo import is_demo_folder

    return source == "demo" or (layout is not None and is_demo_folder(layout.root))


def locate_data(data: str | None, synthetic: bool, val_split: float, seed: int) -> tuple[Any, list[str], str]:
    """(layout or None for synthetic data, class names, source) for --data. The demo data is written
    on first use. Raises UserError for a missing folder or one without images."""
    if synthetic:
        return None, [str(i) for i in range(1000)], "synthetic"
    from dlenv.data.folder import find_layout

    if data is None:
        from dlenv.data.demo import ensure_demo_data

        root, source = ensure_demo_data(), "demo"
    else:
        root, source = Path(data), str(data)
        if not root.is_dir():
            raise UserError(f"--data {data}: no such folder; pass a folder of class folders "
                            "(or with train/ and val/), or unpack an archive with `invoke unpack`")
    layout = find_layout(root, val_split, seed)
    if not layout.train or not layout.classes:
        raise UserError(f"--data {root}: no training images in class folders found")
    return layout, list(layout.classes), source


def build_data(layout: Any, classes: list[str], source: str, img_size: int, micro_batch: int, workers: Any,
               seed: int, bad_images: str, device: torch.device, dist: distributed.DistInfo,
               memory_format: torch.memory_format, max_steps: int | None, pipeline: Any = None,
               dtype: torch.dtype = torch.float32, say: Callable[[str], None] = print) -> Data:
    """The training and validation batches for a located dataset (or synthetic ones if layout is None).

    `pipeline` (a fastpath.InputOptions) picks the decoder, the cache and where augmentation runs; on
    the GPU path batches arrive on `device` already, in `memory_format` and `dtype`.
    """
    if layout is None:
        from dlenv.data.synthetic import SyntheticLoader

        n = max_steps or SYNTHETIC_BATCHES
        train = SyntheticLoader(micro_batch, img_size, len(classes), device, n, memory_format, seed)
        val = SyntheticLoader(micro_batch, img_size, len(classes), device, 2, memory_format, seed + 1)
        return Data(train, val, None, classes, img_size, 0, source)

    from dlenv.data.decode import resolve_decoder, stored_size
    from dlenv.data.fastpath import InputOptions, build_fast_loaders
    from dlenv.data.loaders import build_loaders, resolve_workers
    from dlenv.data.sampler import ResumableSampler

    n_workers = resolve_workers(workers, micro_batch, img_size)
    if workers == "auto":  # the processes of a node share its CPUs
        n_workers = distributed.workers_per_process(n_workers, dist.local_world_size)
    sampler = ResumableSampler(len(layout.train), seed=seed, rank=dist.rank, world_size=dist.world_size)
    opts = pipeline or InputOptions()
    # RandomResizedCrop's default (0.08, 1) can crop a demo shape out of its 64 px image entirely
    from dlenv.data.demo import DEMO_TRAIN_SCALE

    scale = DEMO_TRAIN_SCALE if _is_demo(source, layout) else (0.08, 1.0)
    gpu_path = opts.gpu_path(device)
    decoder = resolve_decoder(opts.decoder, [p for p, _ in layout.train], stored_size(img_size),
                              gpu=device if gpu_path and not opts.cache else None, batch=micro_batch,
                              workers=n_workers)
    if gpu_path:
        # each rank validates its own shard, without padding; validate() sums them
        val_sampler = (distributed.EvalShardSampler(len(layout.val), dist.rank, dist.world_size)
                       if layout.val and dist.world_size > 1 else None)
        # several processes on a node share one disk cache rather than each decoding into its own RAM
        cache_mode = "disk" if opts.cache_mode == "auto" and dist.local_world_size > 1 else opts.cache_mode
        train, val = build_fast_loaders(
            layout, img_size, micro_batch, n_workers, device=device, seed=seed, bad_images=bad_images,
            train_sampler=sampler, val_sampler=val_sampler, dtype=dtype, memory_format=memory_format,
            decoder=decoder, cache=opts.cache, cache_mode=cache_mode, cache_dir=opts.cache_dir, say=say,
            train_scale=scale)
        say(f"input: {'--cache' if opts.cache else f'decoder {decoder}'}, augmentation on {device.type}")
    else:
        train, val = build_loaders(layout, img_size, micro_batch, n_workers, seed=seed, bad_images=bad_images,
                                   train_sampler=sampler, pin_memory=device.type == "cuda", train_scale=scale,
                                   decoder="pil" if decoder == "nvjpeg" else decoder)
        if val is not None:  # each rank validates its own shard, without padding; validate() sums them
            val = distributed.shard_eval_loader(val, dist.rank, dist.world_size)
    return Data(train, val, sampler, classes, img_size, n_workers, source)


# ---------------------------------------------------------------------------------------------------
# One step.


class _LossMeter:
    """Running loss and the current run of non-finite losses, kept on the device (no sync per step)."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self.finite = torch.zeros((), device=device)
        self.bad_run = torch.zeros((), device=device)

    def add(self, loss: torch.Tensor) -> None:
        ok = torch.isfinite(loss)
        self.total += torch.where(ok, loss, torch.zeros_like(loss))
        self.finite += ok
        self.bad_run = torch.where(ok, torch.zeros_like(self.bad_run), self.bad_run + 1)

    def read(self) -> tuple[float, int]:
        """(mean finite loss so far, current run of non-finite losses); waits for the GPU."""
        total, finite, bad = torch.stack([self.total, self.finite, self.bad_run]).tolist()
        return (total / finite if finite else float("nan")), int(bad)


def forward_backward(parts: Parts, images: torch.Tensor, targets: torch.Tensor, weight: float, chunks: int,
                     sync: bool, monitor: MemoryMonitor | None = None) -> torch.Tensor:
    """Forward and backward of one loader batch (in `chunks` pieces), gradients scaled by `weight`.

    Returns the batch's loss (detached). `sync=False` skips the DDP gradient all-reduce (accumulation).
    """
    n = images.shape[0]
    total = torch.zeros((), device=images.device)
    pieces = list(zip(images.chunk(chunks), targets.chunk(chunks), strict=True))
    for i, (x, y) in enumerate(pieces):
        last = sync and i == len(pieces) - 1
        with distributed.no_sync_context(parts.model, last):
            with parts.precision.autocast():
                loss = parts.criterion(parts.model(x), y)
            if monitor is not None:
                monitor.record_memory("forward")
            share = x.shape[0] / n
            scale = weight * share
            parts.precision.backward(loss if scale == 1.0 else loss * scale)
        if monitor is not None:
            monitor.record_memory("backward")
        total = total + loss.detach().float() * share
    return total


def optimizer_step(parts: Parts) -> bool:
    """Unscale, clip, step (or skip on fp16 overflow), then schedule and EMA; True if it stepped."""
    params = parts.bare.parameters() if parts.clip else None
    stepped = parts.precision.step(parts.optimizer, clip=parts.clip, parameters=params)
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    if parts.ema is not None and stepped is not False:
        parts.ema.update(parts.bare)
    return stepped is not False


class _Stop:
    """SIGINT/SIGTERM handlers that ask the loop to stop at the next optimizer step; a second signal
    stops at once (Python's default behaviour)."""

    def __init__(self, say):
        self.signum: int | None = None
        self.say = say
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self.say(f"\n{signal.Signals(signum).name}: saving last.pth at the last finished step "
                 "(send it again to stop at once)")

    def requested(self, check_peers: bool = True) -> bool:
        """Whether to stop here. In a distributed run a signal may reach some ranks only (or at
        another step), so the ranks agree, at points every rank passes (`check_peers`)."""
        if distributed.world_size() == 1:
            return self.signum is not None
        return check_peers and distributed.agree(self.signum is not None, "max") > 0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNAL_EXIT:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class _Progress:
    """tqdm bar per epoch on a terminal; plain lines about every tenth of an epoch otherwise."""

    def __init__(self, total: int, start: int, desc: str, enabled: bool):
        self.enabled, self.desc, self.total = enabled, desc, total
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(CHECK_EVERY, (total // 10) // CHECK_EVERY * CHECK_EVERY)
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, leave=True,
                            file=sys.stdout)

    def update(self, done: int, loss: float, ips: float, mem_gib: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(f"loss {loss:.4f}  {ips:,.0f} img/s  {mem_gib:.1f} GiB", refresh=True)
        elif done % self.every == 0 or done == self.total:
            print(f"{self.desc} {done}/{self.total}  loss {loss:.4f}  {ips:,.0f} img/s  "
                  f"{mem_gib:.1f} GiB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class EpochStats:
    loss: float
    images: int
    seconds: float
    data_wait: float
    interrupted: bool
    rng: dict[str, Any] | None = None   # RNG states at the step boundary an interrupted epoch stopped at


def train_one_epoch(parts: Parts, batches: Iterator, state: TrainState, total: int, stop: _Stop,
                    progress: _Progress, monitor: MemoryMonitor,
                    on_step: Callable[[TrainState], None] | None = None,
                    retry_oom: bool = False) -> EpochStats:
    """Train on `batches` until `total` loader batches of this epoch are done, or a stop signal.

    Updates `state` in place. On a signal in the middle of an accumulation window the window's
    gradients are dropped and `state` and the model's buffers go back to the last optimizer step (the
    returned `rng` is the RNG state there), so a resume redoes exactly that window. Raises NonFiniteLoss for a run of
    non-finite losses or skipped steps; CUDA out-of-memory errors propagate unless `retry_oom`
    (then the batch is split in more micro-batches and redone).
    """
    parts.model.train()
    meter = _LossMeter(parts.device)
    images_seen, waited, in_window, window = 0, 0.0, 0, 1
    boundary: tuple[int, int, dict[str, Any] | None, list[torch.Tensor]] = (
        state.batch_in_epoch, state.position, None, [])
    last_check, last_images = time.perf_counter(), 0
    t0 = last_check
    interrupted = False
    while state.batch_in_epoch < total:
        if in_window == 0 and state.accum_steps > 1:
            # where a stop in the coming window rolls back to: the RNG feeds the augmentations and
            # dropout, and the window's forwards move BatchNorm's running statistics
            boundary = (state.batch_in_epoch, state.position, ckpt_io.rng_state(),
                        [b.detach().clone() for b in parts.bare.buffers()])
        t = time.perf_counter()
        try:
            images, targets = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        images = images.to(parts.device, non_blocking=True, memory_format=parts.memory_format)
        targets = targets.to(parts.device, non_blocking=True)
        if in_window == 0:
            # the last window of an epoch may be short: its loss is averaged over what it has
            window = min(state.accum_steps, total - state.batch_in_epoch)
        record = monitor if state.batch_in_epoch % CHECK_EVERY == 0 else None
        while True:
            last = in_window + 1 == window
            try:
                loss = forward_backward(parts, images, targets, 1.0 / window, state.chunks, sync=last,
                                        monitor=record)
                break
            except RuntimeError as e:
                if not (retry_oom and compat.is_oom(e)) or state.chunks * 2 > images.shape[0]:
                    raise
            # here, outside the except block, the failed step's tensors are already freed
            _after_oom(parts, state, in_window, progress)
            in_window, window = 0, min(state.accum_steps, total - state.batch_in_epoch)
        meter.add(loss)
        in_window += 1
        images_seen += images.shape[0]
        state.batch_in_epoch += 1
        state.position += images.shape[0]
        if last:
            stepped = optimizer_step(parts)
            if record is not None:
                monitor.record_memory("step")
            state.step += 1
            state.skipped_run = 0 if stepped else state.skipped_run + 1
            in_window = 0
            if on_step is not None:
                on_step(state)
        done = state.batch_in_epoch
        if done % CHECK_EVERY == 0 or done == total:
            mean_loss, bad_run = meter.read()
            now = time.perf_counter()
            ips = (images_seen - last_images) / max(now - last_check, 1e-9)
            last_check, last_images = now, images_seen
            progress.update(done, mean_loss, ips, monitor.peak()[0])
            if bad_run >= NONFINITE_LIMIT or state.skipped_run >= NONFINITE_LIMIT:
                raise NonFiniteLoss(f"{max(bad_run, state.skipped_run)} non-finite losses or skipped "
                                    f"steps in a row (epoch {state.epoch + 1}, step {state.step})")
        if stop.requested(check_peers=done % CHECK_EVERY == 0 or done == total):
            interrupted = True
            break
    rng = None
    if interrupted and in_window:
        parts.optimizer.zero_grad(set_to_none=True)
        state.batch_in_epoch, state.position, rng, buffers = boundary
        with torch.no_grad():
            for b, saved in zip(parts.bare.buffers(), buffers, strict=True):
                b.copy_(saved)
    if parts.device.type == "cuda":
        torch.cuda.synchronize(parts.device)
    seconds = time.perf_counter() - t0
    mean_loss, _ = meter.read()
    return EpochStats(mean_loss, images_seen, seconds, waited, interrupted and state.batch_in_epoch < total,
                      rng)


def _after_oom(parts: Parts, state: TrainState, in_window: int, progress: _Progress) -> None:
    """Split each loader batch into twice as many micro-batches after an OOM (--batch-size auto).

    The gradients of the interrupted accumulation window are dropped (a failed backward leaves them
    partial); the window restarts at the current batch.
    """
    parts.optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()  # give the fragments of the failed step back before the smaller retry
    state.chunks *= 2
    state.oom_retries += 1
    micro = math.ceil(state.micro_batch / state.chunks)
    dropped = f"; {in_window} micro-batch(es) of this window are skipped" if in_window else ""
    progress.update(state.batch_in_epoch, float("nan"), 0.0, 0.0)
    print(f"CUDA out of memory: continuing with micro-batch {micro} x {state.accum_steps * state.chunks} "
          f"accumulation (same images per step){dropped}", flush=True)


@torch.no_grad()
def validate(model: nn.Module, batches: Any, precision: Any, device: torch.device,
             memory_format: torch.memory_format) -> tuple[float, float, float] | None:
    """(loss, top-1 %, top-5 %) over `batches` of every rank (top-5 is top-k for k = min(5, classes));
    None if empty."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros(2, device=device, dtype=torch.int64)
    n = 0
    for images, targets in batches:
        images = images.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, targets, reduction="sum")
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(targets[:, None])
        correct += torch.stack([hit[:, 0].sum(), hit.any(dim=1).sum()])
        n += targets.shape[0]
    model.train(was_training)
    # sums, not means, over the ranks' shards (uneven ones too): every val image counts once
    t = distributed.reduce_metrics({"loss": loss_sum, "top1": correct[0], "top5": correct[1], "n": n})
    if t["n"] == 0:
        return None
    return t["loss"] / t["n"], 100.0 * t["top1"] / t["n"], 100.0 * t["top5"] / t["n"]


# ---------------------------------------------------------------------------------------------------
# Checkpoints and outputs.


def _payload(parts: Parts, state: TrainState, sampler: Any, meta: dict[str, Any],
             rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a resume needs, as tensors and plain types (loads with weights_only=True)."""
    return {
        "format": ckpt_io.FORMAT,
        "model": parts.bare.state_dict(),
        **meta,
        "epoch": state.epoch, "step": state.step, "batch_in_epoch": state.batch_in_epoch,
        "best_metric": state.best_metric,
        "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.precision.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "sampler": sampler.state_dict(state.position) if sampler is not None else None,
        "train_state": state.saved(),
        "rng": rng if rng is not None else ckpt_io.rng_state(),
        "env": ckpt_io.environment(),
    }


def _weights_finite(model: nn.Module) -> bool:
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True


def _write_config_yaml(path: Path, options: dict[str, Any], notes: dict[str, Any]) -> None:
    """config.yaml: the resolved options (reusable with --cfg) and, as comments, what they resolved to."""
    import yaml

    head = ["# dlenv train: the options of this run, resolved; rerun with: dlenv train --cfg <this file>"]
    head += [f"# {k}: {v}" for k, v in notes.items()]
    write_text(path, "\n".join(head) + "\n" + yaml.safe_dump(options, sort_keys=False))


#: Options a resumed run takes from the new command: where it runs, not what it computes.
_RESUME_FROM_COMMAND = ("device", "workers", "gpus", "nnodes", "node_rank", "master_addr", "master_port",
                        "dist_timeout")


def _resume_config(ckpt: dict[str, Any], given: TrainConfig, path: Path) -> tuple[TrainConfig, list[str]]:
    """(the saved run's options with only where it runs taken from this command, the flags given that a
    resume cannot change)."""
    if not ckpt_io.is_dlenv_checkpoint(ckpt) or "config" not in ckpt or "optimizer" not in ckpt:
        raise UserError(f"--resume {path}: not a dlenv training checkpoint (no optimizer state); "
                        "pass a last.pth from runs/<name>/, or start from its weights with --weights")
    saved = config.from_dict(TrainConfig, ckpt["config"])
    # a value given that differs from both the default and the saved run was asked for, and is ignored
    ignored = [config.flag(f.name) for f in config.options(TrainConfig)
               if f.name not in (*_RESUME_FROM_COMMAND, "resume")
               and getattr(given, f.name) != f.default and getattr(given, f.name) != getattr(saved, f.name)]
    kept = {name: getattr(given, name) for name in _RESUME_FROM_COMMAND}
    return dataclasses.replace(saved, resume=str(path), **kept), ignored


# ---------------------------------------------------------------------------------------------------
# The run.


def train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None = None) -> dict[str, Any]:
    """Train as `cfg` says; returns a summary dict.

    Summary keys: run_dir, status ("done" or "interrupted"), exit_code (0, 130, 143), epochs (completed),
    step, best_metric, last, best, precision, batch_size, accum_steps, img_per_s and peak_alloc_gib
    (of the last epoch). `on_step(state)` is called after every optimizer step (tests, tools).
    Raises UserError for bad input, CUDA out of memory (exit_code 3) and a run of non-finite losses
    (exit_code 4); the last good checkpoint is intact in each case.
    """
    with _GlobalSettings():
        summary = _train(cfg, on_step)
    distributed.cleanup()  # after a normal end only: with a dead peer, teardown could wait for it
    return summary


def _train(cfg: TrainConfig, on_step: Callable[[TrainState], None] | None) -> dict[str, Any]:
    # -- what to continue, if anything ------------------------------------------------------------
    resume_ckpt, run_dir, ignored_on_resume = None, None, []
    if cfg.resume:
        resume_path = runs.find_resume(cfg.resume, cfg.project)
        resume_ckpt = ckpt_io.load_checkpoint(resume_path)
        cfg, ignored_on_resume = _resume_config(resume_ckpt, cfg, resume_path)
        run_dir = resume_path.parent

    dist = setup_distributed(cfg)
    is_main = dist.is_main

    def say(msg: str) -> None:
        if is_main:
            print(msg, flush=True)

    if ignored_on_resume:
        say(f"--resume continues {run_dir} with its saved options; ignoring {', '.join(ignored_on_resume)} "
            f"(to change them, start a new run from its weights: --weights {cfg.resume})")

    device = resolve_device(cfg.device, dist.local_rank)
    _seed_everything(cfg.seed + dist.rank, cfg.deterministic, device)

    from dlenv.data.demo import DEMO_IMG_SIZE
    from dlenv.models import apply_checkpointing, build_model, is_convolutional
    from dlenv.optim import (
        ModelEma,
        build_optimizer,
        default_lr,
        default_weight_decay,
        load_optimizer_state,
        resolve_optimizer,
        warmup_cosine,
    )
    from dlenv.precision import Precision, resolve_precision

    precision = Precision(resolve_precision(cfg.amp, cfg.amp_dtype, device), device)

    # -- data and model (the model first: --batch-size auto and channels_last need it) ---------------
    layout, classes, source = locate_data(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)
    img_size = cfg.img_size or (DEMO_IMG_SIZE if _is_demo(source, layout) else 224)
    model = build_model(cfg.model, len(classes), weights=None if resume_ckpt else cfg.weights)
    channels_last = cfg.channels_last and device.type == "cuda" and is_convolutional(model)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    if cfg.checkpoint:
        wrapped = apply_checkpointing(model, cfg.checkpoint_ratio)
        if wrapped == 0:
            say(f"--checkpoint: {cfg.model} has no repeated blocks to checkpoint; training without it")

    micro, accum = resolve_batch(
        cfg.batch_size, cfg.accum_steps, cfg.effective_batch, dist.world_size,
        lambda: int(distributed.agree(_auto_batch(  # every GPU measures; all use the smallest
            cfg.model, len(classes), precision.mode, cfg.checkpoint_ratio if cfg.checkpoint else False,
            img_size, device, channels_last, upper=len(layout.train) if layout else 4096, say=say), "min")))
    if resume_ckpt is not None:  # on another number of GPUs: keep the effective batch if it divides
        micro, accum, note = distributed.resume_split(micro, accum, int(resume_ckpt.get("world_size", 1)),
                                                      dist.world_size)
        if note:
            say(note)
    from dlenv.data.fastpath import InputOptions

    pipeline = InputOptions(cfg.decoder, cfg.gpu_augment, cfg.cache, cfg.cache_mode, cfg.cache_dir)
    data = build_data(layout, classes, source, img_size, micro, cfg.workers, cfg.seed, cfg.bad_images,
                      device, dist, memory_format, cfg.max_steps, pipeline, precision.dtype, say)
    full_epoch = len(data.train) if data.sampler is None else math.ceil(data.sampler.per_rank / micro)
    batches_per_epoch = min(full_epoch, cfg.max_steps or full_epoch)
    steps_per_epoch = math.ceil(batches_per_epoch / accum)

    # -- optimizer, schedule, EMA, compile -------------------------------------------------------
    effective = micro * accum * dist.world_size
    opt_name = resolve_optimizer(cfg.optimizer, cfg.epochs * steps_per_epoch)
    lr = cfg.lr if cfg.lr is not None else default_lr(opt_name, effective)
    wd = cfg.weight_decay if cfg.weight_decay is not None else default_weight_decay(opt_name)
    optimizer = build_optimizer(model, opt_name, lr, wd, cfg.momentum, cfg.nesterov)
    scheduler = warmup_cosine(optimizer, round(cfg.warmup_epochs * steps_per_epoch),
                              cfg.epochs * steps_per_epoch)
    # DDP first (it broadcasts rank 0's weights), then compile the wrapped model, as PyTorch advises
    run_model = distributed.wrap_ddp(model, device, sync_bn=cfg.sync_bn)
    ema = ModelEma(model, cfg.ema_decay) if cfg.ema else None
    if cfg.compile:
        if compat.HAS_COMPILE:
            run_model = compat.compile_model(run_model)
        else:
            say(f"--compile: PyTorch {torch.__version__} has no torch.compile (it arrived in 2.0); "
                "training without it")
    parts = Parts(run_model, model, optimizer, scheduler, precision,
                  nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing), ema, device, memory_format,
                  cfg.clip_grad)
    state = TrainState(micro_batch=micro, accum_steps=accum)

    # -- resume ----------------------------------------------------------------------------------
    pending_rng = None
    if resume_ckpt is not None:
        model.load_state_dict(resume_ckpt["model"])
        try:
            load_optimizer_state(optimizer, resume_ckpt["optimizer"])
        except (ValueError, KeyError, TypeError) as e:  # torch's own check: groups or sizes differ
            raise UserError(f"--resume {cfg.resume}: its optimizer state does not fit this model ({e}); "
                            f"start a new run from its weights with --weights {cfg.resume}") from None
        scheduler.load_state_dict(resume_ckpt["scheduler"])
        precision.load_state_dict(resume_ckpt["scaler"])
        if ema is not None and resume_ckpt.get("ema"):
            ema.load_state_dict(resume_ckpt["ema"])
        ts = resume_ckpt["train_state"]
        state.epoch, state.step = int(resume_ckpt["epoch"]), int(resume_ckpt["step"])
        state.best_metric = resume_ckpt.get("best_metric")
        state.chunks, state.oom_retries = int(ts.get("chunks", 1)), int(ts.get("oom_retries", 0))
        if data.sampler is not None and resume_ckpt.get("sampler"):
            data.sampler.load_state_dict(resume_ckpt["sampler"])
            state.position = data.sampler.start
            state.batch_in_epoch = int(resume_ckpt["batch_in_epoch"]) if state.position else 0
        pending_rng = resume_ckpt["rng"]
        resume_ckpt = None  # free its tensors

    # -- outputs: config.yaml first --------------------------------------------------------------
    options = config.to_dict(dataclasses.replace(
        cfg, batch_size=micro, accum_steps=accum, effective_batch=None, optimizer=opt_name, lr=lr,
        weight_decay=wd, img_size=data.img_size, workers=data.workers, resume=None,
        amp_dtype=precision.mode if precision.mode != "fp32" else cfg.amp_dtype))
    if is_main:
        if run_dir is None:
            run_dir = runs.new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        _write_config_yaml(run_dir / "config.yaml", options, {
            "precision": precision.mode, "device": f"{device} ({gpu})", "world_size": dist.world_size,
            "effective_batch": effective, "data": data.source, "classes": len(data.classes),
            "torch": torch.__version__})
        if state.epoch or state.batch_in_epoch:
            results.truncate_after(run_dir / "results.csv", state.epoch)
    meta = {"model_name": cfg.model, "num_classes": len(data.classes), "class_names": data.classes,
            "img_size": data.img_size, "config": options, "world_size": dist.world_size}
    last_path, best_path = (run_dir / "last.pth", run_dir / "best_model.pth") if run_dir else (None, None)
    tb = _tensorboard(run_dir) if cfg.tensorboard and is_main else None

    what = "resuming" if state.epoch or state.batch_in_epoch else "training"
    say(f"{what} {cfg.model} on {data.source} ({len(data.classes)} classes, {data.img_size} px) | {device} "
        f"{precision.mode}{' channels_last' if channels_last else ''}"
        f"{' checkpointing' if cfg.checkpoint else ''} | batch {micro} x {accum} accum x "
        f"{dist.world_size} GPU = {effective}, {opt_name} lr {lr:g} | {run_dir}")

    monitor = MemoryMonitor(device)
    from dlenv.data.bench import data_wait_advice

    advised = False  # the data-wait explanation is given once per run
    summary: dict[str, Any] = {"run_dir": str(run_dir) if run_dir else None, "status": "done", "exit_code": 0,
                               "precision": precision.mode, "batch_size": micro, "accum_steps": accum,
                               "last": str(last_path) if last_path else None,
                               "best": str(best_path) if best_path else None,
                               "img_per_s": None, "peak_alloc_gib": None}
    try:
        with _Stop(say) as stop:
            while state.epoch < cfg.epochs:
                epoch = state.epoch
                t_epoch = time.perf_counter()
                if pending_rng is not None and state.batch_in_epoch == 0:
                    ckpt_io.set_rng_state(pending_rng)  # an epoch-end save: restore before the epoch starts
                    pending_rng = None
                if data.sampler is not None:
                    data.sampler.set_epoch(epoch, start=state.position)
                total = min(state.batch_in_epoch + len(data.train), batches_per_epoch)
                batches = iter(data.train)
                if pending_rng is not None:
                    # a mid-epoch save: the RNG was saved after this epoch's loader started
                    ckpt_io.set_rng_state(pending_rng)
                    pending_rng = None
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                progress = _Progress(total, state.batch_in_epoch, f"epoch {epoch + 1}/{cfg.epochs}", is_main)
                try:
                    stats = train_one_epoch(parts, batches, state, total, stop, progress, monitor, on_step,
                                            retry_oom=cfg.batch_size == "auto" and dist.world_size == 1)
                finally:
                    progress.close()
                peak_alloc, peak_reserved = monitor.peak()
                if stats.interrupted:
                    if is_main:
                        _save_checked(parts, state, data.sampler, meta, last_path, stats.rng)
                    return _stopped(summary, stop.signum, last_path, say)
                val = validate(ema.module if ema is not None else model, data.val, precision, device,
                               memory_format) if data.val is not None else None
                state.epoch += 1
                state.batch_in_epoch, state.position = 0, 0
                if dist.world_size > 1:  # the mean over all ranks' batches, as one process would report
                    stats.loss = distributed.reduce_metrics({"loss": stats.loss})["loss"] / dist.world_size
                metric = val[1] if val is not None else -stats.loss
                improved = state.best_metric is None or metric > state.best_metric
                if improved:
                    state.best_metric = metric
                row = {"epoch": state.epoch, "train_loss": stats.loss,
                       "val_loss": val[0] if val else None, "top1": val[1] if val else None,
                       "top5": val[2] if val else None, "lr": optimizer.param_groups[0]["lr"],
                       "img_per_s": stats.images * dist.world_size / max(stats.seconds, 1e-9),
                       "data_wait": stats.data_wait / max(stats.seconds, 1e-9),
                       "epoch_s": time.perf_counter() - t_epoch, "mem_alloc_gib": peak_alloc,
                       "mem_reserved_gib": peak_reserved,
                       "batch_size": math.ceil(state.micro_batch / state.chunks),
                       "accum_steps": state.accum_steps * state.chunks, "oom_retries": state.oom_retries}
                summary.update(img_per_s=row["img_per_s"], peak_alloc_gib=peak_alloc,
                               batch_size=row["batch_size"], accum_steps=row["accum_steps"])
                if is_main:
                    results.append_row(run_dir / "results.csv", row)
                    if tb is not None:
                        for k, v in row.items():
                            if isinstance(v, (int, float)) and k != "epoch":
                                tb.add_scalar(k, v, state.epoch)
                        tb.flush()
                    _save_checked(parts, state, data.sampler, meta, last_path)
                    if improved:
                        best = _payload(parts, state, data.sampler, meta)
                        if ema is not None:
                            best["model"] = ema.module.state_dict()  # the weights that were validated
                        ckpt_io.save_checkpoint(best, best_path)
                say(_epoch_line(row, cfg.epochs, improved and val is not None))
                # the first epoch's wait includes starting the workers: judge from the second on
                if data.sampler is not None and not advised and (state.epoch > 1 or cfg.epochs == 1):
                    advice = data_wait_advice(row["data_wait"], cfg.cache, pipeline.gpu_path(device), data.workers)
                    if advice:
                        say(advice)
                        advised = True
                if stop.requested():
                    return _stopped(summary, stop.signum, last_path, say)
    except NonFiniteLoss as e:
        raise UserError(f"training stopped: {e}. {_last_good(last_path)} Try a lower --lr, --clip-grad 1.0, "
                        "or --amp-dtype bf16 instead of fp16", exit_code=EXIT_NONFINITE) from None
    except RuntimeError as e:
        if dist.world_size > 1 and distributed.is_peer_error(e):  # e.g. in DDP's gradient all-reduce
            raise distributed.peer_failure(e, "a training step") from None
        if not compat.is_oom(e):
            raise
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        card = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0.0
        msg = oom_message(math.ceil(state.micro_batch / state.chunks), state.accum_steps * state.chunks,
                          peak, card, amp=precision.mode != "fp32", checkpoint=cfg.checkpoint)
        raise UserError(msg, exit_code=EXIT_OOM) from None
    finally:
        if tb is not None:
            tb.close()
    summary.update(epochs=state.epoch, step=state.step, best_metric=state.best_metric)
    say(f"done: {state.epoch} epochs; best {'top-1' if data.val is not None else '-loss'} "
        f"{state.best_metric:.2f}; weights in {best_path}")
    return summary


def _save_checked(parts: Parts, state: TrainState, sampler: Any, meta: dict[str, Any], path: Path,
                  rng: dict[str, Any] | None = None) -> None:
    """Save last.pth unless the weights went non-finite (then the previous file stays the good one)."""
    if not _weights_finite(parts.bare):
        raise NonFiniteLoss(f"the weights became non-finite (epoch {state.epoch}, step {state.step})")
    ckpt_io.save_checkpoint(_payload(parts, state, sampler, meta, rng), path)


def _last_good(path: Path | None) -> str:
    if path is not None and path.is_file():
        return f"The last good checkpoint is {path}."
    return "No checkpoint was written yet."


def _stopped(summary: dict[str, Any], signum: int | None, last_path: Path | None, say) -> dict[str, Any]:
    code = _SIGNAL_EXIT.get(signum, 130)
    say(f"stopped by {signal.Signals(signum).name if signum else 'a signal'}; saved {last_path}. "
        f"Resume with: invoke train --resume {last_path}")
    summary.update(status="interrupted", exit_code=code)
    return summary


def _epoch_line(row: dict[str, Any], epochs: int, improved: bool) -> str:
    val = (f"val loss {row['val_loss']:.4f}  top-1 {row['top1']:.2f}%  top-5 {row['top5']:.2f}%"
           if row["top1"] is not None else "no validation data")
    return (f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f}  {val}  lr {row['lr']:.3g}  "
            f"{row['img_per_s']:,.0f} img/s  data wait {row['data_wait']:.0%}  {row['epoch_s']:.1f} s  "
            f"peak {row['mem_alloc_gib']:.2f}/{row['mem_reserved_gib']:.2f} GiB alloc/reserved"
            + ("  *best*" if improved else ""))


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir))


def main(cfg: TrainConfig) -> int:
    """`dlenv train`: run `train(cfg)`, or with --gpus N launch N of them through torchrun; return the
    exit code (UserError propagates to the CLI)."""
    if distributed.needs_launch(cfg):
        return distributed.launch(cfg)
    return int(train(cfg)["exit_code"])
