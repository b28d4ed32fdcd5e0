"""`dlenv export --format onnx --quantize int8` (issue 44 item 10): onnxruntime's own static quantization in
QDQ format, calibrated on the run's data, checked by onnxruntime like the float export. The file loads in
plain onnxruntime on the CPU, holds QuantizeLinear/DequantizeLinear and no ConvInteger (the node
quantize_dynamic makes, which the CPU provider refuses), and its outputs follow the float model's."""

from __future__ import annotations

import functools

import pytest
import torch
from test_compress import CLASSES, IMG, NO_ONNX, save_ckpt

from dlenv.cli import main as cli_main
from dlenv.compress import common, export
from dlenv.errors import UserError
from dlenv.files.runstate import load_state
from dlenv.model.models import model_from_state
from dlenv.options import config

pytestmark = pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))


@pytest.fixture(autouse=True)
def _quick_latency(monkeypatch):
    """Latency is reported, not asserted, here: two runs instead of three seconds per model."""
    monkeypatch.setattr(common, "cpu_latencies", functools.partial(common.cpu_latencies, min_runs=2, budget_s=0.0))


@pytest.fixture
def run(tmp_path):
    from imagedata import make_image_folder

    make_image_folder(tmp_path / "ds" / "train", classes=CLASSES, per_class=4)
    make_image_folder(tmp_path / "ds" / "val", classes=CLASSES, per_class=8, seed=1)
    (tmp_path / "run").mkdir()
    return tmp_path / "ds", save_ckpt(tmp_path / "run" / "best_model.pth", tmp_path / "ds", model_name="resnet18")


@pytest.mark.slow  # a ResNet-18 exported, calibrated and timed twice: 15-45 s on 2 busy cores
def test_onnx_int8_is_qdq_runs_in_plain_onnxruntime_and_follows_the_float_model(run, capsys):
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    ds, ckpt = run
    assert cli_main(["export", "--weights", str(ckpt), "--format", "onnx", "--quantize", "int8", "--data",
                     str(ds / "val"), "--workers", "0", "--batch-size", "8", "--calib-batches", "2"]) == 0
    out = ckpt.with_name("best_model_int8.onnx")
    captured = capsys.readouterr()
    text = captured.out
    assert "pre-processing" not in captured.err  # onnxruntime's advice at every call is not the user's
    for needle in (f"wrote {out} (onnx, int8 QDQ by onnxruntime, calibrated on 2 batch(es)", "top-1 (%)",
                   "file size", "CPU latency, 1 image", "int8 ONNX", "same top-1 class as the float model"):
        assert needle in text, text

    types = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= types and "ConvInteger" not in types, types
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])  # no dlenv in between
    model, _, _ = model_from_state(load_state(ckpt))
    x = torch.rand(4, 3, IMG, IMG)
    with torch.no_grad():
        ref = model.eval()(x)
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert float((got - ref).abs().max()) <= 0.2 * float(ref.abs().max()) + 1e-3  # int8's error, not another model
    assert out.stat().st_size < 0.5 * common.saved_sizes(model.state_dict())[0]  # int8 weights


@pytest.mark.parametrize(("opts", "said"), [
    (dict(quantize="dynamic"), "ConvInteger"),
    (dict(quantize="int8", opset=12), "--opset 13 or newer (got 12)"),
    (dict(quantize="static", opset=11), "--opset 13 or newer (got 11)"),
    (dict(quantize="int8", half=True), "--half and --quantize don't mix"),
])
def test_onnx_int8_options_that_cannot_work_are_one_line(tmp_path, opts, said):
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):  # before any file is read
        export.main(config.build(config.ExportConfig, weights=str(tmp_path / "x.pth"), format="onnx", **opts))


@pytest.mark.parametrize(("fmt", "quantize", "name"), [
    ("onnx", "int8", "best_model_int8.onnx"), ("onnx", "static", "best_model_int8_static.onnx"),
    ("torchscript", "int8", "best_model_int8.torchscript.pt"),
    ("torchscript", "dynamic", "best_model_int8_dynamic.torchscript.pt"), ("onnx", "none", "best_model.onnx"),
])
def test_the_default_file_names_say_int8(tmp_path, fmt, quantize, name):
    cfg = config.build(config.ExportConfig, format=fmt, quantize=quantize)
    assert export.output_path(cfg, tmp_path / "best_model.pth") == tmp_path / name
