"""An ONNX file as a model: the description `dlenv export` writes into it, and onnxruntime running it.

`dlenv export --format onnx` stores what a user of the file needs beside the graph, as the ONNX model's
string metadata (`metadata_props`): the dlenv format, the class names, the image size, the
normalisation and the resampling. `open_file` reads a file back for `predict` (through
dlenv.trained.open_trained): the bytes of a regular file of bounded size are handed to onnxruntime
(so no external-data path inside the file is followed), the metadata is bounded like a checkpoint's
(dlenv.runfolder.runstate's limits), and the graph's input shape must be images of one size, that of the metadata
and of --img-size if given. A file another tool wrote has no metadata: its class names are then
"0".."N-1" (or --classes), its size the input shape's (or --img-size).

`OnnxModule` wraps the session as a torch module, so the file runs through the same batched loop as a
PyTorch model (dlenv.evaluate.predict); the session runs on the CPU, or on CUDA where this onnxruntime
has that provider and the command runs on a GPU. onnxruntime is imported only when a file is opened.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv import safeio
from dlenv.errors import UserError, printable

FORMAT = "dlenv/1"
#: the largest ONNX file opened (protobuf itself stops at 2 GiB; a file over it keeps its weights outside)
MAX_BYTES = 2 * safeio.GIB
#: resamplings a file may name (dlenv.pretrained.INTERPOLATIONS)
_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


def metadata(class_names: list[str], img_size: int, norm: tuple[tuple, tuple] | None,
             interpolation: str) -> dict[str, str]:
    """The string metadata `dlenv export` stores in an ONNX file (read back by `open_file`)."""
    meta = {"format": FORMAT, "class_names": json.dumps(list(class_names)), "img_size": str(int(img_size)),
            "interpolation": interpolation}
    if norm is not None:
        meta["mean"], meta["std"] = json.dumps([float(x) for x in norm[0]]), json.dumps([float(x) for x in norm[1]])
    return meta


def write_metadata(path: Path, meta: dict[str, str]) -> None:
    """Add `meta` to the ONNX file at `path` (rewritten in place: a temporary file of the caller's)."""
    import onnx

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save(proto, str(path))


def _runtime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise UserError("running an ONNX file needs onnxruntime (in requirements.txt: pip install -r "
                        "requirements.txt); or pass the checkpoint it was exported from") from None
    return onnxruntime


def providers(device: Any) -> list[str]:
    """onnxruntime's execution providers for `device`: CUDA first on a GPU where this onnxruntime has it."""
    ort = _runtime()
    out = ["CPUExecutionProvider"]
    if device is not None and torch.device(device).type == "cuda" and \
            "CUDAExecutionProvider" in ort.get_available_providers():
        out.insert(0, "CUDAExecutionProvider")
    return out


def session(source: Path | bytes, device: Any = None) -> Any:
    """An onnxruntime InferenceSession of a file's bytes (or of a path dlenv wrote itself)."""
    ort = _runtime()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only: its warnings about unused initializers are not the user's
    return ort.InferenceSession(source if isinstance(source, bytes) else str(source), sess_options=opts,
                                providers=providers(device))


class OnnxModule(torch.nn.Module):
    """An onnxruntime session as a torch module: float32 (or the file's fp16) images in, float32 logits out,
    on the device the images came from."""

    def __init__(self, sess: Any):
        super().__init__()
        self.session = sess
        inp = sess.get_inputs()[0]
        self.input_name = inp.name
        self.half = inp.type == "tensor(float16)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        arr = x.detach().float().cpu().numpy()
        out = self.session.run(None, {self.input_name: arr.astype(np.float16) if self.half else arr})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).to(x.device)


@dataclass(frozen=True)
class Opened:
    """An ONNX file opened: the module, its class names (`named`: from the file's metadata), its size and
    preprocessing."""

    module: OnnxModule
    class_names: tuple[str, ...]
    named: bool
    img_size: int
    norm: tuple[tuple, tuple] | None
    interpolation: str


def _bad(path: Path, key: str, value: str, expected: str) -> UserError:
    shown = value if len(value) <= 40 else value[:37] + "..."
    return UserError(f"{printable(str(path))}: its metadata {key!r} is {printable(shown)!r}, not {expected}; "
                     "the file was edited or damaged, export it again")


def read_metadata(path: Path, meta: dict[str, str]) -> dict[str, Any]:
    """The dlenv description in an ONNX file's metadata, checked and bounded: {class_names, img_size,
    norm, interpolation} ({} for a file without dlenv's format key). Raises UserError naming the entry."""
    from dlenv.runfolder.runstate import MAX_CLASSES, MAX_IMG_SIZE, MAX_NAME

    if meta.get("format") != FORMAT:
        return {}
    out: dict[str, Any] = {}
    try:
        names = json.loads(meta.get("class_names", ""))
    except ValueError:
        names = None
    if not (isinstance(names, list) and 1 <= len(names) <= MAX_CLASSES
            and all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names)):
        raise _bad(path, "class_names", meta.get("class_names", ""), f"a list of 1 to {MAX_CLASSES:,} class names")
    out["class_names"] = names
    size = meta.get("img_size", "")
    if not (size.isdigit() and len(size) <= 5 and 16 <= int(size) <= MAX_IMG_SIZE):
        raise _bad(path, "img_size", size, f"an image size of 16 to {MAX_IMG_SIZE} pixels")
    out["img_size"] = int(size)
    out["interpolation"] = meta.get("interpolation", "bilinear")
    if out["interpolation"] not in _INTERPOLATIONS:
        raise _bad(path, "interpolation", out["interpolation"], " or ".join(_INTERPOLATIONS))
    out["norm"] = None
    if "mean" in meta or "std" in meta:
        try:
            mean, std = json.loads(meta.get("mean", "")), json.loads(meta.get("std", ""))
        except ValueError:
            mean = std = None
        ok = all(isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                            for x in v) for v in (mean, std))
        if not ok or min(std) <= 0:
            raise _bad(path, "mean/std", f"{meta.get('mean')}/{meta.get('std')}", "three finite numbers each "
                       "(std above 0)")
        out["norm"] = (tuple(float(x) for x in mean), tuple(float(x) for x in std))
    return out


def _input_size(path: Path, shape: list[Any], given: int | None, described: int | None) -> int:
    """The image size the graph's input takes; UserError when it is not [batch, 3, S, S] or disagrees with
    --img-size or the metadata."""
    shown = printable(str(path))
    dims = [d if isinstance(d, int) else "?" for d in shape]
    text = " x ".join(str(d) if d != "?" else "N" for d in dims)
    if len(dims) != 4 or dims[1] not in (3, "?"):
        raise UserError(f"{shown} takes inputs of shape {text}, not batches of RGB images (N x 3 x H x W); "
                        "predict runs image classifiers")
    h, w = dims[2], dims[3]
    if h == "?" or w == "?":
        size = given or described
        if size is None:
            raise UserError(f"{shown} takes images of any size (input {text}) and does not say which it was "
                            "trained at; pass --img-size N")
        return int(size)
    if h != w:
        raise UserError(f"{shown} takes {h}x{w} images; dlenv prepares square images (centre crop): export the "
                        "model at a square size")
    if given is not None and given != h:
        raise UserError(f"{shown} takes {h}x{h} images (its input is {text}), not --img-size {given}; drop "
                        f"--img-size or pass --img-size {h}")
    if described is not None and described != h:
        raise UserError(f"{shown}: its metadata says {described} px but its input is {text}; the file was "
                        "edited or damaged, export it again")
    return int(h)


def open_file(path: Path, img_size: int | None, device: Any = None) -> Opened:
    """An ONNX file ready to run (see the module doc). Raises UserError for a missing or non-regular file,
    one onnxruntime cannot load, metadata out of bounds, an input that is not square RGB images of the
    size asked, and onnxruntime missing."""
    shown = printable(str(path))
    if not path.exists():
        raise UserError(f"ONNX file {shown} not found; export one with invoke export --format onnx")
    _runtime()
    with safeio.open_regular(path, "ONNX file", limit=MAX_BYTES) as fh:
        data = fh.read()
    try:
        sess = session(data, device)
    except Exception as e:  # onnxruntime's Fail / InvalidProtobuf / InvalidGraph: the file is what's wrong
        first = printable(str(e).strip().splitlines()[0][:160]) if str(e).strip() else type(e).__name__
        raise UserError(f"{shown} is not an ONNX model onnxruntime can load ({first}); export it again") from None
    info = read_metadata(path, dict(sess.get_modelmeta().custom_metadata_map or {}))
    size = _input_size(path, list(sess.get_inputs()[0].shape), img_size, info.get("img_size"))
    module = OnnxModule(sess).eval()
    names = info.get("class_names")
    if names is None:
        with torch.inference_mode():
            try:
                width = int(module(torch.zeros(1, 3, size, size)).shape[-1])
            except Exception as e:
                first = printable(str(e).strip().splitlines()[-1][:120]) if str(e).strip() else type(e).__name__
                raise UserError(f"{shown} does not run on {size}x{size} images ({first})") from None
        names = [str(i) for i in range(width)]
    else:
        width = sess.get_outputs()[0].shape[-1]
        if isinstance(width, int) and width != len(names):
            raise UserError(f"{shown}: its metadata lists {len(names)} class names but the model has {width} "
                            "outputs; the file was edited or damaged, export it again")
    return Opened(module, tuple(names), bool(info), size, info.get("norm"), info.get("interpolation", "bilinear"))
