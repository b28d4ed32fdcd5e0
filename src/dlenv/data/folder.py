"""What is in a dataset folder: its layout (`find_layout`); the report on it is `dlenv.data.report`.

Two layouts are understood, both of class folders:

    root/train/<class>/*.jpg + root/val/<class>/*.jpg   (val/ may be valid/ or validation/;
                                                         an optional test/ is kept apart)
    root/<class>/*.jpg                                  (split into train/val per class by a seeded
                                                         fraction; no file is copied or moved)

No torch here.
"""

from __future__ import annotations

import logging
import os
import random
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dlenv.errors import UserError, printable

log = logging.getLogger("dlenv.data")

#: Image file extensions we read, lowercase; matching is case-insensitive.
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})

_VAL_NAMES = ("val", "valid", "validation")
_JUNK_FILES = {"thumbs.db", "desktop.ini"}
_EXPECTED = ("expected train/<class>/<image> with val/<class>/<image>, or <class>/<image> "
             "folders only")

Sample = tuple[str, int]


@dataclass(frozen=True)
class Layout:
    """A dataset found on disk: sorted class names and (path, class index) samples per split.

    `split` is "folders" (train/ and val/ on disk) or "val_split" (val drawn from class folders).
    """

    root: Path
    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    test: list[Sample] = field(default_factory=list)
    split: str = "folders"


def is_image(name: str) -> bool:
    """Whether a file name has one of IMAGE_EXTS (any case) and is not a hidden/AppleDouble file."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _skip_dir(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


def _subdirs(d: Path) -> dict[str, Path]:
    with os.scandir(d) as it:
        return {e.name: Path(e.path) for e in it if e.is_dir() and not _skip_dir(e.name)}


def _images_under(d: Path, other: list[str]) -> list[str]:
    """Image paths under d (recursively, sorted); other files (not junk) are appended to `other`."""
    found = []
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = [n for n in dirnames if not _skip_dir(n)]
        for n in filenames:
            if is_image(n):
                found.append(os.path.join(dirpath, n))
            elif not n.startswith(".") and n.lower() not in _JUNK_FILES:
                other.append(os.path.join(dirpath, n))
    return sorted(found)


def _class_folders(d: Path, other: list[str]) -> dict[str, list[str]]:
    """{class name: its image paths} for the subfolders of d that hold images."""
    found = {name: _images_under(p, other) for name, p in sorted(_subdirs(d).items())}
    loose = [n for n in os.listdir(d) if is_image(n)]
    if loose and not any(found.values()):
        raise UserError(f"{d} holds images directly ({loose[0]}, ...) but no class folders; {_EXPECTED}")
    other.extend(os.path.join(d, n) for n in loose)
    return {k: v for k, v in found.items() if v}


def _samples(per_class: dict[str, list[str]], index: dict[str, int]) -> list[Sample]:
    return [(p, index[c]) for c in sorted(per_class) for p in per_class[c]]


def _split_per_class(per_class: dict[str, list[str]], val_split: float, seed: int
                     ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Hold out round(n * val_split) files of each class (at least one when n >= 2), seeded per class
    so the split does not change when another class gains files."""
    train, val = {}, {}
    for c, paths in per_class.items():
        order = list(paths)
        random.Random(f"{seed}:{c}").shuffle(order)
        n_val = round(len(order) * val_split)
        if val_split > 0 and len(order) >= 2:
            n_val = min(max(n_val, 1), len(order) - 1)
        held = set(order[:n_val])
        train[c] = [p for p in paths if p not in held]
        val[c] = [p for p in paths if p in held]
    return train, {c: v for c, v in val.items() if v}


def _scan(root: str | Path, val_split: float, seed: int) -> tuple[Layout, list[str]]:
    """find_layout, plus the non-image files seen (for the report)."""
    root = Path(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise UserError(f"dataset {root} {what}; {_EXPECTED}")
    if not 0.0 <= val_split < 1.0:
        raise UserError(f"val_split {val_split} must be in [0, 1)")
    other: list[str] = []
    dirs = {name.lower(): p for name, p in _subdirs(root).items()}
    val_dir = next((dirs[n] for n in _VAL_NAMES if n in dirs), None)

    if "train" in dirs:
        train = _class_folders(dirs["train"], other)
        if not train:
            raise UserError(f"{dirs['train']} has no class folders with images; {_EXPECTED}")
        classes = sorted(train)
        if val_dir is not None:
            val = _class_folders(val_dir, other)
            _same_classes(classes, sorted(val), dirs["train"], val_dir)
            split = "folders"
        else:
            train, val = _split_per_class(train, val_split, seed)
            split = "val_split"
        test = _class_folders(dirs["test"], other) if "test" in dirs else {}
        unknown = sorted(set(test) - set(classes))
        if unknown:
            raise UserError(f"{dirs['test']} has classes that train/ lacks: {', '.join(unknown)}; "
                            "rename or remove them")
    elif val_dir is not None:
        raise UserError(f"{root} has {val_dir.name}/ but no train/; {_EXPECTED}")
    else:
        per_class = _class_folders(root, other)
        if not per_class:
            raise UserError(f"no images found under {root}; {_EXPECTED} "
                            f"(extensions: {' '.join(sorted(IMAGE_EXTS))})")
        classes = sorted(per_class)
        train, val = _split_per_class(per_class, val_split, seed)
        test, split = {}, "val_split"

    if len(classes) < 2:
        raise UserError(f"{root} has one class ({classes[0]}); a classifier needs two or more. If "
                        f"{classes[0]}/ is a wrapper folder, point at it instead: {root / classes[0]}")
    index = {c: i for i, c in enumerate(classes)}
    layout = Layout(root=root, classes=classes, train=_samples(train, index), val=_samples(val, index),
                    test=_samples(test, index), split=split)
    return layout, sorted(other)


def _same_classes(train: list[str], val: list[str], train_dir: Path, val_dir: Path) -> None:
    only_train = sorted(set(train) - set(val))
    only_val = sorted(set(val) - set(train))
    if only_train or only_val:
        parts = []
        if only_val:
            parts.append(f"only in {val_dir.name}/: {', '.join(only_val)}")
        if only_train:
            parts.append(f"only in {train_dir.name}/: {', '.join(only_train)}")
        nfc = {unicodedata.normalize("NFC", c) for c in only_train} == {
            unicodedata.normalize("NFC", c) for c in only_val}
        hint = (" (the names look alike but are written in two Unicode forms, NFC and NFD, as macOS and "
                "some zip tools do; rename one side)") if nfc else ""
        raise UserError(f"{val_dir.name}/ and {train_dir.name}/ have different classes ({'; '.join(parts)})"
                        f"{hint}; give both the same class folders")


def similar_classes(classes: list[str]) -> list[str]:
    """One warning line per group of class names that differ only by Unicode normalisation (NFC vs NFD
    'café') or by case ('Cat'/'cat'): they become separate classes, which is rarely what was meant."""
    groups: dict[str, list[str]] = defaultdict(list)
    for c in classes:
        groups[unicodedata.normalize("NFC", c).casefold()].append(c)
    out = []
    for names in groups.values():
        if len(names) < 2:
            continue
        if len({unicodedata.normalize("NFC", n) for n in names}) == 1:
            how = "only by Unicode normalisation (the same letters written as NFC and NFD)"
        elif len({n.casefold() for n in names}) == 1:
            how = "only by case"
        else:
            how = "only by case and Unicode normalisation"
        # where normalisation differs, ascii() shows how: 'caf\xe9' (NFC) against 'cafe\u0301' (NFD)
        shown = ", ".join(repr(n) if how == "only by case" else ascii(n) for n in names)
        out.append(f"classes {shown} differ {how}; they are {len(names)} separate classes. "
                   "Rename the folders if they are one class")
    return out


def find_layout(root: str | Path, val_split: float = 0.2, seed: int = 0) -> Layout:
    """Find the dataset under `root` (see the module docstring for the layouts).

    Classes are sorted by name; samples are sorted by class, then path. Returns a Layout. Raises
    UserError when root is not a folder, holds no images in class folders, has a single class, or
    its val/ (or test/) classes differ from train/'s (naming them).
    """
    layout = _scan(root, val_split, seed)[0]
    for line in similar_classes(layout.classes):
        log.warning("%s: %s", printable(layout.root), printable(line))
    return layout
