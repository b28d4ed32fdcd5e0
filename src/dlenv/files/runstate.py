"""Run state: the files that hold a run (last.pth, best_model.pth: dlenv.runfolder names them), saved atomically,
loaded safely.

("Checkpoint" means activation checkpointing, dlenv.model.models; these are run-state files.) Opening a trained model
from one of these files (or an export) is `dlenv.runfolder.trained.open_trained`; it lives there, not here, because
rebuilding the model needs the model wing (dlenv.model), which stands above this one. Reading a file is
`dlenv.files.weights.read`; this module checks what a run file holds.

A run-state file is a dict of tensors and plain types only: dlenv.files.weights' allowlist passes it and
dlenv.files.torchfile builds its tensors from the bytes judged (torch.load never reads it), so it loads on any
PyTorch, from any folder, with no consent asked. Loading takes a `weights.LoadPolicy` (what the
command's --trust-pickle allows for other pickles). A path ending in .safetensors is read and written
as safetensors (weights and the description below as string metadata). Every number a loaded file
gives is bounded (`check_entries`):

    format        "dlenv/1"
    model         state dict of the bare model (torchvision key names: no "module." or wrapper prefixes)
    model_name    torchvision model name, e.g. "resnet50", or a model of your own, "models/net.py:build"
    model_source  of a model of your own: {"ref", "sha256", "args", "file"} (dlenv.model.usermodel); else None
    widths        of a channel-pruned model: {layer name: its widths} (dlenv.model.shrink); absent otherwise
    num_classes   int
    class_names   list[str]
    img_size      int
    config        dlenv.options.config.to_dict(TrainConfig)
    epoch         completed epochs; step: optimizer steps done; batch_in_epoch: micro-batches done in
                  the current epoch (a mid-epoch save resumes there); epoch_loss: [sum, count] of the finite
                  losses of those micro-batches (the resumed epoch's train_loss is the whole epoch's mean)
    best_metric   best val top-1 so far (float or None)
    optimizer, scaler, scheduler, ema    state dicts (or None)
    sampler       {"seed", "epoch", "position", "world_size"} of the training sampler (or None)
    train_state   {"micro_batch", "accum_steps", "oom_retries"} (an older dlenv's also "chunks")
    rng           RNG states (torch CPU/CUDA as uint8 tensors, python/numpy as plain types)
    env           {"dlenv", "torch", "cuda", "gpu"} versions and GPU name

best_model.pth holds only format, model (the EMA weights with --ema), model_name, model_source,
num_classes, class_names, img_size, config, world_size, epoch, step, best_metric, best_epoch and env: what it
takes to use and share the weights (dlenv.runfolder.trainstate.slim); last.pth also records best_epoch, the
epoch whose end set best_metric.

Writes go to a temporary file in the same folder, are fsynced and `os.replace`d into place, so a
`kill -9` at any moment leaves the previous file or the new one, never half of one.

Every Python float in a run file is stored encoded (`encode`: PyTorch 1.13's weights_only loader knows no
float opcode) and `load_state` gives it back exact (`decode`), so the files are the same on both profiles and
load on either. This module owns the format: its tag (FORMAT), `is_run_state`, the float encoding and a
.safetensors run file's metadata; dlenv.files.weights only reads the bytes safely.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dlenv import __version__
from dlenv.errors import UserError, printable
from dlenv.files import weights
from dlenv.files.atomic import write_file

#: what dlenv's own run files say they are
FORMAT = "dlenv/1"
_FLOAT = "__float__"

#: bounds on what a file may say (its weights must fit a model built from these numbers)
MAX_IMG_SIZE = 2048
MAX_CLASSES = 100_000
MAX_NAME = 256
MAX_COUNT = 10**12


def is_run_state(obj: Any) -> bool:
    """A dlenv run file's dict (last.pth, best_model.pth, a prune's output): its entries are this module's."""
    return isinstance(obj, dict) and obj.get("format") == FORMAT and "model" in obj


def is_bare_state_dict(obj: Any) -> bool:
    """A plain {name: tensor} mapping, as other tools save with torch.save(model.state_dict()): what a
    weights file holds when it is no dlenv run file, and a run file's "model" entry."""
    return isinstance(obj, dict) and len(obj) > 0 and all(isinstance(k, str) and torch.is_tensor(v)
                                                           for k, v in obj.items())


# ---------------------------------------------------------------------------------------------------
# dlenv's encoding: floats, and a run file's description as safetensors metadata
#
# PyTorch 1.13's weights_only loader knows no float opcode (2.x does), so every Python float (a learning
# rate, a config value, the GradScaler's scale) is written as {"__float__": float.hex()} and turned back
# into the exact float on reading: the files are the same on both profiles and load on either.


def encode(obj: Any) -> Any:
    """`obj` with every float replaced by {"__float__": hex}; containers without floats are kept as is."""
    if isinstance(obj, float):
        return {_FLOAT: obj.hex()}
    if isinstance(obj, dict):
        items = {k: encode(v) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj  # unchanged (a model state dict keeps its OrderedDict and _metadata)
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        items = [encode(v) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(items) if type(obj) in (list, tuple) else list(items)
    return obj


def decode(obj: Any, seen: dict[int, tuple[Any, Any]] | None = None) -> Any:
    """Undo `encode`. Each container is decoded once however often the file shares it (`seen`: id -> (it,
    what it became)): a walk down every path of 50 dicts each holding the next twice is 2**50 steps long."""
    seen = {} if seen is None else seen
    if not isinstance(obj, (dict, list, tuple)):
        return obj
    if id(obj) in seen:
        return seen[id(obj)][1]
    if isinstance(obj, dict):
        if len(obj) == 1 and _FLOAT in obj and isinstance(obj[_FLOAT], str):
            out: Any = float.fromhex(obj[_FLOAT])
        else:
            seen[id(obj)] = (obj, obj)  # decoded in place
            for k, v in obj.items():
                obj[k] = decode(v, seen)
            return obj
    elif isinstance(obj, list):
        out = [decode(v, seen) for v in obj]
    else:
        out = tuple(decode(v, seen) for v in obj)
    seen[id(obj)] = (obj, out)
    return out


def save_run_safetensors(state: dict[str, Any], path: Path) -> Path:
    """A dlenv run file's weights with its description as string metadata; a bare state dict as it is."""
    if not is_run_state(state):
        return weights.save_safetensors(state, path)
    meta = {"format": FORMAT, "model_name": str(state["model_name"]), "num_classes": str(int(state["num_classes"])),
            "class_names": json.dumps(list(state["class_names"])),
            "img_size": str(int(state["img_size"])) if state.get("img_size") else "",
            "config": json.dumps(state.get("config") or {}, default=str)}
    if state.get("model_source"):
        meta["model_source"] = json.dumps(state["model_source"], default=str)
    if state.get("widths"):  # a channel-pruned model (dlenv.model.shrink)
        meta["widths"] = json.dumps(state["widths"])
    return weights.save_safetensors(state["model"], path, meta)


def _from_safetensors(tensors: dict[str, Any], meta: dict[str, str], path: Path) -> dict[str, Any]:
    """A .safetensors file's `tensors` and `meta`: dlenv's own (metadata format "dlenv/1") as a run file's
    dict, any other (Hugging Face and timm write {"format": "pt"}, or none) as the bare state dict."""
    if meta.get("format") != FORMAT:
        return tensors

    def count(key: str) -> int | None:
        text = meta.get(key, "").strip()
        if not text:
            return None
        if not (text.isdigit() and len(text) <= 12):
            raise ValueError(f"{key} {text[:20]!r} is not a count")
        return int(text)

    try:
        run_file = {"format": FORMAT, "model": tensors, "model_name": meta["model_name"],
                "num_classes": count("num_classes"), "class_names": json.loads(meta["class_names"]),
                "img_size": count("img_size"), "config": json.loads(meta.get("config") or "{}")}
        if meta.get("model_source"):
            run_file["model_source"] = json.loads(meta["model_source"])
        if meta.get("widths"):
            run_file["widths"] = json.loads(meta["widths"])
    except (KeyError, ValueError) as e:
        raise UserError(f"{printable(str(path))}: its dlenv metadata is incomplete or malformed "
                        f"({printable(str(e))[:80]}); load it as a bare state dict with --model NAME, or export "
                        "it again") from None
    return run_file


# ---------------------------------------------------------------------------------------------------
# Saving and loading


class _KeepFirstError:
    """The file object torch.save writes through, keeping the first OSError instead of raising it.

    When a write raises under torch's zip writer (a full disk), PyTorch 1.13 ends the whole process
    from the writer's destructor (std::terminate: "unexpected pos"), and 2.x raises that RuntimeError.
    So the first OSError is kept, the rest of the stream is dropped (into the temporary file, which is
    deleted), and `save_state` raises the OSError itself once torch.save has returned.
    """

    def __init__(self, fh: Any):
        self.fh, self.error = fh, None

    def write(self, data: Any) -> int:
        if self.error is None:
            try:
                self.fh.write(data)
            except OSError as e:
                self.error = e
        return memoryview(data).nbytes

    def flush(self) -> None:
        if self.error is None:
            try:
                self.fh.flush()
            except OSError as e:
                self.error = e


def save_state(state: dict[str, Any], path: str | Path) -> Path:
    """Write `state` to `path` atomically (temp file + fsync + os.replace); returns the path.

    Floats are encoded so that PyTorch 1.13's weights_only loader reads the file (see the module doc).
    A failed write (a full disk, a read-only folder) removes the temporary file, leaves the previous
    `path` as it was and raises OSError naming `path`.
    """
    path = Path(path)
    if weights.is_safetensors(path):
        return save_run_safetensors(state, path)
    state = encode(state)

    def write(fh: Any) -> None:
        out = _KeepFirstError(fh)
        torch.save(state, out)
        if out.error is not None:
            raise out.error
        fh.flush()

    return write_file(path, write, durable=True)


def export_safetensors(run_file: dict[str, Any], model: Any, out: Path) -> int:
    """`dlenv export --format safetensors`: `model`'s weights and `run_file`'s description to `out`, then
    read back and compared tensor by tensor. Returns 0 when identical, 1 when not (the file is kept)."""
    state = {**run_file, "format": FORMAT, "model": model.state_dict()}
    save_run_safetensors(state, out)
    back = load_state(out)
    want = state["model"]
    same = (set(back["model"]) == set(want)
            and all(torch.equal(back["model"][k].cpu(), want[k].detach().cpu()) for k in want))
    size = out.stat().st_size / 2**20
    print(f"wrote {out} (safetensors: {len(want)} tensors, {size:.1f} MiB, with architecture "
          f"{back['model_name']}, {len(back['class_names'])} classes, {back.get('img_size') or '?'} px); loads "
          f"with no code run on any PyTorch: --weights {out}")
    if not same:
        print(f"reading {out} back gave other tensors than the model's; do not use it")
        return 1
    print("check: read back, every tensor identical to the run file's")
    return 0


def load_state(path: str | Path, policy: weights.LoadPolicy = weights.SAFE) -> Any:
    """What the weights file at `path` holds (`weights.read`: sniffed and read), decoded: a dlenv run file
    as its dict (floats exact, a .safetensors run file's description from its metadata), its entries
    checked and bounded (`check_entries`); any other file as it is (a bare state dict, a dict around
    one). `policy`: what --trust-pickle allows.

    Raises UserError naming the file for whatever `weights.read` refuses and for a run file whose entries
    have wrong types or numbers out of bounds.
    """
    held, meta = weights.read(path, policy)
    try:
        obj = _from_safetensors(held, meta, Path(path)) if weights.is_safetensors(path) else decode(held)
    except (ValueError, OverflowError) as e:  # float.fromhex of an edited {"__float__": ...}
        raise UserError(f"{printable(str(path))}: a number in it cannot be read ({printable(str(e))[:80]}); the "
                        "file was edited or damaged, use another run file (e.g. best_model.pth or last.pth of "
                        "the run)") from None
    check_entries(obj, path)
    return obj


def _bad_entry(path: Path, key: str, value: Any, expected: str) -> UserError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return UserError(f"{path}: its {key!r} is {shown}, not {expected}; the file was edited or damaged, "
                     f"use another run file (e.g. best_model.pth or last.pth of the run)")


def _is_int(v: Any, low: int, high: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


def check_entries(run_file: Any, path: str | Path) -> None:
    """Refuse a dlenv run file whose entries have the wrong type or disagree with each other.

    Checks what the loaders read, each number within its bound (the module's MAX_*): num_classes,
    class_names (as many as num_classes), img_size, model_name, epoch, step, batch_in_epoch, world_size,
    best_metric and train_state. The saved training options' values are checked by
    dlenv.runfolder.trained.check_saved_options (it needs dlenv.options.config, which this module must not
    import: config -> pretrained -> runstate), model_source's content by dlenv.model.modelsource. Anything
    other than a dlenv run file passes unchecked (its tensors are bounded by the bytes the file holds). Raises UserError
    naming the file, the entry and the bound.
    """
    if not is_run_state(run_file):
        return
    path = Path(path)
    if not is_bare_state_dict(run_file["model"]):
        raise _bad_entry(path, "model", type(run_file["model"]).__name__, "a state dict of tensors")
    for key, expected, ok in (
            ("model_name", f"a model name of 1 to {MAX_NAME} characters",
             lambda v: isinstance(v, str) and v.strip() != "" and len(v) <= MAX_NAME),
            ("num_classes", f"an integer from 1 to {MAX_CLASSES:,}", lambda v: _is_int(v, 1, MAX_CLASSES)),
            ("class_names", f"a list of class names of at most {MAX_NAME} characters",
             lambda v: isinstance(v, (list, tuple)) and all(isinstance(n, str) and len(n) <= MAX_NAME for n in v)),
            ("img_size", f"an image size of 16 to {MAX_IMG_SIZE} pixels",
             lambda v: v is None or _is_int(v, 16, MAX_IMG_SIZE)),
            ("epoch", "a count of epochs", lambda v: _is_int(v, 0, MAX_COUNT)),
            ("step", "a count of steps", lambda v: _is_int(v, 0, MAX_COUNT)),
            ("batch_in_epoch", "a count of batches", lambda v: _is_int(v, 0, MAX_COUNT)),
            ("epoch_loss", "[a finite sum of losses, a count]",
             lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], float)
             and math.isfinite(v[0]) and _is_int(v[1], 0, MAX_COUNT)),
            ("world_size", "a number of GPUs from 1 to 65,536", lambda v: _is_int(v, 1, 65536)),
            ("best_metric", "a finite accuracy or None",  # NaN: no later epoch would count as better
             lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))),
            ("config", "a mapping of options", lambda v: isinstance(v, dict)),
            ("model_source", "a mapping (where a model of your own came from) or None",
             lambda v: v is None or isinstance(v, dict)),
            ("train_state", "a mapping of counts",
             lambda v: isinstance(v, dict) and all(_is_int(n, 0, MAX_COUNT) for n in v.values()))):
        if key in run_file and not ok(run_file[key]):
            raise _bad_entry(path, key, run_file[key], expected)
    if ("num_classes" in run_file and "class_names" in run_file
            and len(run_file["class_names"]) != run_file["num_classes"]):
        if not run_file["class_names"]:
            raise UserError(f"{path} has no class names (its 'class_names' entry is empty); "
                            "use a run file written by dlenv train")
        raise UserError(f"{path}: it lists {len(run_file['class_names'])} class names for num_classes "
                        f"{run_file['num_classes']}; the file was edited or damaged, use another run file")


def environment() -> dict[str, Any]:
    """The versions and GPU a run file was written with, as plain types."""

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
