"""State dicts into models: the weights a file holds, found, cleaned and put into a model.

Other tools nest a state dict (Lightning's and timm's "state_dict", torchvision's references' "model")
and prefix its keys (DDP's "module.", torch.compile's "_orig_mod."); `state_dict_of` finds and cleans
it. `load_strict` puts a run file's weights into the model they were trained as; `load_lenient` (train
and fine-tune --weights) lets a head of another class count start fresh. Every refusal names the file,
counts the keys that do not fit and shows the first few, escaped and cut (a file's keys are as long as
its bytes allow).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv.errors import UserError, printable
from dlenv.files import runstate

log = logging.getLogger(__name__)


def strip_prefixes(sd: dict[str, Any]) -> dict[str, Any]:
    """Remove DDP's 'module.' and torch.compile's '_orig_mod.' prefixes from another tool's keys."""
    out = {}
    for k, v in sd.items():
        # one slice at the end: cutting a prefix at a time copies the rest of the key each time, hours
        # for a key of a million prefixes (a file's keys are as long as its bytes allow)
        start = 0
        for p in ("module.", "_orig_mod."):
            while k.startswith(p, start):
                start += len(p)
        out[k[start:]] = v
    return out


def shown_keys(keys: list[str], n: int) -> str:
    """The first `n` state dict keys for a message: each escaped and cut to 80 characters (a file's keys
    can be megabytes long and hold newlines), so the message stays one readable line."""
    return ", ".join(printable(k)[:80] for k in keys[:n])


def state_dict_of(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    """The weights `obj` (what `runstate.load_state` gave for --weights `path`) holds, as a bare state dict with
    its keys cleaned. Raises UserError when it holds none."""
    if runstate.is_run_state(obj):
        return dict(obj["model"])
    # Other tools nest the weights under "state_dict" (Lightning, timm) or "model" (torchvision refs).
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and runstate.is_bare_state_dict(obj.get(key)):
            obj = obj[key]
            break
    if not runstate.is_bare_state_dict(obj):
        raise UserError(f"--weights {path} holds no state dict; save one with "
                        "torch.save(model.state_dict(), path)")
    return strip_prefixes(obj)


def load_lenient(model: nn.Module, sd: dict[str, Any], name: str, num_classes: int, what: str,
                 aux: tuple[str, ...] = ()) -> None:
    """`sd` into `model` (built as `name` with `num_classes`) for training from it: a classifier head of
    another class count is left at its fresh initialisation, with a one-line note; keys under `aux` (an
    auxiliary head the model is built without) are ignored. Raises UserError naming `what` when anything
    else is missing, unexpected or of another shape."""
    own = model.state_dict()
    head, wrong = [], []
    for k, v in sd.items():
        if k in own and own[k].shape != v.shape:
            # The head: same layout, only the class dimension (the first) differs.
            is_head = (v.ndim == own[k].ndim and own[k].shape[0] == num_classes
                       and v.shape[1:] == own[k].shape[1:])
            (head if is_head else wrong).append(k)
    unexpected = [k for k in sd if k not in own and not (aux and k.startswith(aux))]
    missing = [k for k in own if k not in sd]
    if wrong or unexpected or missing:
        some = shown_keys(wrong + unexpected + missing, 3)
        raise UserError(f"{what} does not fit {name} ({len(missing)} missing, {len(unexpected)} "
                        f"unexpected, {len(wrong)} of another shape, e.g. {some}); pass the --model "
                        "these weights were trained as")
    model.load_state_dict({k: v for k, v in sd.items() if k in own and k not in head}, strict=False)
    if head:
        log.warning("%s: head %s has %d classes, the data has %d; it starts fresh (fine-tuning)",
                    what, shown_keys(head, 4), sd[head[0]].shape[0], num_classes)


def load_strict(model: torch.nn.Module, sd: dict[str, Any], source: str | Path, name: str | None = None,
                     num_classes: int | None = None) -> None:
    """`model.load_state_dict(sd)` (strict), with a UserError naming `source` when the weights don't fit.

    Keys missing or unexpected, or tensors of another shape, are counted and the first few named.
    `num_classes` is what the run file's metadata says: a head of another size is then called what
    it is, metadata that disagrees with the weights.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    wrong = [k for k in sd if k in own and tuple(own[k].shape) != tuple(sd[k].shape)]
    arch = f"architecture {name!r}" if name else "this model"
    if num_classes is not None and wrong and not missing and not unexpected:
        head = [k for k in wrong if own[k].ndim and sd[k].ndim == own[k].ndim
                and own[k].shape[0] == num_classes and sd[k].shape[1:] == own[k].shape[1:]]
        if head == wrong:
            raise UserError(f"{source}: its metadata says num_classes {num_classes} but its weights' head "
                            f"{shown_keys(head, 1)} has {sd[head[0]].shape[0]} outputs; the file was edited or "
                            "damaged, use another run file")
    if missing or unexpected or wrong:
        some = shown_keys(missing + unexpected + wrong, 4)
        raise UserError(f"{source} does not match {arch} ({len(missing)} missing, {len(unexpected)} "
                        f"unexpected keys, {len(wrong)} of another shape, e.g. {some}); the model or the number "
                        "of classes differs from what it was trained with: pass the right --model, or data with "
                        "its classes")
    model.load_state_dict(sd)


def _overlaps(t: torch.Tensor) -> bool:
    """Whether some elements of `t` share storage (a stride of 0, as expand() makes, or overlapping
    strides): a shape that costs no bytes, which no trained weight has. Dimensions in order of stride,
    each must step past everything the smaller ones span."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 0  # the highest offset the dimensions so far reach
    for stride, n in dims:
        if stride <= span:
            return True
        span += stride * (n - 1)
    return False


def num_classes_from(sd: dict[str, Any], source: str) -> int:
    """The class count of a bare classification state dict: the rows of its last 2-D weight, a number
    read from a file and so bounded as a dlenv run file's num_classes (runstate.MAX_CLASSES), from a
    tensor whose every element is stored. Raises UserError naming the tensor, its shape and the bound."""
    weights = [(k, v) for k, v in sd.items() if k.endswith("weight") and v.ndim == 2]
    if not weights:
        raise UserError(f"{source}: cannot tell the number of classes from this state dict (no linear layer "
                        "found); save a classifier's weights with torch.save(model.state_dict(), path)")
    key, head = weights[-1]
    shape = "x".join(str(n) for n in head.shape)
    rows = int(head.shape[0])
    if not 1 <= rows <= runstate.MAX_CLASSES:
        raise UserError(f"{source}: its head {printable(key)[:80]} ({shape}) gives {rows:,} classes, not a class "
                        f"count of 1 to {runstate.MAX_CLASSES:,}; the file was edited or damaged, use another "
                        "weights file")
    if _overlaps(head):
        raise UserError(f"{source}: its head {printable(key)[:80]} ({shape}) repeats stored numbers (strides "
                        f"{tuple(head.stride())}: zero or overlapping), which no trained weight does; the file was "
                        "edited or damaged, use another weights file")
    return rows
