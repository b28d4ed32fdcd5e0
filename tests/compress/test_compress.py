"""dlenv.compress: pruning (exact sparsity, permanence, fine-tune), int8 quantization, ONNX/TorchScript
export with its output check, and each bad input as one UserError line. Tiny models at 32 px."""

from __future__ import annotations

import functools
import hashlib
import io
import shutil
from pathlib import Path

import pytest
import torch
from compressrun import CLASSES, IMG, NO_ONNX, calibrated, save_ckpt
from imagedata import make_image_folder
from torch import nn

from dlenv import compat
from dlenv.cli import main as cli_main
from dlenv.compress import common, export, prune, quantize
from dlenv.errors import EXIT_NONFINITE, UserError
from dlenv.files.runstate import FORMAT, load_state, save_state
from dlenv.model.models import model_from_state
from dlenv.options import config

NO_QUANT = compat.quantization_unavailable()


@pytest.fixture(scope="module")
def _reference(tmp_path_factory):
    """A tiny dataset (2 classes, train/ and val/) and one checkpoint trained 'on' it, built once."""
    root = tmp_path_factory.mktemp("compress")
    make_image_folder(root / "ds" / "train", classes=CLASSES, per_class=6)
    make_image_folder(root / "ds" / "val", classes=CLASSES, per_class=3, seed=1)
    return root / "ds", save_ckpt(root / "reference.pth", root / "ds")


@pytest.fixture
def data_dir(_reference):
    return _reference[0]


@pytest.fixture
def ckpt(tmp_path, _reference):
    """A fresh copy of the reference checkpoint at <tmp>/run/best_model.pth."""
    path = tmp_path / "run" / "best_model.pth"
    path.parent.mkdir()
    shutil.copyfile(_reference[1], path)
    return path


@pytest.fixture(autouse=True)
def _quick_latency(monkeypatch):
    """Latency is measured, not asserted, here: two runs instead of two seconds per model."""
    monkeypatch.setattr(common, "cpu_latencies", functools.partial(common.cpu_latencies, min_runs=2,
                                                                     budget_s=0.0))


def prune_cfg(**kw):
    return config.build(config.PruneConfig, **{"workers": 0, "device": "cpu", "batch_size": 8, **kw})


def export_cfg(**kw):
    return config.build(config.ExportConfig, **{"workers": 0, "batch_size": 8, **kw})


def prunable_zeros(model: nn.Module) -> tuple[int, int]:
    layers = prune.prunable_layers(model)
    return (sum(int((m.weight == 0).sum()) for _, m in layers), sum(m.weight.numel() for _, m in layers))


class TinyNet(nn.Module):
    """conv-bn-relu x2, pool, two linear layers: quantizable both ways, small and fast."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(32 * 16, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x):
        return self.head(self.features(x))


# ---------------------------------------------------------------------------------------------------
# Pruning.


@pytest.mark.parametrize("amount", [0.0, 1.0, -0.2, 1.5])
def test_amount_outside_open_interval_is_one_user_error_line(amount, tmp_path, capsys):
    with pytest.raises(UserError, match=r"--amount .* outside \(0, 1\)"):
        prune.apply_pruning(TinyNet(), amount)
    # the CLI checks it before reading the checkpoint (a file that is there, so the path check passes)
    (tmp_path / "unread.pth").write_bytes(b"not read")
    code = cli_main(["prune", "--weights", str(tmp_path / "unread.pth"), "--amount", str(amount)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--amount" in err and "outside (0, 1)" in err


@pytest.mark.parametrize("amount", [0.3, 0.75])
def test_global_unstructured_sparsity_is_exact_and_permanent(amount):
    torch.manual_seed(0)
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = prune.apply_pruning(model, amount)
    prune.make_permanent(layers)
    zeros, total = prunable_zeros(model)
    assert zeros == round(amount * total)  # global: exactly this many over all conv + linear weights
    g, rows = prune.sparsity(model)
    assert g == pytest.approx(amount, abs=1 / total)
    assert sum(r["zeros"] for r in rows) == zeros
    assert len({round(r["sparsity"], 3) for r in rows}) > 1  # global ranking: layers lose different shares
    sd = model.state_dict()
    assert not any(k.endswith(("weight_orig", "weight_mask")) for k in sd)
    assert set(sd) == set(before)
    # the kept weights are untouched, and the removed ones were the smallest in magnitude
    w_all = torch.cat([before[f"{n}.weight"].abs().flatten() for n, _ in layers])
    threshold = w_all.kthvalue(zeros).values
    for n, m in layers:
        kept = m.weight != 0
        assert torch.equal(m.weight[kept], before[f"{n}.weight"][kept])
        assert (before[f"{n}.weight"][~kept].abs() <= threshold).all()
    assert torch.equal(sd["head.0.bias"], before["head.0.bias"])  # biases are not pruned


@pytest.mark.parametrize("amount", [0.3, 0.5])
def test_structured_pruning_removes_channels_to_the_share_of_parameters_asked(amount):
    from dlenv.compress import channels
    from dlenv.model import shrink

    torch.manual_seed(0)
    model = calibrated(TinyNet())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, IMG, IMG)
    pruned, ratio = channels.remove_channels(model, amount, x[:1], num_classes=3)
    total = common.count_params(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the input is left as it was
    assert common.count_params(pruned) == pytest.approx((1 - amount) * total, rel=0.08)
    assert 0 < ratio < amount  # channels go on both sides of a conv: fewer than the parameter share
    assert pruned.features[0].out_channels < 16 and pruned.features[3].out_channels < 32
    assert pruned.head[2].out_features == 3  # the classifier keeps its classes
    assert pruned.features[1].num_features == pruned.features[0].out_channels  # its BatchNorm followed it
    with torch.no_grad():
        assert pruned(x).shape == (4, 3)
    # the widths rebuild the same model from the plain architecture
    widths = shrink.widths_of(pruned, model)
    assert set(widths) >= {"features.0", "features.1", "features.3", "head.0"}
    rebuilt = shrink.apply_widths(TinyNet(), widths, "x.pth")
    rebuilt.load_state_dict(pruned.state_dict())
    with torch.no_grad():
        assert torch.allclose(rebuilt.eval()(x), pruned(x), atol=1e-6)
    assert shrink.unsupported(pruned, model) == []


def test_prune_main_writes_a_checkpoint_like_any_other(ckpt, data_dir, capsys):
    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert prune.main(prune_cfg(weights=str(ckpt), amount=0.3, data=str(data_dir / "val"))) == 0
    out = ckpt.with_name("best_model_pruned.pth")
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == digest  # the input is untouched
    state = load_state(out)  # weights_only=True
    src = load_state(ckpt)
    assert state["format"] == FORMAT and state["class_names"] == CLASSES and state["config"] == src["config"]
    assert state["model_name"] == src["model_name"] and state["img_size"] == IMG
    assert state["optimizer"] is None  # dense-weight optimizer state does not belong to pruned weights
    assert not any(k.endswith(("_orig", "_mask")) for k in state["model"])
    assert set(state["model"]) == set(src["model"])
    model, names, size = model_from_state(state)  # strict: loads into a plain model
    zeros, total = prunable_zeros(model)
    assert zeros == round(0.3 * total)
    assert state["pruning"]["sparsity"] == pytest.approx(zeros / total)
    assert state["best_metric"] == state["pruning"]["top1_after"]
    text = capsys.readouterr().out
    assert f"global sparsity: {100 * zeros / total:.2f}%" in text
    for needle in ("top-1 (%)", "weights zipped", "CPU latency", "features.0.0", "classifier.3", str(out),
                   "saves nothing until the weights are stored sparse"):
        assert needle in text
    # unstructured zeros show in the zipped size, not in the raw size
    dense_raw, dense_zip = common.saved_sizes(src["model"])
    sparse_raw, sparse_zip = common.saved_sizes(state["model"])
    assert sparse_zip < 0.9 * dense_zip
    assert abs(sparse_raw - dense_raw) < 0.01 * dense_raw


@pytest.mark.slow
def test_prune_finetune_keeps_the_pruned_weights_at_zero(ckpt, capsys):
    out = ckpt.with_name("ft.pth")
    cfg = prune_cfg(weights=str(ckpt), amount=0.5, out=str(out), finetune_epochs=1, finetune_lr=0.05)
    assert prune.main(cfg) == 0
    assert "fine-tune epoch 1/1" in capsys.readouterr().out
    tuned, _, _ = model_from_state(load_state(out))
    zeros, total = prunable_zeros(tuned)
    assert zeros == round(0.5 * total)  # sparsity held through training
    # ...and training did happen: the surviving weights moved away from plain pruning's values
    plain, _, _ = model_from_state(load_state(ckpt))
    prune.make_permanent(prune.apply_pruning(plain, 0.5))
    for (_, a), (_, b) in zip(prune.prunable_layers(tuned), prune.prunable_layers(plain), strict=True):
        assert torch.equal(a.weight == 0, b.weight == 0)
    assert not torch.equal(tuned.classifier[3].weight, plain.classifier[3].weight)


def test_prune_structured_main_removes_half_the_parameters_and_val_and_predict_load_it(ckpt, data_dir, capsys):
    assert prune.main(prune_cfg(weights=str(ckpt), amount=0.5, structured=True, data=str(data_dir / "val"))) == 0
    text = capsys.readouterr().out
    out = ckpt.with_name("best_model_pruned_structured.pth")
    state, src = load_state(out), load_state(ckpt)
    assert state["widths"] and state["pruning"]["structured"] is True
    model, names, size = model_from_state(state)  # rebuilt from the name and the widths
    dense, _, _ = model_from_state(src)
    assert common.count_params(model) == pytest.approx(0.5 * common.count_params(dense), rel=0.05)
    assert state["pruning"]["params_after"] == common.count_params(model)
    assert out.stat().st_size < 0.7 * ckpt.stat().st_size  # really smaller, not zeros
    for needle in ("parameters", "CPU latency", "weights (.pth)", "layers resized", str(out)):
        assert needle in text
    assert "saves nothing until" not in text
    assert cli_main(["val", "--weights", str(out), "--data", str(data_dir / "val"), "--workers", "0",
                     "--device", "cpu"]) == 0
    assert "6 images, 2 classes" in capsys.readouterr().out
    project = ckpt.parent / "predict"
    assert cli_main(["predict", "--weights", str(out), "--source", str(data_dir / "val"), "--workers", "0",
                     "--device", "cpu", "--project", str(project)]) == 0
    rows = (project / "exp" / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + 6 and all(r.split(",")[3] in CLASSES for r in rows[1:])


def test_the_two_kinds_of_prune_write_two_files(ckpt, data_dir, capsys):
    """prune, then prune --structured, on one checkpoint: two files, neither replaced by the other."""
    assert prune.main(prune_cfg(weights=str(ckpt), amount=0.3, data=str(data_dir / "val"))) == 0
    assert prune.main(prune_cfg(weights=str(ckpt), amount=0.3, structured=True, data=str(data_dir / "val"))) == 0
    plain, structured = ckpt.with_name("best_model_pruned.pth"), ckpt.with_name("best_model_pruned_structured.pth")
    assert load_state(plain)["pruning"]["structured"] is False
    assert load_state(structured)["pruning"]["structured"] is True
    out = capsys.readouterr().out
    assert f"wrote {plain}" in out and f"wrote {structured}" in out


def test_a_structured_prune_of_a_pruned_file_keeps_the_earlier_widths(tmp_path, data_dir):
    """Layers the second prune leaves alone keep the first one's widths (lost: 'does not match')."""
    first, twice = tmp_path / "once.pth", tmp_path / "twice.pth"
    ckpt = save_ckpt(tmp_path / "cnn.pth", data_dir, model_name="small_cnn")
    for src, out, amount in ((ckpt, first, 0.99), (first, twice, 0.9)):
        assert prune.main(prune_cfg(weights=str(src), amount=amount, structured=True, data=str(data_dir / "val"),
                                    out=str(out))) == 0
    assert set(load_state(first)["widths"]) <= set(load_state(twice)["widths"])


def test_a_finetune_that_diverges_is_one_line_and_writes_nothing(ckpt, data_dir):
    out = ckpt.with_name("ft.pth")
    with pytest.raises(UserError, match="fine-tuning at --finetune-lr 1e\\+30 diverged; nothing was written") as e:
        prune.main(prune_cfg(weights=str(ckpt), data=str(data_dir / "val"), out=str(out), finetune_epochs=1,
                             finetune_lr=1e30))
    assert e.value.exit_code == EXIT_NONFINITE and not out.exists()


@pytest.mark.parametrize("before, after, epochs, hint", [
    (96.94, 74.37, 0, "top-1 fell 22.6 points (96.94% -> 74.37%); --finetune-epochs 3 retrains"),
    (90.0, 87.5, 0, "top-1 fell 2.5 points"),
    (90.0, 88.0, 0, None),   # two points: within the noise of a small validation set
    (90.0, 91.0, 0, None),
    (96.94, 74.37, 3, None),  # fine-tuned already: its own numbers say the rest
])
def test_a_prune_that_costs_accuracy_ends_naming_finetune_epochs(before, after, epochs, hint):
    got = prune.finetune_hint(before, after, epochs)
    assert (got is None) if hint is None else (hint in got and "--finetune-epochs" in got)


def test_the_finetune_hint_is_the_last_line(ckpt, data_dir, capsys, monkeypatch):
    tops = iter([90.0, 50.0])  # before, after: the measured top-1, made to fall far
    monkeypatch.setattr(common, "top1", lambda *a, **k: next(tops))
    assert prune.main(prune_cfg(weights=str(ckpt), amount=0.5, structured=True, data=str(data_dir / "val"))) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("top-1 fell 40.0 points") and "--finetune-epochs" in last


@pytest.mark.parametrize("widths,phrase", [
    ({"features.9.9": [3, 8, 1]}, "does not have"),
    ({"features.0.0": [3, 8]}, "3 whole numbers are expected"),
    ({"features.0.0": [3, 999, 1]}, "must lie between 1"),
    ({"features.1.block.0.0": [16, 12, 8]}, "do not divide"),  # a depthwise conv
    ({"features.0.0": [3, "8", 1]}, "whole numbers"),
    ({"features.0.0.weight": [3, 8, 1]}, "does not have"),
    ({"features.0.2": [4]}, "does not resize"),
    (["features.0.0"], "is not a mapping"),
])
def test_pruned_widths_that_do_not_fit_are_one_line(widths, phrase, tmp_path, ckpt):
    path = tmp_path / "edited.pth"
    save_state({**load_state(ckpt), "widths": widths}, path)
    with pytest.raises(UserError, match=phrase) as e:
        model_from_state(load_state(path), source=str(path))
    assert "\n" not in str(e.value)


def test_prune_refuses_to_overwrite_its_input(ckpt):
    with pytest.raises(UserError, match="is the input file"):
        prune.main(prune_cfg(weights=str(ckpt), out=str(ckpt)))


# ---------------------------------------------------------------------------------------------------
# Bad checkpoints.


@pytest.mark.slow
def test_checkpoint_without_class_names_is_user_error(tmp_path, data_dir, capsys):
    path = save_ckpt(tmp_path / "noclass.pth", data_dir, class_names=[])
    with pytest.raises(UserError, match="has no class names"):
        prune.main(prune_cfg(weights=str(path)))
    code = cli_main(["export", "--weights", str(path), "--format", "torchscript"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no class names" in err


def test_bare_state_dict_is_user_error(tmp_path):
    path = tmp_path / "bare.pth"
    torch.save(TinyNet().state_dict(), path)
    with pytest.raises(UserError, match="bare state dict"):
        export.main(export_cfg(weights=str(path), format="torchscript"))


# ---------------------------------------------------------------------------------------------------
# Quantization.


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
def test_dynamic_quantization_makes_linear_int8_close_and_smaller():
    torch.manual_seed(0)
    model = calibrated(TinyNet())
    q = quantize.quantize_dynamic(model)
    assert quantize.int8_layers(q) == (2, 2)  # the two Linear layers; the convs stay float
    line = quantize.summary_line("dynamic", "x86", q)
    assert line.startswith("int8 (dynamic, x86 engine): 2 conv/linear layers int8, 2 kept float")
    assert "covers Linear layers only" in line and "--quantize static" in line
    assert "Linear layers only" not in quantize.summary_line("static", "x86", q)
    x = torch.randn(16, 3, IMG, IMG)
    with torch.no_grad():
        ref, out = model(x), q(x)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    f_raw, _ = common.saved_sizes(compat.jit_trace(model, x[:1]))
    q_raw, _ = common.saved_sizes(compat.jit_trace(q, x[:1]))
    assert q_raw < 0.5 * f_raw  # the linear weights dominate this model


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
def test_static_quantization_converts_convs_and_stays_close():
    torch.manual_seed(0)
    model = calibrated(TinyNet())
    calib = [torch.randn(8, 3, IMG, IMG) for _ in range(4)]
    q = quantize.quantize_static(model, calib, calib[0][:1])
    int8, flt = quantize.int8_layers(q)
    assert int8 == 4 and flt == 0
    x = torch.randn(16, 3, IMG, IMG)
    with torch.no_grad():
        ref, out = model(x), q(x)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.8
    f_raw, _ = common.saved_sizes(compat.jit_trace(model, x[:1]))
    q_raw, _ = common.saved_sizes(compat.jit_trace(q, x[:1]))
    assert q_raw < 0.5 * f_raw
    assert torch.equal(model(x), ref)  # the float model was not modified in place


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            return self.conv(x)
        return x


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
def test_static_quantization_names_an_untraceable_layer():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.ReLU(), _Gate()), nn.Flatten(),
                          nn.Linear(3 * 8 * 8, 2)).eval()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(UserError, match=r"layer 1\.1 \(_Gate\) is not supported for static quantization"):
        quantize.quantize_static(model, [x], x[:1])


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
@pytest.mark.slow
def test_static_quantization_names_an_op_without_int8_kernel(tmp_path, data_dir, capsys):
    # torchvision's ShuffleNetV2 ends in x.mean([2, 3]), which the int8 CPU kernels refuse
    path = save_ckpt(tmp_path / "shuffle.pth", data_dir, model_name="shufflenet_v2_x0_5")
    code = cli_main(["export", "--weights", str(path), "--format", "torchscript", "--quantize", "static",
                     "--workers", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "x.mean(...) at shufflenetv2.py" in err and "no int8 CPU kernel" in err
    assert not list(tmp_path.glob("shuffle_int8*"))  # nothing half-written


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
def test_dynamic_quantization_without_linear_layers_is_user_error():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with pytest.raises(UserError, match="no Linear layer"):
        quantize.quantize_dynamic(model)


# ---------------------------------------------------------------------------------------------------
# Export.


def _loaded_outputs(path: Path, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return compat.jit_load(path).eval()(x)


def test_export_torchscript_matches_pytorch_with_dynamic_batch(ckpt, capsys):
    assert export.main(export_cfg(weights=str(ckpt), format="torchscript")) == 0
    out = ckpt.with_name("best_model.torchscript.pt")
    model, _, _ = model_from_state(load_state(ckpt))
    model.eval()
    for batch in (1, 5):  # traced with one image; other batch sizes must work too
        x = torch.randn(batch, 3, IMG, IMG)
        with torch.no_grad():
            assert torch.allclose(_loaded_outputs(out, x), model(x), atol=1e-5)
    text = capsys.readouterr().out
    assert "6 real images from" in text and "largest |difference| from PyTorch" in text


@pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))
def test_export_onnx_checked_with_dynamic_batch(ckpt, capsys):
    import onnx

    assert export.main(export_cfg(weights=str(ckpt), format="onnx")) == 0
    out = ckpt.with_name("best_model.onnx")
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # a named, dynamic batch axis
    text = capsys.readouterr().out
    assert ("onnxruntime" in text) or ("ONNX checker passed + TorchScript trace comparison" in text)
    diff = float(text.split("largest |difference| from PyTorch ")[1].split()[0])
    assert diff < 1e-3


@pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))
def test_export_onnx_describes_itself_for_predict(ckpt):
    from dlenv.files import onnxmodel

    assert export.main(export_cfg(weights=str(ckpt), format="onnx")) == 0
    opened = onnxmodel.open_file(ckpt.with_name("best_model.onnx"), None)
    assert opened.class_names == tuple(CLASSES) and opened.named and opened.img_size == IMG


@pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_an_export_that_disagrees_is_one_line_and_not_written(fmt, ckpt, monkeypatch, capsys):
    out = ckpt.with_name("model.out")
    out.write_bytes(b"the previous export")
    real = export.run_exported

    def off_by_one(path, fmt, inputs, device):
        got, how = real(path, fmt, inputs, device)
        return got + 1.0, how  # as if the exporter had mistranslated an op

    monkeypatch.setattr(export, "run_exported", off_by_one)
    code = cli_main(["export", "--weights", str(ckpt), "--format", fmt, "--workers", "0", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "disagrees with PyTorch" in err and "largest |difference| 1 > tolerance" in err and "not written" in err
    assert out.read_bytes() == b"the previous export"  # left as it was
    assert sorted(p.name for p in out.parent.iterdir()) == ["best_model.pth", "model.out"]  # no temporary file


@pytest.mark.skipif(NO_ONNX is not None, reason=str(NO_ONNX))
def test_onnx_agrees_with_pytorch_under_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = calibrated(TinyNet())
    path = tmp_path / "tiny.onnx"
    compat.onnx_export(model, torch.randn(1, 3, IMG, IMG), path, opset=17)
    x = torch.randn(6, 3, IMG, IMG)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        assert torch.allclose(torch.from_numpy(got), model(x), atol=1e-4)


def test_export_without_data_falls_back_to_random_input_and_says_so(tmp_path, capsys):
    path = save_ckpt(tmp_path / "m.pth", tmp_path / "gone")  # trained on data that is not here
    assert export.main(export_cfg(weights=str(path), format="torchscript")) == 0
    text = capsys.readouterr().out
    assert "checking on random input instead" in text and "random inputs (no data found)" in text
    # an explicit --data that is missing stays an error
    with pytest.raises(UserError, match="--data"):
        export.main(export_cfg(weights=str(path), format="torchscript", data=str(tmp_path / "nope")))


@pytest.mark.skipif(NO_QUANT is not None, reason=str(NO_QUANT))
@pytest.mark.parametrize("mode", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])  # static: 5 s
def test_export_quantized_torchscript_reports_before_after(mode, ckpt, capsys):
    assert export.main(export_cfg(weights=str(ckpt), format="torchscript", quantize=mode, calib_batches=2)) == 0
    out = ckpt.with_name(f"best_model_int8_{mode}.torchscript.pt")
    text = capsys.readouterr().out
    for needle in ("float32", f"int8 {mode}", "top-1 (%)", "TorchScript size", "CPU latency", str(out)):
        assert needle in text
    x = torch.randn(3, 3, IMG, IMG)
    model, _, _ = model_from_state(load_state(ckpt))
    with torch.no_grad():
        ref = model.eval()(x)
        got = _loaded_outputs(out, x)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 0.25 * ref.abs().max() + 1e-3
    buf = io.BytesIO()
    compat.jit_save(compat.jit_trace(model, x[:1]), buf)
    assert out.stat().st_size < buf.tell()  # int8 weights make the file smaller


def test_export_option_combinations_are_user_errors(ckpt):
    with pytest.raises(UserError, match="--half and --quantize"):
        export.main(export_cfg(weights=str(ckpt), half=True, quantize="dynamic"))
    with pytest.raises(UserError, match="with --format onnx is not supported: onnxruntime's dynamic int8 makes "
                                        "ConvInteger"):
        export.main(export_cfg(weights=str(ckpt), format="onnx", quantize="dynamic"))
    if not NO_ONNX:
        with pytest.raises(UserError, match=r"--opset 999: PyTorch \S+ exports ONNX opsets up to \d+; pass"):
            export.main(export_cfg(weights=str(ckpt), format="onnx", opset=999))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_half_without_cuda_is_user_error(ckpt):
    with pytest.raises(UserError, match="--half needs a CUDA GPU"):
        export.main(export_cfg(weights=str(ckpt), half=True, format="torchscript"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_half_export_on_gpu_matches(fmt, ckpt, capsys):
    if fmt == "onnx" and NO_ONNX:
        pytest.skip(NO_ONNX)
    assert export.main(export_cfg(weights=str(ckpt), format=fmt, half=True)) == 0
    suffix = ".onnx" if fmt == "onnx" else ".torchscript.pt"
    assert ckpt.with_name(f"best_model_fp16{suffix}").is_file()
    text = capsys.readouterr().out
    assert "fp16" in text and "largest |difference| from PyTorch" in text


def test_int8_engine_is_fbgemm_on_1_13_and_x86_on_2x():
    # 1.13's x86 (oneDNN) engine failed on real batches of a trained, calibrated ResNet-18
    # ("could not create a primitive descriptor for a reorder primitive"); fbgemm does not.
    from dlenv import compat

    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines or "x86" not in engines:
        pytest.skip(f"this build's int8 engines: {engines}")
    assert compat.quant_backend() == ("x86" if compat.TORCH_VERSION >= (2, 0) else "fbgemm")


@pytest.mark.parametrize("seconds,median,p10,p90,wide", [
    ([0.010] * 9 + [0.011], 10.0, 10.0, 10.0, False),              # steady
    ([0.010, 0.011, 0.010, 0.030, 0.010, 0.031, 0.010, 0.012, 0.010, 0.032], 10.5, 10.0, 31.0, True),  # busy
])
def test_latency_median_spread_and_warning(seconds, median, p10, p90, wide):
    lat = common.Latency.of(seconds)
    assert (lat.median, lat.p10, lat.p90, lat.runs) == pytest.approx((median, p10, p90, len(seconds)))
    assert str(lat) == f"{median:.2f} ms ({p10:.2f}-{p90:.2f})"
    note = common.latency_note([common.Latency.of([0.01] * 5), lat], 64)
    assert "median of 5+ runs at 64px" in note and "p10-p90" in note
    assert ("warning: CPU latency varied widely" in note) is wide


@pytest.mark.gpu
def test_gpu_latencies_time_each_model_on_the_gpu():
    lat = common.gpu_latencies([TinyNet(), TinyNet()], IMG, runs=5)
    assert len(lat) == 2 and all(x.runs == 5 and 0 < x.p10 <= x.median <= x.p90 for x in lat)


def test_cpu_latencies_time_the_models_in_turns():
    order = []

    class M(torch.nn.Module):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def forward(self, x):
            order.append(self.tag)
            return x

    lat = common.cpu_latencies([M("a"), M("b")], 8, min_runs=3, budget_s=0.0)
    assert order == ["a"] * 3 + ["b"] * 3 + ["a", "b"] * 3  # warm-up, then turn about
    assert [x.runs for x in lat] == [3, 3]
