"""What a run trains with, built from its plan (dlenv.train.plan) and nothing else: the model, the data and
the parts of the step (optimizer, schedule, DDP, EMA, compile, one Precision).

Nothing is decided here: every value comes from the frozen TrainPlan, so what config.yaml records is
what is built. The model is built first, from the seeded random streams (the plan's probes drew from
copies of them), then the data, then the parts around the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dlenv import compat
from dlenv.cluster import distributed
from dlenv.data import pipeline
from dlenv.engine.optim import ModelEma, build_optimizer, warmup_cosine
from dlenv.engine.precision import Precision
from dlenv.engine.step import Parts
from dlenv.model import checkpointing, finetune
from dlenv.train.plan import TrainPlan


def build_model(decided: TrainPlan, device: torch.device) -> nn.Module:
    """The model on `device` in the planned memory format, with --weights or --pretrained, checkpointed at
    the planned ratio. Raises UserError for weights that do not fit or a model of your own whose output
    is not logits [N, classes]."""

    model = decided.model.build().to(device, memory_format=decided.memory_format)
    decided.model.check(model)  # logits [N, classes]? (own models)
    if decided.recomputed_blocks:
        checkpointing.apply_checkpointing(model, decided.checkpoint_ratio.value)
    return model


def build_data(decided: TrainPlan, device: torch.device, dist: distributed.DistInfo,
               say: Callable[[str], None]) -> pipeline.Data:
    """This process's training and validation batches, as the plan's input says (the trainer's one call
    into the input pipeline)."""
    return pipeline.build(decided.data, decided.input, device, dist, dtype=decided.dtype,
                          memory_format=decided.memory_format, max_steps=decided.batches_per_epoch, say=say)


def build_parts(decided: TrainPlan, model: nn.Module, device: torch.device) -> Parts:
    """Optimizer, warmup-cosine schedule, DDP, EMA, compile and one Precision around `model`, as planned."""

    chosen, step = decided.optimizer, decided.step
    optimizer = build_optimizer(model, chosen.name, chosen.lr, chosen.weight_decay, chosen.momentum, chosen.nesterov,
                                lr_scales=finetune.lr_scales(model))  # --pretrained: the backbone's lower rate
    scheduler = warmup_cosine(optimizer, chosen.warmup_steps, chosen.total_steps)
    # DDP first (it broadcasts rank 0's weights), then compile the wrapped model, as PyTorch advises
    run_model = distributed.wrap_ddp(model, device, sync_bn=step.sync_bn, find_unused=finetune.ddp_find_unused(model))
    ema = ModelEma(model, step.ema_decay) if step.ema_decay is not None else None
    eager = run_model  # kept: a compile that fails falls back to it (dlenv.train.loop.Rescue)
    if decided.compile.value:
        # dynamic=False: an epoch's short last batch would otherwise make torch.compile (2.1+) recompile with
        # a dynamic batch size, and that slower graph then serves every full batch after it (issue 36's
        # profile, docs/input-pipeline.md); each batch shape gets a static graph of its own instead
        run_model = compat.compile_model(run_model, dynamic=False)
    return Parts(run_model, model, optimizer, scheduler, Precision(decided.precision.value, device),
                 nn.CrossEntropyLoss(label_smoothing=step.label_smoothing), ema, device, decided.memory_format,
                 step.clip_grad, eager=eager if decided.compile.value else None)

