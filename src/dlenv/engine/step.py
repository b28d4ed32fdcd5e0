"""The one training step every trainer of dlenv runs: `Parts`, `forward_backward`, `optimizer_step`,
`train_step`.

The trainer's epoch (dlenv.train.loop), the --batch-size auto and --checkpoint-ratio auto probes
(dlenv.engine.stepprobe), bench-memory and bench-data (dlenv.bench) and prune's fine-tuning all train through
these functions, so what they measure is what a run does. It sits below all of them: it imports only
torch, dlenv.cluster.distributed (DDP's no_sync) and the memory monitor's type.

A step is an autocast forward and a backward of the loss scaled by the batch's share of the
accumulation window, through the one `Precision` object; then unscale, clip, step (or skip on fp16
overflow), the schedule and the EMA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlenv.cluster import distributed
from dlenv.engine.memory import MemoryMonitor


class NonFiniteLoss(Exception):
    """A run of non-finite losses or skipped steps (or weights gone non-finite); the trainer turns it into
    exit 4."""


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
    eager: nn.Module | None = None  # the model before torch.compile: what a failed compile falls back to

    @classmethod
    def plain(cls, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Any,
              memory_format: torch.memory_format = torch.contiguous_format, scheduler: Any = None) -> Parts:
        """The parts of a plain training step: cross-entropy, no EMA, no clipping, no DDP (the bench
        commands, the --batch-size auto probe, prune's fine-tuning)."""
        device = next(model.parameters()).device
        return cls(model, model, optimizer, scheduler, precision, nn.CrossEntropyLoss(), None, device, memory_format,
                   None)


def forward_backward(parts: Parts, images: torch.Tensor, targets: torch.Tensor, weight: float, sync: bool,
                     monitor: MemoryMonitor | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch, its gradients scaled by `weight` (its share of the
    accumulation window). Returns its loss (detached). `sync=False` skips the DDP gradient all-reduce
    (accumulation)."""
    with distributed.no_sync_context(parts.model, sync):
        with parts.precision.autocast():
            loss = parts.criterion(parts.model(images), targets)
        if monitor is not None:
            monitor.record_memory("forward")
        parts.precision.backward(loss if weight == 1.0 else loss * weight)
    if monitor is not None:
        monitor.record_memory("backward")
    return loss.detach().float()


def optimizer_step(parts: Parts) -> bool:
    """Unscale, clip, step (or skip on fp16 overflow), then schedule and EMA; True if it stepped."""
    params = parts.bare.parameters() if parts.clip else None
    stepped = parts.precision.step(parts.optimizer, clip=parts.clip, parameters=params)
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.scheduler is not None:
        parts.scheduler.step()
    if parts.ema is not None and stepped is not False:
        parts.ema.update(parts.bare)
    return stepped is not False


def train_step(parts: Parts, images: torch.Tensor, targets: torch.Tensor,
               monitor: MemoryMonitor | None = None) -> tuple[torch.Tensor, bool]:
    """One optimizer step on one batch, the trainer's own (`forward_backward` then `optimizer_step`):
    (the batch's loss, detached; whether the optimizer stepped: False when fp16 skipped it)."""
    loss = forward_backward(parts, images, targets, 1.0, sync=True, monitor=monitor)
    return loss, optimizer_step(parts)
