"""dlenv.data.folder: layout detection and the dataset report."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from imagedata import make_image_folder
from PIL import Image

from dlenv import cli
from dlenv.data import folder
from dlenv.data.folder import dataset_report, find_layout, format_report
from dlenv.errors import UserError


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _encoded(fmt: str, size=(20, 16), seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- layout

def test_train_val_folders(image_folder):
    lay = find_layout(image_folder)
    assert lay.split == "folders"
    assert lay.classes == ["cat", "dog"]
    assert len(lay.train) == 12 and len(lay.val) == 6 and lay.test == []
    assert all("/train/" in p for p, _ in lay.train) and all("/val/" in p for p, _ in lay.val)
    # labels follow the sorted class names
    assert {Path(p).parent.name for p, y in lay.train if y == 1} == {"dog"}


@pytest.mark.parametrize("val_name", ["valid", "validation", "VAL"])
def test_val_folder_aliases_and_test_kept_apart(tmp_path, val_name):
    make_image_folder(tmp_path / "Train", per_class=3)
    make_image_folder(tmp_path / val_name, per_class=2)
    make_image_folder(tmp_path / "test", classes=("dog",), per_class=2)
    lay = find_layout(tmp_path)
    assert (len(lay.train), len(lay.val), len(lay.test)) == (6, 4, 2)
    assert all(y == 1 for _, y in lay.test)  # test labels use train's class index


def test_class_folders_only_split_without_copying(tmp_path):
    make_image_folder(tmp_path, classes=("b", "a", "c"), per_class=10)
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    lay = find_layout(tmp_path, val_split=0.2, seed=3)
    assert lay.split == "val_split" and lay.classes == ["a", "b", "c"]
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before
    for label in range(3):
        assert sum(y == label for _, y in lay.val) == 2
        assert sum(y == label for _, y in lay.train) == 8
    train, val = {p for p, _ in lay.train}, {p for p, _ in lay.val}
    assert not train & val and len(train | val) == 30
    # seeded: the same seed gives the same split, another seed another one
    assert find_layout(tmp_path, 0.2, seed=3).val == lay.val
    assert find_layout(tmp_path, 0.2, seed=4).val != lay.val


def test_split_of_a_class_is_stable_when_another_class_grows(tmp_path):
    make_image_folder(tmp_path, classes=("a", "b"), per_class=10)
    val_a = [p for p, y in find_layout(tmp_path).val if y == 0]
    make_image_folder(tmp_path / "extra", classes=("b",), per_class=5, seed=9)
    shutil.move(str(tmp_path / "extra" / "b"), str(tmp_path / "b" / "more"))
    shutil.rmtree(tmp_path / "extra")
    assert [p for p, y in find_layout(tmp_path).val if y == 0] == val_a


def test_extensions_case_insensitive_junk_ignored(tmp_path):
    make_image_folder(tmp_path, classes=("a", "b"), per_class=2, ext=".PNG")
    _write(tmp_path / "a" / "x.JPeG", _encoded("JPEG"))
    _write(tmp_path / "a" / "._x.jpg", b"apple double")
    _write(tmp_path / "a" / ".DS_Store", b"junk")
    _write(tmp_path / "__MACOSX" / "a" / "y.jpg", b"junk")
    _write(tmp_path / "b" / "notes.txt", b"hello")
    lay, other = folder._scan(tmp_path, 0.0, 0)
    assert lay.classes == ["a", "b"]
    assert len(lay.train) == 5 and lay.val == []
    assert [Path(o).name for o in other] == ["notes.txt"]


def test_val_classes_differ_names_them(tmp_path):
    make_image_folder(tmp_path / "train", classes=("cat", "dog"), per_class=2)
    make_image_folder(tmp_path / "val", classes=("cat", "fox"), per_class=2)
    with pytest.raises(UserError) as e:
        find_layout(tmp_path)
    msg = str(e.value)
    assert "fox" in msg and "dog" in msg and "\n" not in msg


@pytest.mark.parametrize("case", ["missing", "file", "empty", "loose", "one_class", "val_only"])
def test_bad_layouts_say_what_is_expected(tmp_path, case):
    root = tmp_path / "ds"
    if case == "file":
        _write(root, b"x")
    elif case == "empty":
        (root / "a").mkdir(parents=True)
    elif case == "loose":
        _write(root / "x.png", _encoded("PNG"))
    elif case == "one_class":
        make_image_folder(root, classes=("only",), per_class=2)
    elif case == "val_only":
        make_image_folder(root / "val", per_class=2)
    with pytest.raises(UserError) as e:
        find_layout(root)
    msg = str(e.value)
    assert str(root) in msg and "\n" not in msg
    if case != "one_class":
        assert "train/<class>/<image>" in msg


# --------------------------------------------------------------------------------------------- report

@pytest.fixture
def messy(tmp_path):
    """A train/val dataset with one of each problem the report must find."""
    root = tmp_path / "ds"
    make_image_folder(root / "train", classes=("a", "b"), per_class=6)
    make_image_folder(root / "train", classes=("c",), per_class=2, size=(40, 30))
    make_image_folder(root / "val", classes=("a", "b", "c"), per_class=2, seed=5)
    jpg = _encoded("JPEG", seed=7)
    _write(root / "train" / "a" / "zero.jpg", b"")
    _write(root / "train" / "a" / "cut.jpg", jpg[: len(jpg) // 2])
    _write(root / "train" / "b" / "text.png", b"this is not a png at all")
    # the same bytes in train and val under different names: a leak
    shutil.copy(root / "train" / "b" / "b_0.png", root / "val" / "b" / "copy_of_b0.png")
    return root


def test_report_counts_imbalance_sizes(messy):
    r = dataset_report(messy)
    assert r["classes"] == ["a", "b", "c"] and r["split"] == "folders"
    assert r["counts"]["train"] == {"a": 8, "b": 7, "c": 2}
    assert r["counts"]["val"] == {"a": 2, "b": 3, "c": 2}
    assert r["totals"] == {"train": 17, "val": 7}
    assert r["imbalance"] == {"ratio": 4.0, "largest": "a", "smallest": "c"}
    sz = r["image_sizes"]
    assert sz["sampled"] == 21  # 24 files minus the 3 unreadable ones
    assert (sz["width"]["min"], sz["width"]["max"]) == (24, 40)
    assert sz["common"][0] == ["24x20", 19]
    json.dumps(r)  # JSON-able


def test_report_finds_unreadable_without_decoding_everything(messy):
    bad = {Path(b["path"]).name: b["reason"] for b in dataset_report(messy)["unreadable"]}
    assert set(bad) == {"zero.jpg", "cut.jpg", "text.png"}
    assert bad["zero.jpg"] == "zero-byte file"
    assert bad["cut.jpg"].startswith("truncated")
    assert bad["text.png"] == "not an image"


def test_check_images_decodes_every_image_in_parallel(messy):
    # A PNG whose end marker is intact but whose pixel data is corrupt: only a full decode finds it.
    png = bytearray(_encoded("PNG", size=(64, 64), seed=3))
    idat = png.index(b"IDAT")
    png[idat + 20: idat + 60] = b"\x00" * 40
    _write(messy / "val" / "c" / "corrupt.png", bytes(png))
    for i in range(70):  # enough files to use the process pool
        shutil.copy(messy / "val" / "a" / "a_0.png", messy / "val" / "a" / f"dup{i}.png")
    quick = {Path(b["path"]).name for b in dataset_report(messy)["unreadable"]}
    assert "corrupt.png" not in quick
    full = dataset_report(messy, check_images=True, workers=2)
    names = {Path(b["path"]).name for b in full["unreadable"]}
    assert names == {"zero.jpg", "cut.jpg", "text.png", "corrupt.png"}
    assert full["checked_images"] is True


def test_duplicates_between_train_and_val(messy):
    dups = dataset_report(messy)["duplicates"]
    assert len(dups) == 1
    assert [Path(p).name for p in dups[0]["train"]] == ["b_0.png"]
    assert [Path(p).name for p in dups[0]["val"]] == ["copy_of_b0.png"]


def test_duplicates_need_equal_content_not_just_size(tmp_path):
    make_image_folder(tmp_path / "train", per_class=2)
    make_image_folder(tmp_path / "val", per_class=2, seed=1)  # same sizes, other pixels
    # Same length, same first 64 KiB, different tail: must not count as a duplicate.
    _write(tmp_path / "train" / "cat" / "big.bmp", b"BM" + b"\x00" * 70000 + b"A")
    _write(tmp_path / "val" / "cat" / "big.bmp", b"BM" + b"\x00" * 70000 + b"B")
    assert dataset_report(tmp_path)["duplicates"] == []


def test_format_report_shows_everything(messy):
    text = format_report(dataset_report(messy))
    assert "classes   3" in text and "train 17" in text and "val 7" in text
    assert "imbalance 4x" in text
    assert "zero.jpg: zero-byte file" in text
    assert "copy_of_b0.png" in text and "leaks     1" in text


def test_cli_data_report_text_and_json(messy, capsys):
    assert cli.main(["data-report", str(messy), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["totals"]["train"] == 17
    assert cli.main(["data-report", str(messy)]) == 0
    assert "unreadable 3" in capsys.readouterr().out


def test_cli_data_report_bad_dir_is_one_line(tmp_path, capsys):
    assert cli.main(["data-report", str(tmp_path / "nope")]) != 0
    err = capsys.readouterr().err.strip()
    assert "nope" in err and "\n" not in err
