"""Checkpoints: atomic save, safe load, and rebuilding a model from a checkpoint alone.

A dlenv checkpoint is a dict of tensors and plain types only, so it loads with
`torch.load(weights_only=True)` and a malicious pickle can never run code here:

    format        "dlenv/1"
    model         state dict of the bare model (torchvision key names: no "module." or wrapper prefixes)
    model_name    torchvision model name, e.g. "resnet50"
    num_classes   int
    class_names   list[str]
    img_size      int
    config        dlenv.config.to_dict(TrainConfig)
    epoch         completed epochs; step: optimizer steps done; batch_in_epoch: micro-batches done in
                  the current epoch (a mid-epoch save resumes there)
    best_metric   best val top-1 so far (float or None)
    optimizer, scaler, scheduler, ema    state dicts (or None)
    sampler       {"seed", "epoch", "position", "world_size"} of the training sampler (or None)
    train_state   {"micro_batch", "accum_steps", "chunks", "oom_retries"}
    rng           RNG states (torch CPU/CUDA as uint8 tensors, python/numpy as plain types)
    env           {"dlenv", "torch", "cuda", "gpu"} versions and GPU name

Writes go to a temporary file in the same folder, are fsynced and `os.replace`d into place, so a
`kill -9` at any moment leaves the previous file or the new one, never half of one.

PyTorch 1.13's weights_only loader knows no float opcode (2.x does), so every Python float (a learning
rate, a config value, the GradScaler's scale) is stored as {"__float__": float.hex()} and turned back
into the exact float on load. Files are the same on both profiles and load on either.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dlenv import compat
from dlenv.errors import UserError

FORMAT = "dlenv/1"
_FLOAT = "__float__"


def _encode(obj: Any) -> Any:
    """`obj` with every float replaced by {"__float__": hex}; containers without floats are kept as is."""
    if isinstance(obj, float):
        return {_FLOAT: obj.hex()}
    if isinstance(obj, dict):
        items = {k: _encode(v) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj  # unchanged (a model state dict keeps its OrderedDict and _metadata)
        out = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_encode(v) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(items) if type(obj) in (list, tuple) else list(items)
    return obj


def _decode(obj: Any) -> Any:
    """Undo `_encode`."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _FLOAT in obj and isinstance(obj[_FLOAT], str):
            return float.fromhex(obj[_FLOAT])
        for k, v in obj.items():
            obj[k] = _decode(v)
        return obj
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_decode(v) for v in obj)
    return obj


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write `state` to `path` atomically (temp file + fsync + os.replace); returns the path.

    Floats are encoded so that PyTorch 1.13's weights_only loader reads the file (see the module doc).
    """
    path = Path(path)
    state = _encode(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # fsync the folder so the rename itself survives a power cut
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> Any:
    """Load a checkpoint with weights_only=True. Raises UserError for a missing, corrupt or unsafe file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; pass the path of a .pth file (e.g. runs/exp/last.pth)")
    try:
        return _decode(compat.load_weights_only(path, map_location=map_location))
    except pickle.UnpicklingError as e:
        # weights_only refuses any global it does not know: the file wants to run code or rebuild
        # arbitrary objects. Nothing from it was executed.
        reason = str(e).strip().splitlines()[-1][:160] if str(e).strip() else "unsupported object"
        raise UserError(f"refusing to load {path}: it is not a plain-weights checkpoint ({reason}); "
                        "nothing in it was run. Re-save it as a state dict with torch.save(model.state_dict())"
                        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
        raise UserError(f"checkpoint {path} is truncated or corrupt ({first}); use another checkpoint "
                        "(last.pth and best_model.pth are written atomically)") from None


def is_dlenv_checkpoint(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT and "model" in obj


def is_bare_state_dict(obj: Any) -> bool:
    """A plain {name: tensor} mapping, as other tools save with torch.save(model.state_dict())."""
    return (isinstance(obj, dict) and len(obj) > 0
            and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()))


def strip_prefixes(sd: dict[str, Any]) -> dict[str, Any]:
    """Remove DDP's 'module.' and torch.compile's '_orig_mod.' prefixes from another tool's keys."""
    out = {}
    for k, v in sd.items():
        for p in ("module.", "_orig_mod."):
            while k.startswith(p):
                k = k[len(p):]
        out[k] = v
    return out


def _num_classes_from(sd: dict[str, Any]) -> int:
    """The class count of a bare classification state dict: the rows of its last 2-D weight."""
    weights = [v for k, v in sd.items() if k.endswith("weight") and v.ndim == 2]
    if not weights:
        raise UserError("cannot tell the number of classes from this state dict (no linear layer found)")
    return int(weights[-1].shape[0])


def model_from_checkpoint(ckpt: Any, model_name: str | None = None, source: str = "checkpoint"):
    """Rebuild the model from a loaded checkpoint alone.

    Returns (model, class_names, img_size). A dlenv checkpoint carries its architecture, classes and
    image size; a bare state dict from another tool needs `model_name` (class names are then
    "0".."N-1" and img_size None). Raises UserError when the weights don't fit the architecture.
    """
    from dlenv.models import AUX_HEADS, build_model

    if is_dlenv_checkpoint(ckpt):
        name = model_name or ckpt["model_name"]
        sd = ckpt["model"]
        num_classes = int(ckpt["num_classes"])
        class_names = list(ckpt["class_names"])
        img_size = ckpt.get("img_size")
    elif is_bare_state_dict(ckpt):
        if not model_name:
            raise UserError(f"{source} is a bare state dict with no architecture; name it with --model "
                            "(e.g. --model resnet18)")
        name = model_name
        # dlenv builds googlenet / inception_v3 without their auxiliary heads (training-only outputs)
        aux = AUX_HEADS.get(name, ())
        sd = {k: v for k, v in strip_prefixes(ckpt).items() if not (aux and k.startswith(aux))}
        num_classes = _num_classes_from(sd)
        class_names = [str(i) for i in range(num_classes)]
        img_size = None
    else:
        raise UserError(f"{source} is neither a dlenv checkpoint nor a state dict; "
                        "save one with torch.save(model.state_dict(), path)")
    model = build_model(name, num_classes)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        some = ", ".join((list(missing) + list(unexpected))[:4])
        raise UserError(f"{source} does not match architecture {name!r} ({len(missing)} missing, "
                        f"{len(unexpected)} unexpected keys, e.g. {some}); pass the right --model")
    return model, class_names, img_size


def environment() -> dict[str, Any]:
    """The versions and GPU a checkpoint was written with, as plain types."""
    from dlenv import __version__

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    # str(): torch.__version__ is a TorchVersion, a class weights_only refuses to rebuild
    cuda = torch.version.cuda
    return {"dlenv": str(__version__), "torch": str(torch.__version__), "cuda": str(cuda) if cuda else None,
            "gpu": str(gpu) if gpu else None}


def rng_state() -> dict[str, Any]:
    """The RNG states a resumed run needs to draw the same numbers: torch CPU and CUDA, Python, NumPy.

    Plain types and uint8 tensors only (NumPy's array becomes a list of ints).
    """
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA states only where this machine has as many GPUs)."""
    import random

    import numpy as np

    torch.set_rng_state(state["torch"].cpu())
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
