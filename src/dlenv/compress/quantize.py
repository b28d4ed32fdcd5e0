"""int8 quantization for CPU inference: dynamic (linear layers), static post-training (FX), and ONNX QDQ.

Dynamic: weights of `nn.Linear` layers become int8 and activations are quantized on the fly per
batch; no calibration. For a convnet this only touches the classifier, so most compute stays float.
Static: FX graph mode (`prepare_fx` / `convert_fx`, the backend's default qconfig: per-channel
weights, histogram-observed activations) fuses conv+bn+relu, observes activation ranges on a few
calibration batches and converts conv and linear layers to int8 kernels (x86/fbgemm on Intel/AMD,
qnnpack on ARM). Both give CPU-only models; they are saved as TorchScript. Version differences
(torch.ao.quantization vs the 1.13 aliases, the deprecation of 2.9+) live in dlenv.compat.

ONNX (`onnx_int8`): the float ONNX file quantized by onnxruntime's own `quantize_static` in QDQ format
(QuantizeLinear/DequantizeLinear pairs around int8 weights, per channel; onnxruntime's CPU provider
fuses them into QLinearConv and friends), its activation ranges calibrated (MinMax) on batches of the
run's data prepared as `dlenv val` prepares them. Not `quantize_dynamic`: on a convnet it gives
ConvInteger, which onnxruntime's CPU provider does not run.

Before either, `check_quantizable` refuses weights int8 cannot scale, in one line naming the layer: a value
that is not finite, or one past HUGE_WEIGHT, and a layer whose outputs on the check images are not finite
(weights of 3e38 made numpy warn of overflow and onnxruntime stop on "AssertionError: scale issue").
"""

from __future__ import annotations

import copy
import errno
import itertools
import logging
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv import compat
from dlenv.errors import UserError, environment_fault, first_line, optional_import, with_path

#: the largest |weight| int8 takes: a layer's range (max - min, up to twice this) over 255 is its scale, and
#: the range, the scale and the sums they enter must stay inside float32 (which ends at 3.4e38) with room to
#: spare; no trained layer comes near (their weights are mostly below 10)
HUGE_WEIGHT = 1e30


def check_quantizable(model: nn.Module, inputs: torch.Tensor, mode: str) -> None:
    """Raise UserError, naming the layer, when `model` holds a weight (or buffer) that is not finite or past
    HUGE_WEIGHT, or a layer's output on `inputs` is not finite: int8 cannot scale such values."""
    out = "; use another run file (one from before the values grew), or export float (drop --quantize)"
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if not t.is_floating_point() or not t.numel():
            continue
        if not bool(torch.isfinite(t).all()):
            raise UserError(f"--quantize {mode}: {name} holds values that are not finite (NaN or inf): the run "
                            f"that wrote these weights diverged, and int8 cannot scale them{out}")
        top = float(t.detach().abs().max())
        if top > HUGE_WEIGHT:
            raise UserError(f"--quantize {mode}: {name} reaches {top:.3g}, past the {HUGE_WEIGHT:.0e} int8 can "
                            f"scale in float32{out}")
    names = {m: n for n, m in model.named_modules() if n}
    first: list[nn.Module] = []

    def hook(module: nn.Module, _inp: Any, output: Any) -> None:
        if not first and torch.is_tensor(output) and output.is_floating_point() and not bool(
                torch.isfinite(output).all()):
            first.append(module)

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        with torch.no_grad():
            model(inputs.float().cpu())
    finally:
        for h in handles:
            h.remove()
    if first:
        raise UserError(f"--quantize {mode}: the outputs of layer {names[first[0]]} ({type(first[0]).__name__}) are "
                        f"not finite on the check images, so int8 has no range to scale them to{out}")


def check_available(mode: str) -> None:
    """Raise UserError if this PyTorch cannot quantize to int8."""
    reason = compat.quantization_unavailable()
    if reason:
        raise UserError(f"--quantize {mode}: {reason}; export in float (drop --quantize)")


def quantize_dynamic(model: nn.Module) -> nn.Module:
    """A dynamic int8 copy of `model` (its Linear layers), on the CPU in eval mode.

    Raises UserError when the model has no Linear layer.
    """
    check_available("dynamic")
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise UserError("--quantize dynamic: the model has no Linear layer (dynamic int8 covers Linear "
                        "layers only); use --quantize static for conv layers")
    return compat.quantize_dynamic(copy.deepcopy(model).float().cpu().eval(), {nn.Linear})


def _is_fx_leaf(m: nn.Module) -> bool:
    """torch.fx treats torch.nn's own layers (not containers) as opaque leaves."""
    return type(m).__module__.startswith("torch.nn") and not isinstance(m, (nn.Sequential, nn.ModuleList,
                                                                              nn.ModuleDict))


def untraceable_layer(model: nn.Module) -> str | None:
    """The deepest submodule that torch.fx cannot trace symbolically, as "name (Type)"; None if none is."""
    import torch.fx

    worst = None
    for name, sub in model.named_modules():
        if not name or _is_fx_leaf(sub):
            continue
        try:
            torch.fx.symbolic_trace(sub)
        except Exception:  # any tracing failure marks the layer; the deepest one is the culprit
            if worst is None or name.count(".") >= worst[0].count("."):
                worst = (name, type(sub).__name__)
    return f"{worst[0]} ({worst[1]})" if worst else None


def quantize_static(model: nn.Module, calibration: Iterable[torch.Tensor], example: torch.Tensor) -> nn.Module:
    """A static int8 copy of `model` calibrated on the `calibration` batches, on the CPU in eval mode.

    Raises UserError when torch.fx cannot trace the model (naming the layer), when no calibration
    batch is given, or when the converted model hits an op without an int8 CPU kernel.
    """
    check_available("static")
    m = copy.deepcopy(model).float().cpu().eval()
    example = example.float().cpu()
    try:
        prepared = compat.prepare_fx(m, (example,))
    except Exception as e:  # FX tracing of the user's model: a limit of their model, not a dlenv bug
        layer = untraceable_layer(m)
        where = f"layer {layer}" if layer else f"model {type(m).__name__}"
        raise UserError(f"--quantize static: {where} is not supported for static quantization: torch.fx "
                        f"cannot trace it ({first_line(e, named=False)}); use --quantize dynamic, or export in float"
                        ) from None
    seen = 0
    with torch.no_grad():
        for images in calibration:
            prepared(images.float().cpu())
            seen += 1
    if not seen:
        raise UserError("--quantize static needs calibration images; pass --data with class folders of images")
    q = compat.convert_fx(prepared)
    failed = failing_op(q, example)
    if failed:
        where, e = failed
        raise UserError(f"--quantize static: {where} has no int8 CPU kernel for its input in PyTorch "
                        f"{torch.__version__} ({first_line(e, named=False)}); use --quantize dynamic, or export in "
                        "float")
    return q


def _describe(node: Any, gm: nn.Module) -> str:
    """A graph node as the user wrote it: the layer or call, and the source line it came from."""
    import torch.fx

    if node.op == "call_module":
        what = f"layer {node.target} ({type(gm.get_submodule(node.target)).__name__})"
    elif node.op == "call_method":
        what = f"x.{node.target}(...)"
    else:
        what = f"{getattr(node.target, '__name__', node.target)}(...)"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', getattr(node, "stack_trace", None) or "")
    # The innermost frame outside torch and dlenv is the model's own code. FX records the stack
    # innermost-first on 1.13 and outermost-first (ending in torch.fx's own frames) on 2.x.
    skip = tuple(str(Path(m.__file__).parent) + os.sep for m in (torch, compat))
    user = [f for f in frames if not f[0].startswith(skip)]
    if frames and frames[-1][0].startswith(str(Path(torch.fx.__file__).parent) + os.sep):
        user.reverse()
    if user:
        file, line, func = user[0]
        what += f" at {Path(file).name}:{line} (in {func})"
    return what


def failing_op(gm: nn.Module, example: torch.Tensor) -> tuple[str, BaseException] | None:
    """Run an FX GraphModule on `example` node by node; (description, error) of the first node that
    raises, or None when the whole graph runs. (The Interpreter also avoids the generated-code dump
    that a failing GraphModule call prints to stderr.)"""
    import torch.fx

    class _Finder(torch.fx.Interpreter):
        failed = None

        def run_node(self, n: Any) -> Any:
            try:
                return super().run_node(n)
            except Exception as e:  # remember where, then let it propagate
                if self.failed is None:
                    self.failed = (n, e)
                raise

    finder = _Finder(gm)
    try:
        with torch.no_grad():
            finder.run(example)
    except Exception as e:  # reported to the caller below
        node, err = finder.failed or (None, e)
        return (_describe(node, gm) if node is not None else "an operator of this model"), err
    return None


def int8_layers(model: nn.Module) -> tuple[int, int]:
    """(int8, float) counts of the conv and linear layers of a (possibly) quantized model."""
    int8 = flt = 0
    for m in model.modules():
        name = type(m).__name__
        if "quantized" in type(m).__module__ and ("Conv" in name or "Linear" in name) and "Packed" not in name:
            int8 += 1
        elif isinstance(m, (nn.modules.conv._ConvNd, nn.Linear)):
            flt += 1
    return int8, flt


def summary_line(mode: str, engine: str, model: nn.Module) -> str:
    """What int8 covered in the quantized `model`: its int8 and float layers, and for dynamic quantization
    that it covers Linear layers only (a CNN's convolutions stay float, and its size barely moves)."""
    int8, flt = int8_layers(model)
    line = f"int8 ({mode}, {engine} engine): {int8} conv/linear layers int8, {flt} kept float"
    if mode == "dynamic" and flt:
        line += (f"; dynamic int8 covers Linear layers only, so those {flt} (convolutions) stay float: "
                 "--quantize static converts convolutions too")
    return line


def calibration_batches(loader: Any, n: int) -> Iterable[torch.Tensor]:
    """The images of the first `n` batches of `loader`."""
    for i, (images, _) in enumerate(loader):
        if i >= n:
            return
        yield images


#: the oldest ONNX opset with per-channel QuantizeLinear/DequantizeLinear (onnx_int8 quantizes per channel)
QDQ_MIN_OPSET = 13


def _disk_fault(e: BaseException | None) -> OSError | None:
    """The OSError of a machine fault (no space, quota, read-only, ...) that `e` is or was raised from, else None."""
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError) and (environment_fault(e) or e.errno in (errno.ENOSPC, errno.EDQUOT)):
            return e
        e = e.__cause__ or e.__context__
    return None


def onnx_int8(float_path: Path, out: Path, calibration: Iterable[torch.Tensor]) -> int:
    """Write to `out` the static int8 QDQ form of the float ONNX file `float_path`, calibrated on the
    `calibration` batches (float32 images, as the model takes them); returns how many batches calibrated.

    Raises UserError when no batch is given or onnxruntime's quantizer fails (its first line).
    """
    tools = optional_import("onnxruntime.quantization", "--quantize int8 with --format onnx needs onnxruntime's "
                            "quantization tools; pip install -r requirements.txt")
    CalibrationDataReader, CalibrationMethod = tools.CalibrationDataReader, tools.CalibrationMethod  # noqa: N806
    QuantFormat, QuantType, quantize_static = tools.QuantFormat, tools.QuantType, tools.quantize_static  # noqa: N806
    onnx = optional_import("onnx", "--format onnx needs the onnx package; pip install -r requirements.txt")

    name = onnx.load(str(float_path), load_external_data=False).graph.input[0].name
    fed = 0

    class Batches(CalibrationDataReader):
        """The calibration images, one batch per call, as onnxruntime's calibrator asks for them."""

        def __init__(self) -> None:
            self.batches = iter(calibration)

        def get_next(self) -> dict[str, Any] | None:
            nonlocal fed
            images = next(self.batches, None)
            if images is None:
                return None
            fed += 1
            return {name: images.detach().float().cpu().numpy()}

    # Its advice to pre-process first (shape inference, graph fusions) is a root-logger warning at every call;
    # torch's exporter already folded BatchNorm and constants in eval mode, and the rest is onnxruntime's own
    # session optimization. (Not CalibMaxIntermediateOutputs either: 1.23 drops each chunk it "merges".)
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings: check_quantizable judged the values first
            warnings.simplefilter("ignore", RuntimeWarning)
            quantize_static(str(float_path), str(out), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax)
    except Exception as e:  # onnxruntime's quantizer on the user's graph: its first line, not a dlenv bug
        fault = _disk_fault(e)
        if fault is not None:  # a full disk or the like: the machine, not the model (the CLI's exit 5)
            raise with_path(fault, out) from None
        if fed == 0:
            raise UserError("--quantize int8: no calibration images (the data gave no batch); pass --data with "
                            "class folders of images") from None
        raise UserError(f"onnxruntime could not quantize the model to int8 ({first_line(e)}); export float "
                        "(drop --quantize) or try --format torchscript --quantize int8") from None
    finally:
        logging.disable(logging.NOTSET)
    if fed == 0:
        raise UserError("--quantize int8: no calibration images (the data gave no batch); pass --data with class "
                        "folders of images")
    return fed
