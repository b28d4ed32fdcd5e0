"""dlenv.evaluate: metrics on hand-made cases, `dlenv val` end to end, unsafe and foreign checkpoints."""

from __future__ import annotations

import csv
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from imagedata import make_image_folder

from dlenv import evaluate
from dlenv.cli import main as cli_main
from dlenv.errors import UserError, printable
from dlenv.files.runstate import FORMAT, save_state

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "fox"]

# ---------------------------------------------------------------------------------------------------
# compute_metrics and error_rows on hand-made logits.

# 7 samples of 3 classes (supports 2, 3, 2). Predictions: a a | b b b b | a c  ->  confusion matrix
#   true cat: [1 1 0]    true dog: [0 3 0]    true fox: [1 0 1]
TARGETS = [0, 0, 1, 1, 1, 2, 2]
PREDS = [0, 1, 1, 1, 1, 0, 2]


def _hand_logits(preds, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(len(preds), c, generator=g)  # in [0, 1): the +2 below always wins
    for i, p in enumerate(preds):
        logits[i, p] += 2.0
    return logits


def _ce(logits, targets):
    """Mean cross-entropy written out with math, independent of torch's implementation."""
    total = 0.0
    for row, t in zip(logits.tolist(), targets, strict=False):
        m = max(row)
        total += m + math.log(sum(math.exp(v - m) for v in row)) - row[t]
    return total / len(targets)


def test_compute_metrics_hand_case():
    logits = _hand_logits(PREDS)
    m = evaluate.compute_metrics(logits, torch.tensor(TARGETS), CLASSES)
    assert m["confusion_matrix"] == [[1, 1, 0], [0, 3, 0], [1, 0, 1]]
    assert m["num_samples"] == 7 and m["num_classes"] == 3
    assert m["top1"] == pytest.approx(500 / 7)
    assert m["top5_k"] == 3 and m["top5"] == pytest.approx(100.0)  # 3 classes: top-3 always hits
    assert m["loss"] == pytest.approx(_ce(logits, TARGETS), rel=1e-5)
    expected = {  # class: (precision, recall, f1, support), worked out from the matrix above
        "cat": (1 / 2, 1 / 2, 1 / 2, 2),
        "dog": (3 / 4, 1.0, 6 / 7, 3),
        "fox": (1.0, 1 / 2, 2 / 3, 2),
    }
    for row in m["per_class"]:
        p, r, f, s = expected[row["class"]]
        assert (row["precision"], row["recall"], row["f1"]) == pytest.approx((p, r, f))
        assert row["support"] == s
    assert m["macro_avg"]["precision"] == pytest.approx(0.75)
    assert m["macro_avg"]["recall"] == pytest.approx(2 / 3)
    assert m["macro_avg"]["f1"] == pytest.approx((1 / 2 + 6 / 7 + 2 / 3) / 3)
    assert m["weighted_avg"]["recall"] == pytest.approx(5 / 7)
    assert m["weighted_avg"]["f1"] == pytest.approx((2 * 1 / 2 + 3 * 6 / 7 + 2 * 2 / 3) / 7)
    json.dumps(m)  # plain types only


def test_top5_misses_when_the_true_class_ranks_sixth():
    logits = torch.tensor([[6.0, 5, 4, 3, 2, 1], [6.0, 5, 4, 3, 2, 1], [1.0, 2, 3, 4, 5, 6]])
    m = evaluate.compute_metrics(logits, torch.tensor([5, 4, 5]), list("abcdef"))
    assert m["top5_k"] == 5
    assert m["top1"] == pytest.approx(100 / 3)  # only the last row's argmax is right
    assert m["top5"] == pytest.approx(200 / 3)  # row 0's class 5 ranks sixth


def test_class_never_predicted_has_zero_precision_not_nan():
    m = evaluate.compute_metrics(_hand_logits([0, 0, 0]), torch.tensor([0, 1, 2]), CLASSES)
    assert [r["precision"] for r in m["per_class"]] == pytest.approx([1 / 3, 0.0, 0.0])
    assert [r["f1"] for r in m["per_class"]] == pytest.approx([0.5, 0.0, 0.0])


def test_compute_metrics_rejects_mismatched_names_and_empty_input():
    with pytest.raises(ValueError, match="3 columns"):
        evaluate.compute_metrics(_hand_logits([0, 1]), torch.tensor([0, 1]), ["a", "b"])
    with pytest.raises(ValueError, match="no samples"):
        evaluate.compute_metrics(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), CLASSES)


def test_error_rows_most_confident_first():
    logits = torch.log(torch.tensor([
        [0.9, 0.05, 0.05],  # right
        [0.2, 0.7, 0.1],    # cat called dog at 0.7
        [0.1, 0.3, 0.6],    # dog called fox at 0.6
        [0.05, 0.9, 0.05],  # fox called dog at 0.9
        [0.1, 0.1, 0.8],    # right
    ]))
    rows = evaluate.error_rows(logits, torch.tensor([0, 0, 1, 2, 2]), list("ABCDE"), CLASSES)
    assert [r["path"] for r in rows] == ["D", "B", "C"]
    assert [r["confidence"] for r in rows] == pytest.approx([0.9, 0.7, 0.6], abs=1e-6)
    assert (rows[0]["true_class"], rows[0]["predicted_class"]) == ("fox", "dog")


# ---------------------------------------------------------------------------------------------------
# predict and resolve_device.


class _Echo(torch.nn.Module):
    """Logits read straight off the image: class scores are the mean of each of its 3 channels."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


def test_predict_keeps_order_and_returns_float32_cpu():
    images = torch.zeros(5, 3, 4, 4)
    for i, c in enumerate([2, 0, 1, 1, 0]):
        images[i, c] = 1.0 + i
    loader = [(images[:2], torch.tensor([2, 0])), (images[2:], [1, 1, 2])]  # labels as a list too
    logits, targets = evaluate.predict(_Echo(), loader, "cpu")
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"
    assert logits.shape == (5, 3)
    assert logits.argmax(1).tolist() == [2, 0, 1, 1, 0]
    assert targets.tolist() == [2, 0, 1, 1, 2] and targets.dtype == torch.long
    assert not logits.requires_grad


@pytest.mark.gpu
def test_predict_on_cuda_with_amp_matches_fp32_cpu():
    from dlenv.model.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet18", 4).eval()
    images = torch.randn(6, 3, 64, 64)
    loader = [(images[:4], torch.arange(4)), (images[4:], torch.tensor([0, 1]))]
    ref, _ = evaluate.predict(model, loader, "cpu")
    for amp in (False, True):
        out, targets = evaluate.predict(model, loader, torch.device("cuda", 0), amp=amp)
        assert out.device.type == "cpu" and out.dtype == torch.float32
        assert torch.allclose(out, ref, atol=5e-2 if amp else 1e-3, rtol=5e-2 if amp else 1e-3)
        assert targets.tolist() == [0, 1, 2, 3, 0, 1]


# ---------------------------------------------------------------------------------------------------
# `dlenv val` end to end with a tiny resnet18 forced to always answer class 0.

SIZE = 32
BIAS = torch.tensor([3.0, 0.0, 1.0])  # constant logits: always "cat", with a known confidence


def _forced_model(num_classes=3):
    from dlenv.model.models import build_model

    model = build_model("resnet18", num_classes)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.copy_(BIAS[:num_classes])
    return model


def _dlenv_ckpt(path: Path, class_names=CLASSES, data=None, **config) -> Path:
    model = _forced_model(len(class_names))
    state = {"format": FORMAT, "model": model.state_dict(), "model_name": "resnet18",
             "num_classes": len(class_names), "class_names": list(class_names), "img_size": SIZE,
             "config": {"data": str(data) if data else None, "val_split": 0.2, "seed": 0, **config}, "epoch": 1}
    return save_state(state, path)


@pytest.fixture
def val_data(tmp_path):
    """dataset/train and dataset/val: cat 2, dog 3, fox 1 validation images."""
    root = tmp_path / "dataset"
    for name, n in zip(CLASSES, (2, 3, 1), strict=False):
        make_image_folder(root / "val", classes=(name,), per_class=n, size=(20, 20))
        make_image_folder(root / "train", classes=(name,), per_class=2, size=(20, 20))
    return root


def _read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_val_end_to_end_known_confusion_matrix(tmp_path, val_data, capsys):
    weights = _dlenv_ckpt(tmp_path / "runs" / "exp" / "best_model.pth")
    code = cli_main(["val", "--weights", str(weights), "--data", str(val_data / "val"), "--workers", "0",
                     "--batch-size", "4", "--device", "cpu"])
    assert code == 0
    out = tmp_path / "runs" / "exp" / "val"  # the default --out
    m = json.loads((out / "metrics.json").read_text())
    assert m["confusion_matrix"] == [[2, 0, 0], [3, 0, 0], [1, 0, 0]]
    assert m["top1"] == pytest.approx(200 / 6)
    p_cat = torch.softmax(BIAS, 0)
    expected_loss = -(2 * math.log(p_cat[0]) + 3 * math.log(p_cat[1]) + math.log(p_cat[2])) / 6
    assert m["loss"] == pytest.approx(expected_loss, rel=1e-4)

    per_class = _read_csv(out / "per_class.csv")
    assert per_class[0] == ["class", "precision", "recall", "f1", "support"]
    assert [r[0] for r in per_class[1:]] == ["cat", "dog", "fox", "macro avg", "weighted avg"]
    assert [float(x) for x in per_class[1][1:]] == pytest.approx([1 / 3, 1.0, 0.5, 2])
    assert [float(x) for x in per_class[2][1:]] == pytest.approx([0, 0, 0, 3])
    assert float(per_class[4][2]) == pytest.approx(1 / 3)  # macro recall

    cm = _read_csv(out / "confusion_matrix.csv")
    assert cm[0][1:] == CLASSES
    assert cm[1:] == [["cat", "2", "0", "0"], ["dog", "3", "0", "0"], ["fox", "1", "0", "0"]]

    errors = _read_csv(out / "errors.csv")
    assert errors[0] == ["path", "true_class", "predicted_class", "confidence"]
    # every dog and fox image is a mistake, all at the same confidence, so the data order is kept
    expected_paths = sorted(str(p) for p in (val_data / "val" / "dog").iterdir())
    expected_paths += [str(p) for p in (val_data / "val" / "fox").iterdir()]
    assert [r[0] for r in errors[1:]] == expected_paths
    assert {(r[1], r[2]) for r in errors[1:4]} == {("dog", "cat")}
    assert [float(r[3]) for r in errors[1:]] == pytest.approx([float(p_cat[0])] * 4, abs=1e-5)

    png = (out / "confusion_matrix.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not list(out.glob(".*tmp"))

    printed = capsys.readouterr().out
    assert "top-1 33.33%" in printed and "weighted avg" in printed and "fox" in printed


def test_val_defaults_to_the_checkpoints_data_and_maps_class_order(tmp_path, val_data):
    # the checkpoint lists its classes in another order than the folders sort: index 0 is "dog"
    weights = _dlenv_ckpt(tmp_path / "w" / "last.pth", class_names=["dog", "cat", "fox"], data=val_data)
    out = tmp_path / "report"
    assert cli_main(["val", "--weights", str(weights), "--workers", "0", "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["data"] == str(val_data) and m["num_samples"] == 6  # the val/ folder, not train/
    assert m["class_names"] == ["dog", "cat", "fox"]
    assert m["confusion_matrix"] == [[3, 0, 0], [2, 0, 0], [1, 0, 0]]


def test_val_classes_differ_names_them(tmp_path, val_data, capsys):
    weights = _dlenv_ckpt(tmp_path / "best_model.pth")
    other = tmp_path / "other"
    make_image_folder(other, classes=("cat", "dog", "emu"), per_class=1)
    code = cli_main(["val", "--weights", str(weights), "--data", str(other), "--workers", "0"])
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "missing" in err and "fox" in err and "emu" in err
    assert not (tmp_path / "val").exists()


@pytest.mark.gpu
def test_val_on_cuda_with_amp_matches_cpu(tmp_path, val_data):
    weights = _dlenv_ckpt(tmp_path / "best_model.pth")
    reports = {}
    for device, amp in (("cpu", []), ("cuda", ["--amp"])):
        out = tmp_path / device
        assert cli_main(["val", "--weights", str(weights), "--data", str(val_data / "val"), "--workers", "2",
                         "--device", device, "--out", str(out), *amp]) == 0
        reports[device] = json.loads((out / "metrics.json").read_text())
    assert reports["cuda"]["device"].startswith("cuda") and reports["cuda"]["amp"] is True
    assert reports["cuda"]["confusion_matrix"] == reports["cpu"]["confusion_matrix"]
    assert reports["cuda"]["loss"] == pytest.approx(reports["cpu"]["loss"], rel=2e-2)


class _Payload:
    """Unpickling this creates a marker file: the stand-in for arbitrary code in a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path, val_data, capsys):
    # Control: the same kind of file really does run its payload when loaded unsafely.
    control_marker = tmp_path / "control-ran"
    control = tmp_path / "control.pth"
    torch.save({"model": _Payload(control_marker)}, control)
    torch.load(control, weights_only=False)["model"].close()
    assert control_marker.exists(), "the test payload does not work; the test below would prove nothing"

    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.pth"
    torch.save({"model": _Payload(marker)}, evil)
    plain = tmp_path / "evil.pkl"
    plain.write_bytes(pickle.dumps(_Payload(marker)))
    for f in (evil, plain):
        code = cli_main(["val", "--weights", str(f), "--data", str(val_data / "val"), "--workers", "0"])
        err = capsys.readouterr().err.strip()
        assert code != 0
        assert len(err.splitlines()) == 1 and str(f) in err, err
        assert not marker.exists(), "the checkpoint's payload ran"
    assert not (tmp_path / "val").exists()


def test_bare_state_dict_needs_model_and_then_validates(tmp_path, val_data, capsys):
    sd = tmp_path / "from_other_tool.pth"
    torch.save(_forced_model().state_dict(), sd)
    code = cli_main(["val", "--weights", str(sd), "--data", str(val_data / "val"), "--workers", "0"])
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model" in err

    code = cli_main(["val", "--weights", str(sd), "--data", str(val_data / "val"), "--model", "resnet18",
                     "--img-size", str(SIZE), "--workers", "0"])
    assert code == 0
    m = json.loads((tmp_path / "val" / "metrics.json").read_text())
    assert m["class_names"] == CLASSES  # taken from the data's folders
    assert m["confusion_matrix"] == [[2, 0, 0], [3, 0, 0], [1, 0, 0]]
    assert m["img_size"] == SIZE


def test_val_without_weights_or_with_missing_data_is_one_line(tmp_path, capsys):
    assert cli_main(["val"]) != 0
    assert "--weights" in capsys.readouterr().err
    weights = _dlenv_ckpt(tmp_path / "best_model.pth")
    assert cli_main(["val", "--weights", str(weights), "--data", str(tmp_path / "nope")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope" in err


def test_workspace_val_script_is_dlenv_val():
    # the script is argv glue over `dlenv val` (exercised end to end above); --help proves the wiring
    # without paying a second torch start-up
    r = subprocess.run([sys.executable, str(ROOT / "workspace" / "val.py"), "--help"],
                       capture_output=True, text=True, cwd=ROOT / "workspace")
    assert r.returncode == 0, r.stderr
    assert "Validate a weights file" in r.stdout and "--weights" in r.stdout and "--model" in r.stdout


@pytest.mark.parametrize("asked,amp,trained,probe,mode,why", [
    ("auto", False, "bf16", True, "bf16", "trained with --amp (bf16)"),
    ("auto", False, "fp16", True, "bf16", "CPU autocast has no fp16"),
    ("auto", False, "amp", True, "bf16", "trained with --amp (auto)"),
    ("auto", False, "bf16", False, "fp32", "no bf16 autocast"),     # a CPU build without it: fp32, said
    ("auto", False, "fp32", True, "fp32", "fp32 as trained"),
    ("auto", False, None, True, "fp32", "does not say"),              # a bare state dict, an export
    ("auto", True, "fp32", True, "bf16", "--amp"),                    # asked for AMP though trained fp32
    ("fp32", False, "bf16", True, "fp32", "--precision fp32"),         # told otherwise
    ("bf16", False, None, True, "bf16", "--precision bf16"),
])
def test_val_precision_follows_the_checkpoint_on_cpu(monkeypatch, asked, amp, trained, probe, mode, why):
    monkeypatch.setattr(evaluate, "_cpu_bf16_autocast_works", lambda: probe)
    got, said = evaluate.val_precision(asked, amp, trained, torch.device("cpu"))
    assert got == mode and why in said


def test_val_precision_fp16_on_cpu_is_one_line_error():
    with pytest.raises(UserError, match="fp16 on the CPU"):
        evaluate.val_precision("fp16", False, None, torch.device("cpu"))


def test_val_of_an_amp_checkpoint_runs_in_its_dtype_and_shows_progress(tmp_path, val_data, capsys):
    weights = _dlenv_ckpt(tmp_path / "best_model.pth", amp=True, amp_dtype="bf16")
    out = tmp_path / "report"
    assert cli_main(["val", "--weights", str(weights), "--data", str(val_data / "val"), "--workers", "0",
                     "--batch-size", "2", "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    printed = capsys.readouterr().out
    if evaluate._cpu_bf16_autocast_works():
        assert m["precision"] == "bf16" and "bf16: trained with --amp (bf16)" in printed
    else:
        assert m["precision"] == "fp32" and "no bf16 autocast" in printed
    assert "validating 3/3 (100%)" in printed and "ETA" in printed  # not a terminal: the plain line


# ---------------------------------------------------------------------------------------------------
# Non-finite weights (issue 25 item 7): argmax of a NaN row is 0, so all-NaN weights "scored" the
# first class's share (33%) and exit 0. Now: one line naming the tensors, exit 4, no report written.


def _poison(state: dict, how: str) -> dict:
    nan, inf = float("nan"), float("inf")
    state = {k: v.clone() for k, v in state.items()}
    if how == "all-nan":
        for v in state.values():
            if v.is_floating_point():
                v.fill_(nan)
    elif how == "head-weight-nan":
        state["fc.weight"].fill_(nan)
    elif how == "head-bias-inf":
        state["fc.bias"][1] = inf
    elif how == "head-bias-minus-inf":
        state["fc.bias"][0] = -inf
    elif how == "one-conv-weight-nan":
        state["conv1.weight"].view(-1)[0] = nan
    elif how == "bn-running-var-nan":
        state["bn1.running_var"].fill_(nan)
    return state


POISONS = ["all-nan", "head-weight-nan", "head-bias-inf", "head-bias-minus-inf", "one-conv-weight-nan",
           "bn-running-var-nan"]


@pytest.mark.parametrize("how", [p if p in ("all-nan", "one-conv-weight-nan") else
                                 pytest.param(p, marks=pytest.mark.slow) for p in POISONS])
def test_val_of_non_finite_weights_is_refused_with_exit_4(tmp_path, val_data, capsys, how):
    from dlenv.errors import EXIT_NONFINITE

    weights = _dlenv_ckpt(tmp_path / "runs" / "exp" / "best_model.pth")
    from dlenv.files.runstate import load_state

    state = dict(load_state(weights))
    state["model"] = _poison(state["model"], how)
    save_state(state, weights)
    out = tmp_path / "runs" / "exp" / "val"
    out.mkdir()
    (out / "metrics.json").write_text('{"top1": 91.0}')  # an earlier report: kept as it was
    code = cli_main(["val", "--weights", str(weights), "--data", str(val_data / "val"), "--workers", "0",
                     "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == EXIT_NONFINITE, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert "NaN or inf outputs" in lines[0] and "no accuracy can be reported" in lines[0]
    assert "hold NaN or inf (e.g. " in lines[0] and "earlier run file" in lines[0]
    assert "top-1" not in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]
    assert (out / "metrics.json").read_text() == '{"top1": 91.0}'


@pytest.mark.parametrize(("rows", "mode", "weights_ok", "expect"), [
    ("all", "fp32", False, ["every one of the 4 images", "weight tensors hold NaN", "earlier run file"]),
    ("one", "fp32", False, ["1 of 4 images", "weight tensors hold NaN"]),
    ("one", "fp16", True, ["1 of 4 images", "fp16 overflowed", "--precision fp32"]),
    ("all", "bf16", True, ["every one", "bf16 overflowed"]),
    ("one", "fp32", True, ["outputs are not", "check the model"]),
], ids=["all-bad-weights", "one-bad-weights", "fp16-overflow", "bf16-all", "fp32-finite-weights"])
def test_refuse_non_finite_names_the_cause(rows, mode, weights_ok, expect):
    from dlenv.errors import EXIT_NONFINITE

    model = torch.nn.Linear(2, 3)
    if not weights_ok:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    logits = torch.zeros(4, 3)
    logits[0 if rows == "one" else slice(None), 1] = float("inf") if mode != "fp32" else float("nan")
    with pytest.raises(UserError) as e:
        evaluate.refuse_non_finite(logits, model, mode, "w.pth")
    assert e.value.exit_code == EXIT_NONFINITE and "\n" not in str(e.value)
    assert all(x in str(e.value) for x in expect), str(e.value)


def test_finite_outputs_pass():
    evaluate.refuse_non_finite(torch.randn(5, 3) * 1e30, torch.nn.Linear(2, 3), "fp32", "w.pth")
    evaluate.refuse_non_finite(torch.zeros(0, 0), torch.nn.Linear(2, 3), "fp32", "w.pth")


def test_a_report_on_other_data_gets_its_own_folder(tmp_path, capsys):
    """A second `val` with another --data no longer overwrites runs/exp/val/ silently."""

    from dlenv.evaluate import report_folder

    run = tmp_path / "exp"
    run.mkdir()
    assert report_folder(run, Path("data/demo")) == run / "val"
    (run / "val").mkdir()
    (run / "val" / "metrics.json").write_text(json.dumps({"data": "data/demo"}))
    assert report_folder(run, Path("data/demo")) == run / "val"  # the same data: its own report again
    assert capsys.readouterr().out == ""
    assert report_folder(run, Path("data/digits")) == run / "val-digits"
    assert "holds the report on other data" in capsys.readouterr().out
    (run / "val-digits").mkdir()
    (run / "val-digits" / "metrics.json").write_text(json.dumps({"data": "elsewhere/digits"}))
    assert report_folder(run, Path("data/digits")) == run / "val-digits-2"


@pytest.mark.parametrize("data,folder", [
    ("data/digits", "val-digits"),
    ("data/digits/val", "val-digits"),      # a dataset's split is named by its dataset, not val-val
    ("data/digits/Validation", "val-digits"),
    ("data/pets/test", "val-pets"),
    ("val", "val-val"),                      # a bare val folder has no dataset name above it
    ("data/my val", "val-my val"),
])
def test_a_report_on_other_data_is_named_by_its_dataset(tmp_path, capsys, data, folder):
    from dlenv.evaluate import report_folder

    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "metrics.json").write_text(json.dumps({"data": "data/demo"}))
    assert report_folder(tmp_path, Path(data)) == tmp_path / folder


def test_val_reports_go_into_the_run_folder_whatever_folder_it_runs_in(tmp_path, val_data, monkeypatch, capsys):
    """Started in another folder, `dlenv val` writes val/ and val-<data>/ beside the checkpoint, in its run
    folder; a best_model.pth linked into the folder it runs in reports into the run folder it links to."""
    run = tmp_path / "runs" / "exp"
    _dlenv_ckpt(run / "best_model.pth", data=val_data)
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "best_model.pth").symlink_to(run / "best_model.pth")
    monkeypatch.chdir(here)
    common = ["--workers", "0", "--batch-size", "4", "--device", "cpu"]
    for weights, data, folder in [(str(run / "best_model.pth"), val_data / "val", "val"),
                                  ("best_model.pth", val_data, "val-dataset")]:  # the link; other data
        assert cli_main(["val", "--weights", weights, "--data", str(data), *common]) == 0
        assert json.loads((run / folder / "metrics.json").read_text())["data"] == str(data)
    assert sorted(p.name for p in here.iterdir()) == ["best_model.pth"]  # nothing written where it ran
    assert sorted(p.name for p in run.iterdir()) == ["best_model.pth", "val", "val-dataset"]
    assert f"reports in {run / 'val-dataset'}/" in capsys.readouterr().out


_SLOW = pytest.mark.slow  # a val each, ~10 s on a loaded 2-core VM: the first case runs in every lane


@pytest.mark.parametrize("hostile", [
    pytest.param("c$\\frac$", id="frac"),
    *(pytest.param(n, id=i, marks=_SLOW) for n, i in (
        ("$$", "dollars"), ("$LR $BS", "two-dollars"), ("^_{x}", "sub-sup"), ("x" * 200, "long"),
        ("two\nlines", "newline"), ("\u202egnp.exe", "rtl"), ("\u05e9\u05dc\u05d5\u05dd $a$", "hebrew")))])
def test_val_with_math_in_a_class_name_writes_every_report(tmp_path, capsys, hostile):
    from dlenv.data.folder import find_layout

    data = tmp_path / "data"
    for name in (hostile, "dog", "fox"):
        make_image_folder(data, classes=(name,), per_class=2, size=(20, 20))
    classes = list(find_layout(data, val_split=0.0, seed=0).classes)
    assert hostile in classes
    weights = _dlenv_ckpt(tmp_path / "runs" / "exp" / "best_model.pth", class_names=classes)
    code = cli_main(["val", "--weights", str(weights), "--data", str(data), "--workers", "0", "--batch-size", "4",
                     "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out  # the per-class table: one line a class, controls shown as escapes
    assert printable(hostile) in printed and (hostile == printable(hostile) or hostile not in printed)
    out = tmp_path / "runs" / "exp" / "val"
    assert _read_csv(out / "confusion_matrix.csv")[0][1:] == classes
    assert {r[1] for r in _read_csv(out / "errors.csv")[1:]} == set(classes) - {classes[0]}
    assert (out / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
