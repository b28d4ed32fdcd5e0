"""Exact activation checkpointing of a model's repeated blocks.

`apply_checkpointing(model, ratio)` makes the model's repeated blocks (ResNet bottlenecks, ViT encoder
blocks, ...) recompute their activations in backward instead of storing them. It is exact: gradients,
outputs and BatchNorm running statistics are those of the same model without it, because

- the recompute runs with the RNG state of the forward, so dropout and stochastic depth draw the
  same masks (and the global RNG ends where it would have);
- BatchNorm layers in the recompute update throw-away copies of their buffers, so running statistics
  and num_batches_tracked move once per step, not twice;
- the recompute re-enters the forward's own autocast setting (1.13 would otherwise use fp16);
- the non-reentrant checkpoint is used, which handles in-place ops and parameters-only gradients.

The block's `forward` is replaced on the instance, so module names and state dict keys stay those of
the plain model: run files load into a model without checkpointing and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dlenv import compat
from dlenv.model import usermodel

# The repeated blocks of each torchvision family, by module and class name (looked up lazily: a class
# missing from an older torchvision is simply not there). The outermost match is wrapped.
_TORCHVISION_BLOCKS = {
    "resnet": ("BasicBlock", "Bottleneck"),
    "densenet": ("_DenseLayer",),
    "mobilenetv2": ("InvertedResidual",),
    "mobilenetv3": ("InvertedResidual",),
    "efficientnet": ("MBConv", "FusedMBConv"),
    "convnext": ("CNBlock",),
    "regnet": ("ResBottleneckBlock",),
    "vision_transformer": ("EncoderBlock",),
    "swin_transformer": ("SwinTransformerBlock", "SwinTransformerBlockV2"),
    "maxvit": ("MaxVitLayer",),
    "shufflenetv2": ("InvertedResidual",),
    "mnasnet": ("_InvertedResidual",),
    "squeezenet": ("Fire",),
    "googlenet": ("Inception",),
    "inception": ("InceptionA", "InceptionB", "InceptionC", "InceptionD", "InceptionE"),
}



def _block_classes() -> tuple[type, ...]:
    import importlib

    found = []
    for module, names in _TORCHVISION_BLOCKS.items():
        try:
            mod = importlib.import_module(f"torchvision.models.{module}")
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(found)


def _outermost(model: nn.Module, match) -> list[nn.Module]:
    """Modules for which match(module) holds, in registration (= forward) order, not nested in one another."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if match(child):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    """For models we don't know: modules with parameters of a class of their own (not torch.nn's)
    that occurs at least twice in the model, whether in a Sequential, a ModuleList or as attributes."""
    from collections import Counter

    counts = Counter(type(m) for m in model.modules() if m is not model)

    def match(m: nn.Module) -> bool:
        return (counts[type(m)] >= 2 and not type(m).__module__.startswith("torch.nn")
                and any(True for _ in m.parameters()))

    return _outermost(model, match)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in forward order: those its `checkpoint_blocks` attribute names,
    else torchvision's known block classes, else modules of one class of the model's own repeated
    anywhere in it. [] if none."""
    own = usermodel.declared_blocks(model)
    if own is not None:
        return own
    known = _block_classes()
    blocks = _outermost(model, lambda m: isinstance(m, known))
    return blocks or _repeated_children(model)


def _is_norm_with_stats(m: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(m, _NormBase) and m.training and m.track_running_stats


def _flatten(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    """Tensors of args/kwargs (also inside lists, as DenseNet passes them) as one flat list, plus a
    function that rebuilds (args, kwargs) from such a list. Checkpoint finds the devices whose RNG
    it must preserve from its flat tensor arguments."""
    flat: list[torch.Tensor] = []

    def take(v: Any) -> Any:
        if torch.is_tensor(v):
            flat.append(v)
            return ("t", len(flat) - 1)
        if type(v) in (list, tuple) and any(torch.is_tensor(x) for x in v):
            return ("seq", type(v), [take(x) for x in v])
        return ("v", v)

    spec_args = [take(a) for a in args]
    spec_kwargs = {k: take(v) for k, v in kwargs.items()}

    def put(spec: Any, values: tuple) -> Any:
        if spec[0] == "t":
            return values[spec[1]]
        if spec[0] == "seq":
            return spec[1](put(s, values) for s in spec[2])
        return spec[1]

    def rebuild(values: tuple) -> tuple[list, dict]:
        return [put(s, values) for s in spec_args], {k: put(s, values) for k, s in spec_kwargs.items()}

    return flat, rebuild


class _CheckpointedForward:
    """Stands in for a block's forward (as an instance attribute, so names and state dict stay).

    A plain class rather than a closure so that copy.deepcopy (EMA) and pickle follow it to the copy.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward = module.forward  # the class's forward, bound to this module
        # Whether the block writes into its inputs (e.g. a leading ReLU(inplace=True)): then the saved
        # inputs would no longer hold what the recompute needs, so it gets copies. Unknown (None) until
        # the first checkpointed call, which always copies and looks.
        self.writes_inputs: bool | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / no_grad / inference_mode: nothing to store anyway
            return self.forward(*args, **kwargs)
        if compat.is_compiling():
            # torch.compile traces the block once into its graph and recomputes it in the compiled
            # backward, not by running Python again: the bookkeeping below is not needed there, and
            # its side effects would make dynamo give up on the whole model and run it eagerly.
            return compat.checkpoint(self.forward, *args, **kwargs)
        flat, rebuild = _flatten(args, kwargs)
        amp = compat.autocast_state()
        norms = [m for m in self.module.modules() if _is_norm_with_stats(m)]
        calls = 0

        def run(*values: torch.Tensor) -> Any:
            nonlocal calls
            calls += 1
            if self.writes_inputs is not False:
                values = tuple(v.clone() for v in values)
            versions = [v._version for v in values]
            a, kw = rebuild(values)
            if calls == 1:  # the real forward
                out = self.forward(*a, **kw)
                if self.writes_inputs is None:
                    self.writes_inputs = any(v._version != n for v, n in zip(values, versions, strict=True))
                return out
            # The recompute in backward: the forward's autocast, and BatchNorm buffers swapped for
            # copies so running statistics are not updated a second time. `finally` also runs when
            # torch stops the recompute early once it has what backward needs.
            real = [(m, n, b) for m in norms for n, b in m.named_buffers(recurse=False) if b is not None]
            for m, n, b in real:
                setattr(m, n, b.clone())
            try:
                with compat.autocast_like(amp):
                    return self.forward(*a, **kw)
            finally:
                for m, n, b in real:
                    setattr(m, n, b)

        return compat.checkpoint(run, *flat)


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _wrap(module: nn.Module) -> None:
    if not is_checkpointed(module):
        module.forward = _CheckpointedForward(module)


def _unwrap(module: nn.Module) -> None:
    if is_checkpointed(module):
        del module.forward


def apply_checkpointing(model: nn.Module, ratio: float = 1.0) -> int:
    """Checkpoint the first round(ratio * n) of the model's n repeated blocks; returns how many.

    The first blocks are chosen because in a CNN they see the largest feature maps and so hold the
    most activation memory per unit of recompute; in a transformer all blocks are alike. Calling it
    again sets the new ratio (never wraps twice); ratio 0 removes checkpointing. Returns 0 when the
    model has no repeated blocks (AlexNet, VGG). Raises ValueError for a ratio outside [0, 1].
    """
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"checkpoint ratio {ratio!r} must be between 0 and 1")
    blocks = find_blocks(model)
    k = int(round(float(ratio) * len(blocks)))
    for i, block in enumerate(blocks):
        (_wrap if i < k else _unwrap)(block)
    return k
