"""`dlenv export`: a run file to ONNX or TorchScript (float32, fp16 or int8), checked against PyTorch.

The model is rebuilt from the run file alone. Files have a dynamic batch axis (traced with one
image, checked with a whole batch). The file is written to a temporary name, loaded back and run on
real images from `--data` (or the run file's own val data; random input only when there is none,
and the report says so); the largest absolute difference from PyTorch's output and the share of equal
top-1 classes are reported, and only a file within `tolerance` is renamed into place:

    onnx         onnxruntime (in requirements.txt); the file also carries the class names, image size,
                 normalisation and resampling as metadata (dlenv.files.onnxmodel), so `dlenv predict` runs it
                 with nothing else given
    torchscript  torch.jit.load of the written file

`--half` exports fp16 for GPU inference (needs CUDA). `--quantize` makes an int8 file for CPU inference
(see dlenv.compress.quantize) and reports top-1, size and CPU latency before and after: for TorchScript,
PyTorch's int8 modules (dynamic, or static = int8: calibrated); for ONNX, int8 (or static) is the float
file quantized by onnxruntime itself in QDQ format, calibrated on --calib-batches batches of the data
prepared as `dlenv val` prepares them, then run by onnxruntime's CPU provider on the check images (its
top-1 agreement with the float model reported; a file whose outputs are not finite is not written).
PyTorch's int8 modules do not export to ONNX reliably, and onnxruntime's dynamic int8 gives ConvInteger
nodes its CPU provider does not run: --quantize dynamic stays TorchScript's.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import torch

from dlenv import compat
from dlenv.compress import common, quantize
from dlenv.errors import UserError, first_line, optional_import
from dlenv.files import onnxmodel, runstate
from dlenv.files.atomic import check_output, write_atomic
from dlenv.files.weights import LoadPolicy
from dlenv.runfolder import check_replaceable
from dlenv.runfolder.trained import Trained

_SUFFIX = {"onnx": ".onnx", "torchscript": ".torchscript.pt", "safetensors": ".safetensors"}


def _check_options(cfg: Any) -> None:
    """UserError for option combinations that cannot work here, before anything is loaded."""
    if cfg.format == "safetensors" and (cfg.half or cfg.quantize != "none"):
        raise UserError("--format safetensors writes the float32 weights for --weights and other tools; "
                        "drop --half/--quantize (they make inference files: --format onnx or torchscript)")
    if cfg.half and cfg.quantize != "none":
        raise UserError("--half and --quantize don't mix: fp16 is for GPU inference, int8 for CPU; pick one")
    if cfg.quantize == "dynamic" and cfg.format == "onnx":
        raise UserError("--quantize dynamic with --format onnx is not supported: onnxruntime's dynamic int8 makes "
                        "ConvInteger nodes, which its CPU provider does not run; use --quantize int8 (static, "
                        "calibrated on your data), or --format torchscript --quantize dynamic")
    if _onnx_int8(cfg) and cfg.opset < quantize.QDQ_MIN_OPSET:
        raise UserError(f"--quantize {cfg.quantize} with --format onnx quantizes per channel, which needs --opset "
                        f"{quantize.QDQ_MIN_OPSET} or newer (got {cfg.opset})")
    if cfg.half and not torch.cuda.is_available():
        raise UserError(f"--half needs a CUDA GPU (fp16 export is for GPU inference) and PyTorch "
                        f"{torch.__version__} sees none here; drop --half to export float32")
    if cfg.quantize != "none" and not _onnx_int8(cfg):
        quantize.check_available(cfg.quantize)
    if cfg.format == "onnx":
        reason = compat.onnx_export_unavailable()
        if reason:
            raise UserError(f"--format onnx: {reason}")
        newest = compat.onnx_max_opset()
        if newest is not None and cfg.opset > newest:
            raise UserError(f"--opset {cfg.opset}: PyTorch {torch.__version__} exports ONNX opsets up to {newest}; "
                            f"pass --opset {newest} or lower")
        # both imported now: one that is installed but broken (built for another NumPy) is one line and pip check
        optional_import("onnx", "--format onnx needs the onnx package (in requirements.txt: pip install -r "
                                "requirements.txt)")
        optional_import("onnxruntime", "--format onnx runs the exported file with onnxruntime to check it, and "
                                       "onnxruntime is not installed (it is in requirements.txt: pip install -r "
                                       "requirements.txt)")


def _onnx_int8(cfg: Any) -> bool:
    """Whether cfg asks for an int8 ONNX file (onnxruntime's static QDQ quantization)."""
    return cfg.format == "onnx" and cfg.quantize in ("int8", "static")


def _torch_mode(quantize_option: str) -> str:
    """PyTorch's int8 mode for --quantize: int8 is the calibrated one, static."""
    return "static" if quantize_option == "int8" else quantize_option


def output_path(cfg: Any, src_path: Path) -> Path:
    """--out, else <stem>[_fp16|_int8|_int8_dynamic|_int8_static].onnx / .torchscript.pt beside the run file."""
    if cfg.out:
        out = check_output(cfg.out, "--out")
    else:
        tag = "_fp16" if cfg.half else ("" if cfg.quantize == "none" else
                                        "_int8" if cfg.quantize == "int8" else f"_int8_{cfg.quantize}")
        out = src_path.with_name(f"{src_path.stem}{tag}{_SUFFIX[cfg.format]}")
    return check_replaceable(out, src_path)


def _check_inputs(cfg: Any, src: Trained) -> tuple[torch.Tensor, Any, str]:
    """(images, loader or None, description) to check and calibrate with."""
    try:
        root, loader = common.eval_loader(cfg.data, src, cfg.batch_size, cfg.workers)
    except UserError as e:
        if cfg.data or cfg.quantize != "none":
            raise
        print(f"no data for the output check ({e}); checking on random input instead")
        n = min(cfg.batch_size, 4)
        return torch.randn(n, 3, src.img_size, src.img_size), None, f"{n} random inputs (no data found)"
    images = common.first_batch(loader)
    return images, loader, f"{len(images)} real images from {root}"


def run_exported(path: Path, fmt: str, inputs: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, str]:
    """Outputs of the exported file at `path` on `inputs` (float32 CPU) and what ran them: torch.jit.load
    for TorchScript, onnxruntime for ONNX (its CUDA provider for a file on a GPU where it has one).
    Raises UserError when the file cannot be run (nothing is then written in its place)."""
    if fmt == "torchscript":
        loaded = compat.jit_load(path, map_location=device)
        with torch.no_grad():
            return loaded(inputs).float().cpu(), "TorchScript (torch.jit.load of the file)"
    ort = optional_import("onnxruntime", "--format onnx runs the exported file with onnxruntime to check it; pip "
                                         "install -r requirements.txt")
    try:
        sess = onnxmodel.session(path, device)
        with torch.no_grad():
            out = onnxmodel.OnnxModule(sess)(inputs)
    except Exception as e:  # e.g. an fp16 graph on a CPU provider without fp16 kernels
        first = first_line(e, 160, named=False)
        raise UserError(f"onnxruntime {ort.__version__} could not run the exported file ({first}), so it is not "
                        "checked and was not written; export float32 (drop --half), or another --opset") from None
    return out.float().cpu(), f"onnxruntime {ort.__version__} ({sess.get_providers()[0]})"


def _quantize(cfg: Any, src: Trained, loader: Any, example: torch.Tensor) -> torch.nn.Module:
    """The int8 model, after printing the float-vs-int8 table (top-1, TorchScript size, CPU latency)."""
    model = src.model
    mode = _torch_mode(cfg.quantize)
    if mode == "dynamic":
        q = quantize.quantize_dynamic(model)
    else:
        q = quantize.quantize_static(model, quantize.calibration_batches(loader, cfg.calib_batches), example)
    print(quantize.summary_line(mode, compat.quant_backend(), q))
    rows = []
    cpu = torch.device("cpu")
    if loader is not None:
        rows.append(["top-1 (%)", f"{common.top1(common.cpu_copy(model), loader, cpu, src.class_names):.2f}",
                     f"{common.top1(q, loader, cpu, src.class_names):.2f}"])
    f_raw, f_zip = common.saved_sizes(compat.jit_trace(common.cpu_copy(model), example))
    q_raw, q_zip = common.saved_sizes(compat.jit_trace(q, example))
    lat = common.cpu_latencies([common.cpu_copy(model), q], src.img_size)
    rows += [["TorchScript size", common.mib(f_raw), common.mib(q_raw)],
             ["zipped", common.mib(f_zip), common.mib(q_zip)],
             ["CPU latency, 1 image", str(lat[0]), str(lat[1])]]
    print(common.table(["", "float32", f"int8 {mode}"], rows))
    print(common.latency_note(lat, src.img_size))
    return q


def export_onnx_int8(cfg: Any, src: Trained, inputs: torch.Tensor, loader: Any, described: str, out: Path) -> int:
    """`export --format onnx --quantize int8`: the float ONNX export quantized by onnxruntime (QDQ, calibrated,
    dlenv.compress.quantize.onnx_int8), run by onnxruntime's CPU provider on the check images against the
    float model, then the float-vs-int8 table (top-1 on the data, file size, CPU latency). Returns 0."""

    cpu = torch.device("cpu")
    model = common.cpu_copy(src.model)
    quantize.check_quantizable(model, inputs, cfg.quantize)
    with torch.no_grad():
        ref = model(inputs.float().cpu()).float()
    checked: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dlenv-export-") as work:
        float_file = Path(work) / "float.onnx"
        compat.onnx_export(model, inputs[:1].float().cpu(), float_file, cfg.opset)

        def write_and_check(tmp: Path) -> None:
            """The int8 file at `tmp`, run by onnxruntime; one whose outputs are not finite is never renamed."""
            checked["batches"] = quantize.onnx_int8(float_file, tmp, quantize.calibration_batches(loader,
                                                                                                 cfg.calib_batches))
            onnxmodel.write_metadata(tmp, onnxmodel.metadata(list(src.class_names), src.img_size, src.norm,
                                                             src.interpolation))
            got, how = run_exported(tmp, "onnx", inputs, cpu)
            if not bool(torch.isfinite(got).all()):
                raise UserError(f"the int8 ONNX file gives non-finite outputs on {described} (via {how}); it was not "
                                f"written to {out}. Export float (drop --quantize) or calibrate on other --data")
            checked.update(how=how, diff=float((got - ref).abs().max()),
                           agree=float((got.argmax(1) == ref.argmax(1)).float().mean() * 100))

        write_atomic(out, write_and_check)
        float_session, int8_session = onnxmodel.session(float_file, cpu), onnxmodel.session(out, cpu)
        float_raw = float_file.stat().st_size
        float_m, int8_m = onnxmodel.OnnxModule(float_session), onnxmodel.OnnxModule(int8_session)
        top1 = [common.top1(m, loader, cpu, src.class_names) for m in (float_m, int8_m)]
        lat = common.cpu_latencies([float_m, int8_m], src.img_size)
    raw, zipped = common.file_sizes(out)
    qdq = sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in _onnx_nodes(out))
    print(f"wrote {out} (onnx, int8 QDQ by onnxruntime, calibrated on {checked['batches']} batch(es) of "
          f"--batch-size {cfg.batch_size}, {qdq} QuantizeLinear/DequantizeLinear nodes, dynamic batch; class names, "
          f"image size and normalisation in its metadata; {common.mib(raw)}, zipped {common.mib(zipped)})")
    print(f"check on {described} via {checked['how']}: same top-1 class as the float model for "
          f"{checked['agree']:.1f}%, largest |difference| {checked['diff']:.3g}")
    print(common.table(["", "float32 ONNX", "int8 ONNX"],
                       [["top-1 (%)", f"{top1[0]:.2f}", f"{top1[1]:.2f}"],
                        ["file size", common.mib(float_raw), common.mib(raw)],
                        ["CPU latency, 1 image", str(lat[0]), str(lat[1])]]))
    print(common.latency_note(lat, src.img_size))
    if top1[1] < top1[0] - 1.0:
        print(f"int8 top-1 is {top1[0] - top1[1]:.1f} points below float32: calibrate on more images "
              f"(--calib-batches, now {cfg.calib_batches}) or keep the float export")
    return 0


def _onnx_nodes(path: Path) -> list[Any]:
    onnx = optional_import("onnx", "--format onnx needs the onnx package; pip install -r requirements.txt")
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def tolerance(ref: torch.Tensor, half: bool) -> float:
    """Largest acceptable |exported - PyTorch| for outputs `ref`: relative to their scale, looser in fp16."""
    scale = max(1.0, float(ref.abs().max()))
    return (2e-2 if half else 1e-3) * scale


def main(cfg: Any) -> int:
    """`dlenv export`: write cfg.weights as ONNX or TorchScript and check it against PyTorch.

    Returns 0 when the exported outputs agree within `tolerance` (safetensors: 1 when reading it back
    differs). Raises UserError for incompatible options (--half without CUDA, int8 ONNX), a run file
    that is missing or has no class names, a model static quantization cannot handle, an environment
    that cannot export or run ONNX, and an exported file that disagrees with PyTorch or cannot be run
    (then nothing is written: whatever was at the output path stays).
    """
    _check_options(cfg)
    src = common.open_weights(cfg.weights, "export", LoadPolicy.of(cfg), cfg.model)
    out = output_path(cfg, src.path)
    if cfg.format == "safetensors":  # weights, not a program: written, read back, compared (dlenv.files.runstate)

        return runstate.export_safetensors(src.run_file, src.model, out)
    inputs, loader, described = _check_inputs(cfg, src)
    if _onnx_int8(cfg):
        return export_onnx_int8(cfg, src, inputs, loader, described, out)
    example = inputs[:1]

    model: torch.nn.Module = src.model
    device = torch.device("cpu")
    if cfg.quantize != "none":
        quantize.check_quantizable(common.cpu_copy(model), inputs, cfg.quantize)
        model = _quantize(cfg, src, loader, example)
    elif cfg.half:
        device = torch.device("cuda")
        model = model.half().to(device)
        inputs, example = inputs.half().to(device), example.half().to(device)

    with torch.no_grad():
        ref = model(inputs).float().cpu()
    tol = tolerance(ref, cfg.half)
    checked: dict[str, Any] = {}

    def write_and_check(tmp: Path) -> None:
        """The file, written to `tmp` and run against PyTorch; a file that disagrees is never renamed to
        `out` (write_atomic removes it and leaves what was there)."""
        if cfg.format == "torchscript":
            buf = io.BytesIO()  # torch.jit.save to a path ends the process when the disk fills (1.13)
            compat.jit_save(compat.jit_trace(model, example), buf)
            tmp.write_bytes(buf.getvalue())
        else:

            compat.onnx_export(model, example, tmp, cfg.opset)
            onnxmodel.write_metadata(tmp, onnxmodel.metadata(list(src.class_names), src.img_size, src.norm,
                                                             src.interpolation))
        got, how = run_exported(tmp, cfg.format, inputs, device)
        diff = float((got - ref).abs().max())
        agree = float((got.argmax(1) == ref.argmax(1)).float().mean() * 100)
        if not diff <= tol:  # NaN too
            raise UserError(f"the exported {cfg.format} file disagrees with PyTorch on {described} (via {how}): "
                            f"largest |difference| {diff:.3g} > tolerance {tol:.2g}, same top-1 class for "
                            f"{agree:.1f}%; it was not written to {out}. Try another --opset, or --format "
                            "torchscript") from None
        checked.update(how=how, diff=diff, agree=agree)

    write_atomic(out, write_and_check)
    raw, zipped = common.file_sizes(out)
    dtype = "fp16" if cfg.half else (f"int8 {_torch_mode(cfg.quantize)}" if cfg.quantize != "none" else "float32")
    described_file = "class names, image size and normalisation in its metadata; " if cfg.format == "onnx" else ""
    print(f"wrote {out} ({cfg.format}, {dtype}, dynamic batch; {described_file}{common.mib(raw)}, zipped "
          f"{common.mib(zipped)})")
    print(f"check on {described} via {checked['how']}: largest |difference| from PyTorch {checked['diff']:.3g} "
          f"(tolerance {tol:.2g}), same top-1 class for {checked['agree']:.1f}%")
    return 0
