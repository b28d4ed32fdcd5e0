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


# --------------------------------------------------------------------------------------------- bounded walk
# issue 52 item 5: `data/root -> /` walked the whole file system. The walk stays inside the data folder, never
# enters the kernel's file systems and counts its entries against folder.MAX_ENTRIES.

#: (id, how the dataset root is made from tmp_path, what the one line says)
ROOTS_NOT_A_DATASET = [
    ("root-is-slash", lambda t: _link(t / "root", "/"), "the whole file system"),
    ("root-through-two-links", lambda t: _link(t / "root", str(_link(t / "hop", "/"))), "the whole file system"),
    ("root-dot-dots", lambda t: t / ("../" * 40), "the whole file system"),
    ("root-is-proc", lambda t: _link(t / "root", "/proc"), "a folder of the kernel"),
    ("root-is-proc-self", lambda t: _link(t / "root", "/proc/self"), "a folder of the kernel"),
    ("root-is-sys", lambda t: _link(t / "root", "/sys"), "a folder of the kernel"),
    ("root-is-dev", lambda t: _link(t / "root", "/dev"), "a folder of the kernel"),
]


def _link(p: Path, target: str) -> Path:
    p.symlink_to(target)
    return p


@pytest.mark.parametrize(("make", "said"), [c[1:] for c in ROOTS_NOT_A_DATASET],
                         ids=[c[0] for c in ROOTS_NOT_A_DATASET])
def test_a_root_that_leads_to_the_system_is_one_line(tmp_path, make, said):
    root = make(tmp_path)
    if not root.exists():
        pytest.skip(f"{root} not on this machine")
    with pytest.raises(UserError) as e:
        find_layout(root)
    assert said in str(e.value) and "pass the folder that holds the class folders" in str(e.value)
    assert "\n" not in str(e.value)


def _outside(tmp_path: Path) -> Path:
    make_image_folder(tmp_path / "elsewhere", classes=("fox",), per_class=2)
    return tmp_path / "elsewhere" / "fox"


#: (id, what is added to ds (cat/ and dog/ of 3 images each) -> links left out, classes found)
LINKS = [
    ("class-link-outside", lambda t, ds: _link(ds / "fox", str(_outside(t))), 1, ["cat", "dog"]),
    ("class-link-to-slash", lambda t, ds: _link(ds / "fox", "/"), 1, ["cat", "dog"]),
    ("class-link-to-home", lambda t, ds: _link(ds / "fox", str(Path.home())), 1, ["cat", "dog"]),
    ("class-link-to-proc", lambda t, ds: _link(ds / "fox", "/proc"), 0, ["cat", "dog"]),
    ("class-link-by-dotdot", lambda t, ds: _link(ds / "fox", "../elsewhere/fox") and _outside(t), 1, ["cat", "dog"]),
    ("class-link-inside", lambda t, ds: _link(ds / "kitten", "cat"), 0, ["cat", "dog", "kitten"]),
    ("class-link-to-root", lambda t, ds: _link(ds / "all", "."), 0, ["all", "cat", "dog"]),
    ("loop-of-two", lambda t, ds: _link(ds / "a", "b") and _link(ds / "b", "a"), 0, ["cat", "dog"]),
    ("loop-to-self", lambda t, ds: _link(ds / "me", "me"), 0, ["cat", "dog"]),
    ("link-to-parent-below-class", lambda t, ds: _link(ds / "cat" / "up", ".."), 0, ["cat", "dog"]),
    ("link-to-slash-below-class", lambda t, ds: _link(ds / "cat" / "all", "/"), 0, ["cat", "dog"]),
    ("image-named-link-to-proc", lambda t, ds: _link(ds / "cat" / "x.jpg", "/proc/self/environ"), 0, ["cat", "dog"]),
]


@pytest.mark.parametrize(("add", "left_out", "classes"), [c[1:] for c in LINKS], ids=[c[0] for c in LINKS])
def test_links_are_followed_only_inside_the_data_folder(tmp_path, caplog, add, left_out, classes):
    ds = tmp_path / "ds"
    make_image_folder(ds, classes=("cat", "dog"), per_class=3)
    add(tmp_path, ds)
    lay = find_layout(ds, val_split=0.0)
    assert lay.classes == classes and len(lay.outside) == left_out
    assert all(str(ds) in p and "/proc/" not in p for p, _ in lay.train)
    assert len([p for p, y in lay.train if lay.classes[y] == "cat"]) == 3  # nothing followed below a class
    warned = [r.getMessage() for r in caplog.records if "outside the dataset" in r.getMessage()]
    assert len(warned) == (1 if left_out else 0)
    if left_out:
        assert "links are followed only inside the data folder" in warned[0] and "\n" not in warned[0]


def test_a_root_that_is_a_link_is_followed(tmp_path):
    make_image_folder(tmp_path / "real", classes=("cat", "dog"), per_class=2)
    lay = find_layout(_link(tmp_path / "data", str(tmp_path / "real")), val_split=0.0)
    assert lay.classes == ["cat", "dog"] and lay.outside == []


@pytest.mark.parametrize(("budget", "ok"), [(10, False), (20, False), (40, True), (1000, True)])
def test_the_walk_counts_its_entries_against_a_budget(tmp_path, monkeypatch, budget, ok):
    make_image_folder(tmp_path / "ds", classes=("cat", "dog"), per_class=14)  # 2 folders (listed twice) + 28 images
    monkeypatch.setattr(folder, "MAX_ENTRIES", budget)
    if ok:
        assert len(find_layout(tmp_path / "ds", val_split=0.0).train) == 28
        return
    with pytest.raises(UserError) as e:
        find_layout(tmp_path / "ds")
    assert f"more than {budget:,} files and folders" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["/usr", "/usr/lib"])
def test_a_system_folder_as_dataset_ends_at_the_budget(tmp_path, monkeypatch, where):
    """data/root -> /usr: a tree of its own, not the file system's root; the budget ends its walk in one line."""
    monkeypatch.setattr(folder, "MAX_ENTRIES", 2000)
    with pytest.raises(UserError) as e:
        find_layout(_link(tmp_path / "root", where))
    assert f"more than 2,000 files and folders where class folders are looked for (it leads to {where})" in str(e.value)
    assert "\n" not in str(e.value)
