"""An ONNX file as a model: the description `dlenv export` writes into it, and onnxruntime running it.

`dlenv export --format onnx` stores what a user of the file needs beside the graph, as the ONNX model's
string metadata (`metadata_props`): the dlenv format, the class names, the image size, the
normalisation and the resampling. `open_file` reads a file back for `predict` (through
dlenv.runfolder.trained.open_trained): the bytes of a regular file of bounded size are handed to onnxruntime
(so no external-data path inside the file is followed), the metadata is bounded like a run file's
(dlenv.files.runstate's limits), and the graph's input shape must be images of one size, that of the metadata
and of --img-size if given. A file another tool wrote has no metadata: its class names are then
"0".."N-1" (or --classes), its size the input shape's (or --img-size).

`OnnxModule` wraps the session as a torch module, so the file runs through the same batched loop as a
PyTorch model (dlenv.evaluate.predict); the session runs on the CPU, or on CUDA where this onnxruntime
has that provider and the command runs on a GPU. onnxruntime is imported only when a file is opened.

A file from elsewhere is bounded in work too: onnxruntime does not act on a stop signal inside a run, and
a graph of 474 bytes can hold a Loop of 2**62 trips. So before onnxruntime sees the bytes, `check_graph`
walks the graph, its subgraphs and functions (onnx's own parser: data only) and refuses every node that
runs a body of its own more than once (Loop, Scan, and any other node that carries a graph, but If, which
runs one branch once), and every tensor kept in an external file; an image classifier dlenv exports has
none. That list is the fast first answer, not the wall: `open_file` builds the session and runs the graph
in a child process with memory, CPU-time and wall-clock limits (dlenv.files.onnxchild), so a graph that
crashes onnxruntime, runs for hours or asks for any memory ends in one line naming the file and the limit.
The file must then take one input of float images [N, 3, S, S] with S within --img-size's bounds and give
one float output per image, and whatever onnxruntime says when it fails, loading or running, is one line.
Its own log lines (coloured, before dlenv's) are off. `session` (in this process) is for the files
`dlenv export` has just written and checks.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv.errors import UserError, first_line, optional_import, printable
from dlenv.files import onnxchild, safeio
from dlenv.files.runstate import MAX_CLASSES, MAX_IMG_SIZE, MAX_NAME
from dlenv.files.runstate import MAX_IMG_SIZE as IMG_SIZE_MAX  # --img-size's bound (a test holds them equal)

FORMAT = "dlenv/1"
#: the largest ONNX file opened (protobuf itself stops at 2 GiB; a file over it keeps its weights outside)
MAX_BYTES = 2 * safeio.GIB
#: resamplings a file may name (dlenv.model.pretrained.INTERPOLATIONS)
_INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
#: the one node with a body that runs it at most once per run (one of its two branches)
_BOUNDED_BODY = {"If"}
#: the nodes that repeat a body however often the graph says, whatever graph attribute they carry or not
_REPEATING = {"Loop", "Scan", "SequenceMap", "BeamSearch", "GreedySearch", "Sampling", "WhisperBeamSearch"}
#: nodes in a graph with its subgraphs and functions (a ResNet-50 has about 230)
MAX_NODES = 2**20
#: bytes of a metadata value read as JSON (100,000 class names of 256 characters fit)
_MAX_JSON = 2**26
#: the smallest image side a graph may take (--img-size's lower bound)
_MIN_SIZE = 16


def metadata(class_names: list[str], img_size: int, norm: tuple[tuple, tuple] | None,
             interpolation: str) -> dict[str, str]:
    """The string metadata `dlenv export` stores in an ONNX file (read back by `open_file`)."""
    meta = {"format": FORMAT, "class_names": json.dumps(list(class_names)), "img_size": str(int(img_size)),
            "interpolation": interpolation}
    if norm is not None:
        meta["mean"], meta["std"] = json.dumps([float(x) for x in norm[0]]), json.dumps([float(x) for x in norm[1]])
    return meta


def _onnx() -> Any:
    return optional_import("onnx", "reading an ONNX file needs the onnx package (in requirements.txt: pip install "
                                   "-r requirements.txt)")


def write_metadata(path: Path, meta: dict[str, str]) -> None:
    """Add `meta` to the ONNX file at `path` (rewritten in place: a temporary file of the caller's)."""
    onnx = _onnx()
    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save(proto, str(path))


_NO_RUNTIME = ("running an ONNX file needs onnxruntime (in requirements.txt: pip install -r requirements.txt); or "
               "pass the run file it was exported from")


def _runtime() -> Any:
    return optional_import("onnxruntime", _NO_RUNTIME)


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
    # fatal only: its warnings (unused initializers) are not the user's, and its errors, printed in colour
    # before dlenv's line, are said in that line
    ort.set_default_logger_severity(4)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    return ort.InferenceSession(source if isinstance(source, bytes) else str(source), sess_options=opts,
                                providers=providers(device))


class OnnxModule(torch.nn.Module):
    """An onnxruntime session as a torch module: float32 (or the file's fp16) images in, float32 logits out,
    on the device the images came from. A run that fails, or gives anything but one row of numbers per
    image, is a UserError naming `name` (the file)."""

    def __init__(self, sess: Any, name: str = "the ONNX model"):
        super().__init__()
        self.session, self.name = sess, name
        inp = sess.get_inputs()[0]
        self.input_name = inp.name
        self.half = inp.type == "tensor(float16)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        arr = x.detach().float().cpu().numpy()
        try:
            out = self.session.run(None, {self.input_name: arr.astype(np.float16) if self.half else arr})[0]
            out = np.asarray(out)
        except UserError:  # the child's line: a limit, a crash
            raise
        except Exception as e:  # onnxruntime's Fail, RuntimeException, InvalidArgument: the file's graph
            raise UserError(f"{self.name} failed on a batch of {len(arr)} images (onnxruntime: "
                            f"{printable(first_line(e, 160, named=False))}); export it again") from None
        if out.ndim != 2 or out.shape[0] != len(arr) or out.dtype.kind not in "fiu":
            raise UserError(f"{self.name} gave {out.dtype} outputs of shape {tuple(out.shape)[:8]} for a batch of "
                            f"{len(arr)} images, not one row of class scores per image")
        return torch.from_numpy(out.astype(np.float32)).to(x.device)

    def close(self) -> None:
        """End the child process a file from elsewhere runs in (nothing for an in-process session)."""
        getattr(self.session, "close", lambda: None)()


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

    if meta.get("format") != FORMAT:
        return {}
    out: dict[str, Any] = {}
    names = _json(meta.get("class_names", ""))
    if not (isinstance(names, list) and 1 <= len(names) <= MAX_CLASSES
            and all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names)):
        raise _bad(path, "class_names", meta.get("class_names", ""), f"a list of 1 to {MAX_CLASSES:,} class names")
    out["class_names"] = names
    size = meta.get("img_size", "")
    if not (size.isascii() and size.isdigit() and len(size) <= 5 and 16 <= int(size) <= MAX_IMG_SIZE):
        raise _bad(path, "img_size", size, f"an image size of 16 to {MAX_IMG_SIZE} pixels")
    out["img_size"] = int(size)
    out["interpolation"] = meta.get("interpolation", "bilinear")
    if out["interpolation"] not in _INTERPOLATIONS:
        raise _bad(path, "interpolation", out["interpolation"], " or ".join(_INTERPOLATIONS))
    out["norm"] = None
    if "mean" in meta or "std" in meta:
        mean, std = _json(meta.get("mean", "")), _json(meta.get("std", ""))
        ok = all(isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                            for x in v) for v in (mean, std))
        if not ok or min(std) <= 0:
            raise _bad(path, "mean/std", f"{meta.get('mean')}/{meta.get('std')}", "three finite numbers each "
                       "(std above 0)")
        out["norm"] = (tuple(float(x) for x in mean), tuple(float(x) for x in std))
    return out


def _json(text: str) -> Any:
    """`text` read as JSON, or None when it is not JSON, longer than _MAX_JSON or nested past what Python's
    parser recurses into (class names nested 100,000 deep)."""
    if len(text) > _MAX_JSON:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def check_graph(path: Path, data: bytes) -> None:
    """Refuse, in one line, an ONNX file whose graph repeats work as often as it says (module doc), or is
    not an ONNX model: its graph, every subgraph and every function, node by node, before onnxruntime
    sees it."""
    onnx = _onnx()
    from google.protobuf.message import DecodeError

    shown = printable(str(path))
    try:
        proto = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError, RecursionError) as e:  # nesting past protobuf's 100 too
        raise UserError(f"{shown} is not an ONNX model onnxruntime can load ({printable(first_line(e, 160))}); "
                        "export it again") from None
    todo = [proto.graph.node, *(f.node for f in proto.functions)]
    seen = 0
    while todo:
        for node in todo.pop():
            seen += 1
            if seen > MAX_NODES:
                raise UserError(f"{shown} has more than {MAX_NODES:,} nodes, more than an image classifier; "
                                "refusing to run it")
            bodies = [g for a in node.attribute for g in (
                [a.g] if a.type == onnx.AttributeProto.GRAPH else
                list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else [])]
            _refuse_external(path, [t for a in node.attribute for t in [a.t, *a.tensors]])
            if node.op_type in _REPEATING or (bodies and node.op_type not in _BOUNDED_BODY):
                raise UserError(f"{shown} has a {printable(node.op_type[:40])} node, which repeats its work as "
                                "often as the graph says (onnxruntime does not stop for a signal meanwhile); "
                                "an image classifier needs none, so dlenv does not run it. Export the model "
                                "without it, or run it with onnxruntime yourself")
            todo.extend(g.node for g in bodies)
            for g in bodies:
                _refuse_external(path, [*g.initializer, *(t.values for t in g.sparse_initializer)])
    _refuse_external(path, [*proto.graph.initializer, *(t.values for t in proto.graph.sparse_initializer)])


def _refuse_external(path: Path, tensors: list[Any]) -> None:
    """UserError for a tensor whose data the file says lies in another file (`../../../etc/passwd`): predict
    reads one file, and never a path named inside it."""
    onnx = _onnx()
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = next((e.value for e in t.external_data if e.key == "location"), "")
            raise UserError(f"{printable(str(path))} keeps its tensor {printable(t.name[:40])!r} in another file "
                            f"({printable(where[:60])!r}); predict reads the one file and no path named inside it: "
                            "export the model with its weights inside (dlenv export does)")


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
    if not _MIN_SIZE <= h <= IMG_SIZE_MAX:
        raise UserError(f"{shown} takes {h}x{h} images (its input is {text}), outside the {_MIN_SIZE} to "
                        f"{IMG_SIZE_MAX} px dlenv reads (--img-size's bounds)")
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
    if importlib.util.find_spec("onnxruntime") is None:  # the child imports it (and says if it is broken)
        raise UserError(_NO_RUNTIME)
    with safeio.open_regular(path, "ONNX file", limit=MAX_BYTES) as fh:
        data = fh.read()
    check_graph(path, data)
    sess = onnxchild.Child(data, shown, cuda=device is not None and torch.device(device).type == "cuda")
    try:
        return _opened(path, sess, img_size)
    except BaseException:
        sess.close()
        raise


def _opened(path: Path, sess: Any, img_size: int | None) -> Opened:
    shown = printable(str(path))
    info = read_metadata(path, dict(sess.get_modelmeta().custom_metadata_map or {}))
    _one_in_one_out(path, sess)
    size = _input_size(path, list(sess.get_inputs()[0].shape), img_size, info.get("img_size"))
    module = OnnxModule(sess, shown).eval()
    names = info.get("class_names")
    if names is None:
        with torch.inference_mode():
            try:
                width = int(module(torch.zeros(1, 3, size, size)).shape[-1])
            except onnxchild.ChildFailed:  # its own line names the file and the limit
                raise
            except UserError as e:
                raise UserError(f"{shown} does not run on {size}x{size} images: {e}") from None
        names = [str(i) for i in range(width)]
    else:
        width = sess.get_outputs()[0].shape[-1]
        if isinstance(width, int) and width != len(names):
            raise UserError(f"{shown}: its metadata lists {len(names)} class names but the model has {width} "
                            "outputs; the file was edited or damaged, export it again")
    return Opened(module, tuple(names), bool(info), size, info.get("norm"), info.get("interpolation", "bilinear"))


def _one_in_one_out(path: Path, sess: Any) -> None:
    """UserError unless the session takes one input of float images and gives float tensors (a graph of
    another kind loads in onnxruntime and then fails on the first batch, or gives no class scores)."""
    shown = printable(str(path))
    inputs, outputs = sess.get_inputs(), sess.get_outputs()
    if len(inputs) != 1:
        names = ", ".join(printable(i.name[:40]) for i in inputs[:4])
        raise UserError(f"{shown} takes {len(inputs)} inputs ({names}); predict feeds one, a batch of images")
    if inputs[0].type not in ("tensor(float)", "tensor(float16)"):
        raise UserError(f"{shown} takes {printable(inputs[0].type[:40])} input, not float images")
    out = outputs[0] if outputs else None
    if out is None or out.type not in ("tensor(float)", "tensor(float16)", "tensor(double)"):
        raise UserError(f"{shown} gives {printable(out.type[:40]) if out else 'no output'}, not a tensor of class "
                        "scores")
    if isinstance(out.shape, list) and len(out.shape) != 2:
        raise UserError(f"{shown} gives outputs of {len(out.shape)} dimensions, not one row of class scores per "
                        "image (N x classes)")
