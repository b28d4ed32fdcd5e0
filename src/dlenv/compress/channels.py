"""Structured pruning that removes channels: `dlenv prune --structured`.

Torch-Pruning's dependency graph (the `torch-pruning` package) traces the model once and groups every
tensor a channel touches: the conv that makes it, the BatchNorm after it, the convs that read it, and
across residual additions and concatenations the layers that must lose the same channel. Each group
loses the channels of the smallest L2 norm, the same share in every layer (`MagnitudePruner`); the
classifier keeps its outputs (they are the classes). The tensors are really cut: the model that comes
out is smaller and faster, not the same model with zeros.

`--amount` is the share of the model's parameters to remove, as for unstructured pruning. A conv loses
channels on both sides, so its parameters fall with the square of the channel ratio: `remove_channels`
searches the ratio that lands within `TOLERANCE` of the asked count (a handful of trial prunes of copies).
The widths the pruned model has are what its run file records (dlenv.model.shrink), so `val`, `predict` and
`export` rebuild it from the architecture's name and numbers alone.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from dlenv.compress.common import count_params
from dlenv.errors import UserError, first_line, optional_import

#: how close to the asked parameter count the search stops (a share of the model's parameters)
TOLERANCE = 0.01
#: trial prunes at most (each prunes a copy of the model)
MAX_TRIALS = 12


def _torch_pruning() -> Any:
    return optional_import("torch_pruning", "prune --structured removes channels with the torch-pruning package, "
                           "which is not installed (it is in requirements.txt: pip install -r requirements.txt)")


def head_layers(model: nn.Module, num_classes: int) -> list[nn.Module]:
    """The classifier: the last conv or linear layer with `num_classes` outputs (its outputs are the
    classes, never pruned). Raises UserError when there is none."""
    last = None
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) and isinstance(w, torch.Tensor) \
                and w.shape[0] == num_classes:
            last = m
    if last is None:
        raise UserError(f"cannot tell the classifier of {type(model).__name__} (no layer with {num_classes} "
                        "outputs), so channels cannot be pruned safely; prune without --structured")
    return [last]


def prune_at(model: nn.Module, ratio: float, example: torch.Tensor, keep: list[nn.Module]) -> None:
    """Remove `ratio` of the channels of every prunable layer group of `model` in place (the `keep`
    layers' outputs excepted). Raises UserError when Torch-Pruning cannot follow the model."""
    tp = _torch_pruning()
    for p in model.parameters():  # the graph is read from autograd: every weight must take part
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            pruner = tp.pruner.MagnitudePruner(model, example_inputs=example,
                                               importance=tp.importance.MagnitudeImportance(p=2),
                                               pruning_ratio=ratio, ignored_layers=keep, iterative_steps=1,
                                               global_pruning=False)
            pruner.step()
    except UserError:
        raise
    except Exception as e:  # a model its tracer cannot follow: a limit of the model, said in one line
        raise UserError(f"torch-pruning could not follow {type(model).__name__}'s dependencies "
                        f"({first_line(e, 160)}); prune it without --structured") from None


def remove_channels(model: nn.Module, amount: float, example: torch.Tensor, num_classes: int
                    ) -> tuple[nn.Module, float]:
    """(a copy of `model` with channels removed so that about `amount` of its parameters are gone, the
    channel ratio that took). `model` is left as it was. Raises UserError as `prune_at` does, and when
    no ratio removes that much (the layers that must stay hold too many of the parameters)."""
    keep_ids = {id(m) for m in head_layers(model, num_classes)}
    total = count_params(model)
    target = (1.0 - amount) * total

    def trial(ratio: float) -> tuple[nn.Module, int]:
        m = copy.deepcopy(model).cpu().eval()
        keep = [c for c, o in zip(m.modules(), model.modules(), strict=True) if id(o) in keep_ids]
        prune_at(m, ratio, example, keep)
        return m, count_params(m)

    # parameters fall about with the square of the kept channel share: start there, then close in
    lo, hi = (0.0, float(total)), (0.95, None)
    ratio = 1.0 - (1.0 - amount) ** 0.5
    best: tuple[float, nn.Module, float] | None = None
    for _ in range(MAX_TRIALS):
        pruned, n = trial(ratio)
        miss = abs(n - target) / total
        if best is None or miss < best[0]:
            best = (miss, pruned, ratio)
        if miss <= TOLERANCE:
            break
        if n > target:
            lo = (ratio, float(n))
        else:
            hi = (ratio, float(n))
        if hi[1] is None:
            ratio = (ratio + hi[0]) / 2
        else:  # interpolate between the two sides (regula falsi), kept inside the bracket
            t = (lo[1] - target) / (lo[1] - hi[1]) if lo[1] != hi[1] else 0.5
            ratio = lo[0] + min(0.9, max(0.1, t)) * (hi[0] - lo[0])
    assert best is not None
    miss, pruned, ratio = best
    if miss > 5 * TOLERANCE and count_params(pruned) > target:
        got = 1.0 - count_params(pruned) / total
        raise UserError(f"--amount {amount:g} --structured: removing channels takes at most {got:.0%} of this "
                        "model's parameters (its classifier and the layers tied to it stay); ask for less")
    return pruned, ratio
