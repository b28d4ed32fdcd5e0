"""`dlenv export --format onnx --quantize int8` (issue 44 item 10): onnxruntime's own static quantization in
QDQ format, calibrated on the run's data, checked by onnxruntime like the float export. The file loads in
plain onnxruntime on the CPU, holds QuantizeLinear/DequantizeLinear and no ConvInteger (the node
quantize_dynamic makes, which the CPU provider refuses), and its outputs follow the float model's."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from compressrun import CLASSES, IMG, NO_ONNX, save_ckpt

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


# ---------------------------------------------------------------------------------------------------
# issue 52 item 5: weights int8 cannot scale are one line naming the layer (3e38 gave numpy's RuntimeWarning and
# "AssertionError: scale issue"), and a full disk is the disk (exit 5), not advice to drop --quantize.

def _poisoned(ckpt, key, value):
    from dlenv.files.runstate import save_state

    state = load_state(ckpt)
    t = state["model"][key]
    state["model"][key] = torch.full_like(t, value) if isinstance(value, float) else value(t)
    return save_state(state, ckpt)


def _one_scaled(t):
    t = t.clone()
    t.view(-1)[0] = 3e38
    return t


#: (id, the state-dict entry, its new value, what the line names)
POISON = [
    ("fc-3e38", "fc.weight", 3e38, "fc.weight reaches 3e+38"),
    ("fc-minus-3e38", "fc.weight", -3e38, "fc.weight reaches 3e+38"),
    ("one-value-3e38", "conv1.weight", _one_scaled, "conv1.weight reaches 3e+38"),
    ("bias-1e31", "fc.bias", 1e31, "fc.bias reaches 1e+31"),
    ("inf", "layer1.0.conv1.weight", float("inf"), "layer1.0.conv1.weight holds values that are not finite"),
    ("nan", "fc.weight", float("nan"), "fc.weight holds values that are not finite"),
    ("bn-running-var-inf", "bn1.running_var", float("inf"), "bn1.running_var holds values that are not finite"),
    ("overflowing-activations", "fc.weight", 1e29, "layer fc (Linear)"),  # below the bound: judged by its outputs
]


@pytest.mark.parametrize(("key", "value", "said"), [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_weights_int8_cannot_scale_are_named(run, key, value, said):
    _, ckpt = run
    model, _, _ = model_from_state(load_state(_poisoned(ckpt, key, value)))
    if key == "fc.weight" and value == 1e29:
        with torch.no_grad():
            model.conv1.weight.mul_(1e12)  # the image's features reach ~1e12: 1e29 x 1e12 is past float32
    with pytest.raises(UserError) as e:
        from dlenv.compress import quantize

        quantize.check_quantizable(model.eval(), torch.rand(2, 3, IMG, IMG), "int8")
    line = str(e.value)
    assert said in line and "drop --quantize" in line and "\n" not in line, line
    if value == 1e29:
        assert "outputs of layer" in line and "are not finite on the check images" in line, line


def test_trained_weights_pass_the_check(run):
    from dlenv.compress import quantize

    model, _, _ = model_from_state(load_state(run[1]))
    quantize.check_quantizable(model.eval(), torch.rand(2, 3, IMG, IMG), "int8")  # no error


@pytest.mark.parametrize(("fmt", "mode"), [("onnx", "int8"), ("torchscript", "static"), ("torchscript", "dynamic")])
def test_export_of_3e38_weights_is_one_line_without_warnings(run, capfd, recwarn, fmt, mode):
    ds, ckpt = run
    _poisoned(ckpt, "fc.weight", 3e38)
    code = cli_main(["export", "--weights", str(ckpt), "--format", fmt, "--quantize", mode, "--data", str(ds / "val"),
                     "--workers", "0", "--batch-size", "4", "--calib-batches", "1"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "Warning" not in err and "scale issue" not in err, err
    assert f"--quantize {mode}: fc.weight reaches 3e+38" in err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert not list(ckpt.parent.glob("*int8*"))  # nothing written


@pytest.mark.slow  # a ResNet-18 exported to ONNX first: 5-20 s on 2 busy cores
@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EROFS"])
def test_a_full_disk_under_onnx_int8_is_the_disk_exit_5(run, monkeypatch, capsys, code):
    import errno

    ort_q = pytest.importorskip("onnxruntime.quantization")
    ds, ckpt = run

    def full(model_input, model_output, reader, **kw):
        reader.get_next()  # a batch calibrated, then the write fails (a write() names no file)
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(ort_q, "quantize_static", full)
    rc = cli_main(["export", "--weights", str(ckpt), "--format", "onnx", "--quantize", "int8", "--data",
                   str(ds / "val"), "--workers", "0", "--batch-size", "4", "--calib-batches", "1"])
    err = capsys.readouterr().err
    assert rc == 5, err
    assert err.count("\n") == 1 and "Traceback" not in err and "drop --quantize" not in err, err
    assert f"{ckpt.parent}/.best_model_int8.onnx." in err, err  # the file being written (renamed when whole)
