"""dlenv.data.report: the dataset report (counts, sizes, unreadable files, leaks, hostile names) and
`dlenv data-report`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from imagedata import encoded_image, make_image_folder, write_file

from dlenv import cli
from dlenv.data.folder import find_layout
from dlenv.data.report import dataset_report, format_report

# --------------------------------------------------------------------------------------------- report

@pytest.fixture
def messy(tmp_path):
    """A train/val dataset with one of each problem the report must find."""
    root = tmp_path / "ds"
    make_image_folder(root / "train", classes=("a", "b"), per_class=6)
    make_image_folder(root / "train", classes=("c",), per_class=2, size=(40, 30))
    make_image_folder(root / "val", classes=("a", "b", "c"), per_class=2, seed=5)
    jpg = encoded_image("JPEG", seed=7)
    write_file(root / "train" / "a" / "zero.jpg", b"")
    write_file(root / "train" / "a" / "cut.jpg", jpg[: len(jpg) // 2])
    write_file(root / "train" / "b" / "text.png", b"this is not a png at all")
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
    png = bytearray(encoded_image("PNG", size=(64, 64), seed=3))
    idat = png.index(b"IDAT")
    png[idat + 20: idat + 60] = b"\x00" * 40
    write_file(messy / "val" / "c" / "corrupt.png", bytes(png))
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
    write_file(tmp_path / "train" / "cat" / "big.bmp", b"BM" + b"\x00" * 70000 + b"A")
    write_file(tmp_path / "val" / "cat" / "big.bmp", b"BM" + b"\x00" * 70000 + b"B")
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


# ------------------------------------------------------------------------- hostile names and big leaks

HOSTILE = {  # file name -> how the text report must show it
    "esc\x1b[2Jclear.png": "esc\\x1b[2Jclear.png",
    "cr\rfake.png": "cr\\rfake.png",
    "nl\nfake line.png": "nl\\nfake line.png",
    "bidi\u202egnp.exe.png": "bidi\\u202egnp.exe.png",
}


@pytest.fixture
def hostile(tmp_path):
    """Class folders whose files have control characters (and one non-UTF-8 byte) in their names,
    each a byte-identical copy of one image so they also show up as a leak between train and val."""
    root = tmp_path / "ds"
    make_image_folder(root / "train", classes=("a", "b"), per_class=3)
    make_image_folder(root / "val", classes=("a", "b"), per_class=2, seed=3)
    src = root / "train" / "a" / "a_0.png"
    for name in HOSTILE:
        shutil.copy(src, root / "val" / "a" / name)
    shutil.copy(src, bytes(root / "val" / "a") + b"/raw\xff.png")
    return root


def test_control_characters_in_names_are_printed_escaped(hostile):
    text = format_report(dataset_report(hostile))
    assert not any(c in text for c in "\x1b\r\u202e") and "\udcff" not in text
    for line in text.splitlines():
        assert line.isprintable() or not line.strip(), repr(line)
    leak = next(ln for ln in text.splitlines() if "a_0.png" in ln and "=" in ln)
    assert any(shown in leak for shown in HOSTILE.values()) or "more with the same content" in leak


def test_every_hostile_name_shows_escaped_in_the_unreadable_list(tmp_path):
    root = tmp_path / "ds"
    make_image_folder(root, classes=("a", "b"), per_class=3)
    for name in HOSTILE:
        (root / "a" / name).write_bytes(b"")  # zero bytes: each is listed as unreadable
    text = format_report(dataset_report(root))
    for shown in HOSTILE.values():
        assert f"{shown}: zero-byte file" in text


def test_json_report_prints_safely_and_reads_back_exactly(hostile, capsys):
    assert cli.main(["data-report", str(hostile), "--json"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\r\u202e")
    paths = [p for d in json.loads(out)["duplicates"] for s in d.values() for p in s]
    assert any(p.endswith("esc\x1b[2Jclear.png") for p in paths)  # the name itself, not mangled


@pytest.mark.parametrize(("names", "how"), [
    (("Cat", "cat"), "only by case"),
    (("CAF\u00c9", "cafe\u0301"), "only by case and Unicode normalisation"),
])
def test_look_alike_class_names_are_warned(tmp_path, names, how, caplog):
    root = make_image_folder(tmp_path / "ds", classes=names, per_class=2)
    report = dataset_report(root)
    assert len(report["classes"]) == 2  # still two classes: a warning, not a guess
    assert len(report["class_warnings"]) == 1 and how in report["class_warnings"][0]
    assert "warning   classes" in format_report(report)
    with caplog.at_level("WARNING"):
        find_layout(root)
    assert how in caplog.text  # train and val say it too


def test_distinct_class_names_give_no_warning(tmp_path):
    assert dataset_report(make_image_folder(tmp_path / "ds", classes=("cat", "dog")))["class_warnings"] == []


def test_a_huge_leak_is_listed_in_bounded_lines(tmp_path):
    root = tmp_path / "ds"
    make_image_folder(root / "train", classes=("a", "b"), per_class=2)
    make_image_folder(root / "val", classes=("a", "b"), per_class=2, seed=9)
    src = root / "train" / "a" / "a_0.png"
    for i in range(400):  # 400 copies of one image in val: one group of 401 identical files
        shutil.copy(src, root / "val" / "b" / f"copy_{i:04d}_{'x' * 40}.png")
    report = dataset_report(root)
    assert sum(len(v) for v in report["duplicates"][0].values()) == 401  # --json keeps them all
    text = format_report(report)
    assert max(len(line) for line in text.splitlines()) < 600
    assert "(+398 more with the same content)" in text



def test_format_report_says_balanced(tmp_path):
    make_image_folder(tmp_path / "train", per_class=4)  # equal classes: no "largest arrow, smallest arrow"
    text = format_report(dataset_report(tmp_path))
    assert "balanced  every class has the same number" in text and "imbalance" not in text


def test_the_report_warns_where_flips_are_doubtful_and_names_the_flag_elsewhere(tmp_path):
    from dlenv.data.report import dataset_report, flip_hint, format_report

    digits = make_image_folder(tmp_path / "digits", classes=tuple("0123456789"), per_class=1)
    text = format_report(dataset_report(digits))
    assert "warning   the classes look like characters (0, 1, 2, 3, 4, 5, ...)" in text and "--no-hflip" in text
    photos = format_report(dataset_report(make_image_folder(tmp_path / "photos")))
    assert "the classes look like characters" not in photos and "--no-hflip" in photos
    assert flip_hint(["b", "d", "cat"]).startswith("warning")  # most names are one character
