"""dlenv.data.folder: layout detection."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from imagedata import encoded_image, make_image_folder, write_file

from dlenv.data import folder
from dlenv.data.folder import find_layout
from dlenv.errors import UserError

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
    write_file(tmp_path / "a" / "x.JPeG", encoded_image("JPEG"))
    write_file(tmp_path / "a" / "._x.jpg", b"apple double")
    write_file(tmp_path / "a" / ".DS_Store", b"junk")
    write_file(tmp_path / "__MACOSX" / "a" / "y.jpg", b"junk")
    write_file(tmp_path / "b" / "notes.txt", b"hello")
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
        write_file(root, b"x")
    elif case == "empty":
        (root / "a").mkdir(parents=True)
    elif case == "loose":
        write_file(root / "x.png", encoded_image("PNG"))
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


# A dataset of one class: the line must never point at a folder that does not exist (issue 25 item 7:
# with train/ and val/ it suggested root/<class>, which is root/train/<class>), and names the inner
# class folders of a wrapper.
ONE_CLASS = [
    # (id, folders of images under root, the --data the line suggests or None)
    ("flat", ["only"], None),
    ("train-val", ["train/only", "val/only"], None),
    ("train-only", ["train/only"], None),
    ("wrapper", ["images/cat", "images/dog"], "images"),
    ("wrapper-of-three", ["images/cat", "images/dog", "images/fox"], "images"),
    ("train-val-wrapper", ["train/all/cat", "train/all/dog", "val/all/cat", "val/all/dog"], "train/all"),
    ("train-wrapper", ["train/all/cat", "train/all/dog"], "train/all"),
    ("wrapper-with-one-inner", ["images/cat"], None),
    ("escape-in-name", ["\x1b[2Jonly"], None),
]


@pytest.mark.parametrize(("folders", "suggested"), [c[1:] for c in ONE_CLASS], ids=[c[0] for c in ONE_CLASS])
def test_one_class_names_only_folders_that_exist(tmp_path, folders, suggested):
    import re

    root = tmp_path / "ds"
    for f in folders:
        make_image_folder(root / Path(f).parent, classes=(Path(f).name,), per_class=2)
    with pytest.raises(UserError) as e:
        find_layout(root)
    msg = str(e.value)
    assert "one class" in msg and "\n" not in msg and "\x1b" not in msg
    m = re.search(r"--data (\S+)$", msg)
    if suggested is None:
        assert m is None, msg
        assert "add a folder of images per class" in msg
    else:
        assert m is not None and Path(m.group(1)) == root / suggested, msg
        assert Path(m.group(1)).is_dir()
        assert find_layout(m.group(1)).classes  # and the suggestion is a dataset
    for word in msg.split():  # every path it names exists
        if str(tmp_path) in word:
            assert Path(word.strip("(),;:.").rstrip("/")).exists(), (word, msg)


# ------------------------------------------------------------------------ one class name, two Unicode forms

NFC, NFD = "caf\u00e9", "cafe\u0301"
HAN_NFC, HAN_NFD = "\ud55c", "\u1112\u1161\u11ab"  # the Hangul syllable 'han', composed and as three jamo

SPELLINGS = [  # (train/ names, val/ names, test/ names): the same classes, spelled either way
    ((NFC, "tea"), (NFD, "tea"), ()),
    ((NFD, "tea"), (NFC, "tea"), ()),
    ((NFC, "tea"), (NFC, "tea"), (NFD,)),
    ((HAN_NFD, "tea"), (HAN_NFC, "tea"), (HAN_NFC,)),
]


@pytest.mark.parametrize(("train", "val", "test"), SPELLINGS, ids=["nfc-nfd", "nfd-nfc", "test-nfd", "hangul"])
def test_a_class_spelled_nfc_in_one_split_and_nfd_in_another_is_one_class(tmp_path, train, val, test):
    make_image_folder(tmp_path / "train", classes=train, per_class=2)
    make_image_folder(tmp_path / "val", classes=val, per_class=2, seed=1)
    if test:
        make_image_folder(tmp_path / "test", classes=test, per_class=1, seed=2)
    lay = find_layout(tmp_path)
    assert lay.classes == sorted(train)  # spelled as train/ spells them; the order as before
    first = lay.classes.index(train[0])
    assert sorted(y for _, y in lay.val) == sorted([first, first, 1 - first, 1 - first])
    assert all(y == first for _, y in lay.test) and len(lay.test) == len(test)
    assert {folder.class_key(Path(p).parent.name) for p, _ in lay.val} == {folder.class_key(c) for c in val}


TWINS = [  # (where the two folders are, their names): refused in one line naming both
    ("", (NFC, NFD)),
    ("train", (NFC, NFD)),
    ("val", (NFD, NFC)),
    ("", (HAN_NFC, HAN_NFD)),
]


@pytest.mark.parametrize(("where", "names"), TWINS, ids=["flat", "train", "val", "hangul"])
def test_two_folders_of_one_name_in_two_forms_are_refused_naming_both(tmp_path, where, names):
    if where == "val":
        make_image_folder(tmp_path / "train", classes=(NFC, "tea"), per_class=2)
        make_image_folder(tmp_path / "val", classes=(*names, "tea"), per_class=1)
    else:
        make_image_folder(tmp_path / where, classes=(*names, "tea"), per_class=2)
    with pytest.raises(UserError) as e:
        find_layout(tmp_path)
    line = str(e.value)
    assert "\n" not in line and "two Unicode forms" in line
    assert ascii(names[0]) in line and ascii(names[1]) in line


@pytest.mark.parametrize(("a", "b", "same"), [
    (NFC, NFD, True), (HAN_NFC, HAN_NFD, True), ("cat", "cat", True), ("Cat", "cat", False), (NFC, "cafe", False),
])
def test_class_key_is_the_nfc_form(a, b, same):
    assert (folder.class_key(a) == folder.class_key(b)) is same
