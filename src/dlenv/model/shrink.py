"""A channel-pruned architecture, rebuilt from numbers: the widths `dlenv prune --structured` records.

Structured pruning removes whole channels, so the pruned model is no longer the architecture its name
builds. Its run file stays data, never code: beside the weights it records, for each layer whose width
changed, the layer's new numbers (`widths_of`):

    Conv1d/2d/3d       [in_channels, out_channels, groups]
    Linear             [in_features, out_features]
    BatchNorm1d/2d/3d  [num_features]

Loading builds the named architecture as usual and replaces each such layer by a fresh one of the same
type and settings at the recorded widths (`apply_widths`, called by dlenv.model.models.model_from_state);
the weights then load strictly, shape by shape. Nothing from the file is imported or run, a layer can
only shrink, and every number is checked against the layer it names. A model whose pruning changed any
other kind of layer cannot be rebuilt this way, so `unsupported` names it before such a file is written.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dlenv.errors import UserError, printable

#: the layer types whose widths a run file may change (exact types: a subclass may build differently)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: the most layers a file's widths may name
MAX_LAYERS = 100_000


def _numbers(m: nn.Module) -> list[int] | None:
    """The widths of a layer this module rebuilds, or None for another kind of layer."""
    if type(m) in _CONV:
        return [m.in_channels, m.out_channels, m.groups]
    if type(m) is nn.Linear:
        return [m.in_features, m.out_features]
    if type(m) in _NORM:
        return [m.num_features]
    return None


def _shapes(m: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
            if v is not None}


def unsupported(pruned: nn.Module, original: nn.Module) -> list[str]:
    """Layers of `pruned` whose own tensors changed shape from `original`'s but that `apply_widths` cannot
    rebuild ("name (Type)"), in model order; [] when a run file of `pruned` loads back."""
    before = dict(original.named_modules())
    out = []
    for name, m in pruned.named_modules():
        if name in before and _shapes(m) != _shapes(before[name]) and _numbers(m) is None:
            out.append(f"{name} ({type(m).__name__})")
    return out


def widths_of(pruned: nn.Module, original: nn.Module) -> dict[str, list[int]]:
    """{layer name: its widths} for each rebuildable layer of `pruned` whose widths differ from `original`'s."""
    before = dict(original.named_modules())
    return {name: now for name, m in pruned.named_modules()
            if name in before and (now := _numbers(m)) is not None and now != _numbers(before[name])}


def _smaller(m: nn.Module, dims: list[int]) -> nn.Module:
    """A fresh layer of `m`'s type and settings at `dims` (checked by the caller)."""
    if type(m) in _CONV:
        return type(m)(dims[0], dims[1], m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                       groups=dims[2], bias=m.bias is not None, padding_mode=m.padding_mode)
    if type(m) is nn.Linear:
        return nn.Linear(dims[0], dims[1], bias=m.bias is not None)
    return type(m)(dims[0], eps=m.eps, momentum=m.momentum, affine=m.affine,
                   track_running_stats=m.track_running_stats)


def _fits(m: nn.Module, dims: Any) -> str | None:
    """Why `dims` cannot be `m`'s widths, or None when they can (same count, whole numbers from 1 to the
    layer's own, groups that divide both channel counts)."""
    own = _numbers(m)
    if own is None:
        return f"a {type(m).__name__}, which pruning does not resize"
    if not (isinstance(dims, (list, tuple)) and len(dims) == len(own)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
        return f"{len(own)} whole numbers are expected, not {printable(repr(dims))[:40]}"
    if not all(1 <= d <= o for d, o in zip(dims, own, strict=True)):
        return f"widths {list(dims)} must lie between 1 and the architecture's {own}"
    if type(m) in _CONV and (dims[0] % dims[2] or dims[1] % dims[2]):
        return f"groups {dims[2]} do not divide channels {dims[0]} and {dims[1]}"
    return None


def apply_widths(model: nn.Module, widths: Any, source: str) -> nn.Module:
    """`model` with each layer `widths` names replaced by one of those widths (in place; returned).

    `widths` is a run file's record (None or {}: nothing to do). Raises UserError naming `source` and
    the layer for a record that is not a mapping of layer names to numbers, a layer the architecture
    does not have, or numbers that do not fit it.
    """
    if not widths:
        return model
    if not isinstance(widths, dict) or len(widths) > MAX_LAYERS:
        raise UserError(f"{source}: its 'widths' entry is not a mapping of at most {MAX_LAYERS:,} layer names to "
                        "widths; the file was edited or damaged, prune the original again")
    modules = dict(model.named_modules())
    for name, dims in widths.items():
        m = modules.get(name) if isinstance(name, str) and name else None
        if m is None:
            raise UserError(f"{source}: its pruned widths name layer {printable(repr(name))[:80]}, which "
                            f"{type(model).__name__} does not have; the file was edited or damaged, or pass the "
                            "architecture it was pruned from")
        why = _fits(m, dims)
        if why:
            raise UserError(f"{source}: its pruned widths for layer {printable(name)[:80]} do not fit ({why}); "
                            "the file was edited or damaged, prune the original again")
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, _smaller(m, list(dims)))
    return model
