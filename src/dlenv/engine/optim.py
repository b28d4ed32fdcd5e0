"""Optimizer, learning-rate schedule and weight EMA for the trainer.

- `build_optimizer`: SGD (momentum, Nesterov) or AdamW, with weight decay only on weight matrices and
  conv kernels: norms, biases and embeddings/tokens are excluded, because decaying them only hurts.
- `default_lr` / `default_weight_decay`: the linear scaling rule the config help states
  (0.1 x batch/256 for SGD, 1e-3 x batch/512 for AdamW; batch = images per optimizer step).
- `warmup_cosine`: linear warmup then cosine decay, counted in optimizer steps (not epochs), so
  accumulation and resume land on the same learning rate; `set_scheduled_lr` puts a resumed run whose
  schedule changed length (--epochs) on its new one at once.
- `ModelEma`: an exponential moving average of the weights (like timm's ModelEmaV2) whose decay
  ramps up over the first updates, so short runs are not dominated by the random initialisation.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from dlenv import compat
from dlenv.options.config import OPTIMIZERS

# parameter names (suffixes) that are embeddings or tokens: no weight decay, as for norms and biases
_NO_DECAY_NAMES = ("pos_embedding", "class_token", "cls_token", "pos_embed",
                   "relative_position_bias_table", "absolute_pos_embed")


#: `--optimizer auto` takes AdamW below this many optimizer steps and SGD from there on. From scratch,
#: AdamW converges in far fewer steps (measured on the demo data: docs/benchmarks.md); SGD's edge in
#: final accuracy needs long schedules.
AUTO_SGD_FROM_STEPS = 10_000


def resolve_optimizer(name: str, total_steps: int) -> str:
    """'sgd' | 'adamw' as given; 'auto' -> AdamW for runs under AUTO_SGD_FROM_STEPS steps, else SGD."""
    if name != "auto":
        return name
    return "adamw" if total_steps < AUTO_SGD_FROM_STEPS else "sgd"


def default_lr(optimizer: str, effective_batch: int) -> float:
    """Peak learning rate: SGD by the linear scaling rule (0.1 per 256 images per step); AdamW 1e-3,
    which adaptive steps make far less sensitive to the batch size."""
    if optimizer == "sgd":
        return 0.1 * effective_batch / 256
    if optimizer == "adamw":
        return 1e-3
    raise ValueError(f"unknown optimizer {optimizer!r}; use {' or '.join(OPTIMIZERS)}")


def default_weight_decay(optimizer: str) -> float:
    """1e-4 for SGD, 0.05 for AdamW (decoupled)."""
    return {"sgd": 1e-4, "adamw": 0.05}[optimizer]


def param_groups(model: nn.Module, weight_decay: float, lr_scales: dict[str, float] | None = None,
                 lr: float | None = None) -> list[dict]:
    """Decayed weights (ndim >= 2) and everything else (norms, biases, tokens) without decay.

    With `lr_scales` ({parameter name: factor}, dlenv.model.finetune) each factor gets its own pair of groups,
    the largest factor first (the new head: results.csv's lr column reads the first group), with
    lr = factor x `lr`; the schedule then scales each group from its own start. A frozen parameter
    (requires_grad False) stays in its group: unfrozen later, it is stepped without a new optimizer.
    """
    scales = lr_scales or {}
    buckets: dict[float, tuple[list, list]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad and not scales:
            continue
        decay, no_decay = buckets.setdefault(float(scales.get(name, 1.0)), ([], []))
        (no_decay if p.ndim <= 1 or name.endswith(_NO_DECAY_NAMES) else decay).append(p)
    groups = []
    for scale in sorted(buckets, reverse=True):
        extra = {"lr": lr * scale} if scales and lr is not None else {}
        groups += [{"params": buckets[scale][0], "weight_decay": weight_decay, **extra},
                   {"params": buckets[scale][1], "weight_decay": 0.0, **extra}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, momentum: float = 0.9,
                    nesterov: bool = False, lr_scales: dict[str, float] | None = None) -> torch.optim.Optimizer:
    """SGD or AdamW over `param_groups(model, weight_decay, lr_scales)`, stepping in few kernels on CUDA
    (`compat.optimizer_kernels`). Raises ValueError for an unknown name."""
    groups = param_groups(model, weight_decay, lr_scales, lr)
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0,
                               **compat.optimizer_kernels(torch.optim.SGD, on_cuda))
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **compat.optimizer_kernels(torch.optim.AdamW, on_cuda))
    raise ValueError(f"unknown optimizer {name!r}; use {' or '.join(OPTIMIZERS)}")


def probe_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    """The optimizer a memory probe trains with (dlenv.engine.stepprobe): `name`'s kind, whose state (SGD's
    momentum, AdamW's two moments) is what a run's optimizer keeps, at a small rate and torch's default
    kernels. Raises ValueError for a name not in OPTIMIZERS."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5)
    raise ValueError(f"optimizer {name!r} is not {' or '.join(OPTIMIZERS)}")


#: param-group keys that say how the step runs, not what it computes: this run's own choice is kept on resume
_KERNEL_KEYS = ("fused", "foreach")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """optimizer.load_state_dict(state) with this run's kernel choice in place of the saving run's (fused
    on a GPU, which a resume on the CPU or on PyTorch 1.13 cannot run). Swapped before loading, so
    torch places the restored step counts for this run's kernels (fused: on the parameter's device)."""
    groups = []
    for saved, own in zip(state["param_groups"], optimizer.param_groups, strict=False):  # torch checks counts
        group = {k: v for k, v in saved.items() if k not in _KERNEL_KEYS}
        group.update({k: own[k] for k in _KERNEL_KEYS if k in own})
        groups.append(group)
    optimizer.load_state_dict({**state, "param_groups": groups + state["param_groups"][len(groups):]})


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR: linear warmup to the peak over `warmup_steps`, then cosine down to `min_ratio` x peak.

    Call `scheduler.step()` once per optimizer step. Its state_dict holds plain numbers only.
    """
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(1, int(total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            # (step + 1): the very first step already learns something
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        t = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_scheduled_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's learning rate to what `scheduler` gives at its current step: a resume whose schedule
    changed length (--epochs) trains its next step at the new schedule's rate, not the saved one."""
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                                         strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() (results.csv's lr) reads


class ModelEma:
    """Exponential moving average of a model's parameters and buffers.

    `ema = ModelEma(model, decay)`; after each optimizer step `ema.update(model)`; validate
    `ema.module`. The effective decay is min(decay, (1 + n) / (10 + n)) after n updates. Integer
    buffers (BatchNorm's num_batches_tracked) are copied. `state_dict()` is plain tensors and numbers.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9998):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards `model`'s current weights (same architecture as at creation)."""
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        current = model.state_dict()
        for name, ema_v in self.module.state_dict().items():
            v = current[name].detach()
            if ema_v.dtype.is_floating_point:
                ema_v.mul_(d).add_(v, alpha=1 - d)
            else:
                ema_v.copy_(v)

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
        self.decay = float(state.get("decay", self.decay))
