"""What is in a dataset folder: its layout (`find_layout`); the report on it is `dlenv.data.report`.

Two layouts are understood, both of class folders:

    root/train/<class>/*.jpg + root/val/<class>/*.jpg   (val/ may be valid/ or validation/;
                                                         an optional test/ is kept apart)
    root/<class>/*.jpg                                  (split into train/val per class by a seeded
                                                         fraction; no file is copied or moved)

The walk is bounded by construction, whatever the folder holds: it stays inside the data folder (a link to a
folder is followed only where it leads to a class or split folder inside the data folder, never below that),
never enters the kernel's file systems (/proc, /sys, /dev: `safeio.PSEUDO_FS`), and counts every entry it
looks at against `MAX_ENTRIES`, ending in one line past it. A `data/root -> /` walked the whole file system.

No torch here.
"""

from __future__ import annotations

import logging
import os
import random
import stat
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dlenv.errors import UserError, printable
from dlenv.files import safeio

log = logging.getLogger("dlenv.data")

#: Image file extensions we read, lowercase; matching is case-insensitive.
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})

_VAL_NAMES = ("val", "valid", "validation")
_JUNK_FILES = {"thumbs.db", "desktop.ini"}
_EXPECTED = ("expected train/<class>/<image> with val/<class>/<image>, or <class>/<image> "
             "folders only")

Sample = tuple[str, int]

#: the most directory entries (files and folders) one scan looks at: over three times ImageNet-21k's 14
#: million images, past any dataset of class folders, where a file server's tree would go on for hours
MAX_ENTRIES = 50_000_000


class _Seen:
    """What one scan met beside the images, and its budget: other files (not junk), entries that are not
    regular files (`special`), links to folders that lead out of the data folder (`outside`), and the
    count of entries looked at, which stops the scan in one line past MAX_ENTRIES."""

    def __init__(self, root: Path):
        self.root = root
        self.real = os.path.realpath(root)
        self.other: list[str] = []
        self.special: list[str] = []
        self.outside: list[str] = []
        self.entries = 0

    def count(self, n: int = 1) -> None:
        self.entries += n
        if self.entries > MAX_ENTRIES:
            raise UserError(f"dataset {printable(self.root)} holds more than {MAX_ENTRIES:,} files and folders "
                            f"where class folders are looked for (it leads to {printable(self.real)}): that is "
                            "not a dataset folder; pass the folder that holds the class folders")

    def inside(self, path: str) -> bool:
        """Whether `path`, links followed, lies inside the data folder."""
        real = os.path.realpath(path)
        return real == self.real or real.startswith(self.real.rstrip(os.sep) + os.sep)


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
    #: image-named entries left out because they are not regular files (FIFOs, devices, sockets)
    special: list[str] = field(default_factory=list)
    #: links to folders left out because they lead out of the data folder
    outside: list[str] = field(default_factory=list)


def is_image(name: str) -> bool:
    """Whether a file name has one of IMAGE_EXTS (any case) and is not a hidden/AppleDouble file."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _skip_dir(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


def _kernel_fs(entry: os.DirEntry, follow: bool = False) -> bool:
    """Whether a folder lies on one of the kernel's file systems (/proc, /sys, /dev), never walked."""
    try:
        return entry.stat(follow_symlinks=follow).st_dev in safeio.pseudo_devices()
    except OSError:
        return False


def _subdirs(d: Path, seen: _Seen) -> dict[str, Path]:
    """{name: path} of d's folders, and of its links to folders inside the data folder (a link that leads
    out of it is noted in `seen.outside`, not followed)."""
    found = {}
    with os.scandir(d) as it:
        for e in it:
            seen.count()
            try:
                if not e.is_dir() or _skip_dir(e.name) or _kernel_fs(e, follow=True):
                    continue
            except OSError:
                continue
            if e.is_symlink() and not seen.inside(e.path):
                seen.outside.append(e.path)
                continue
            found[e.name] = Path(e.path)
    return found


def _special(entry: os.DirEntry) -> bool:
    """Whether a directory entry is a FIFO, device or socket, a file of the kernel's (/proc/self/environ),
    or a link to one. Opening a FIFO blocks until a writer comes, /dev/zero never ends and /proc/self/mem
    fails every read: such a file named x.jpg must never reach a decoder. A plain file costs nothing here
    (the type comes with the directory listing, and its folder was judged); a link costs a stat."""
    try:
        if entry.is_file() and not entry.is_symlink():
            return False
        st = entry.stat()
        return not stat.S_ISREG(st.st_mode) or st.st_dev in safeio.pseudo_devices()
    except OSError:  # a broken link: the decoder reports it as unreadable, with its reason
        return False


def _images_under(d: Path, seen: _Seen) -> list[str]:
    """Image paths under d (recursively, sorted, links to folders not followed, as os.walk does, nor
    folders on the kernel's file systems); other files (not junk) go to `seen.other`, FIFOs, devices and
    sockets to `seen.special`; every entry counts against the scan's budget."""
    found = []
    stack = [os.fspath(d)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:  # an unreadable folder is skipped, as os.walk does
            continue
        with entries:
            for e in entries:
                seen.count()
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False
                if is_dir:
                    if not _skip_dir(e.name) and not e.is_symlink() and not _kernel_fs(e):
                        stack.append(e.path)
                elif e.name.startswith(".") or e.name.lower() in _JUNK_FILES:
                    continue
                elif _special(e):
                    seen.special.append(e.path)
                else:
                    (found if is_image(e.name) else seen.other).append(e.path)
    return sorted(found)


def class_key(name: str) -> str:
    """What two class names are compared by: their NFC form. macOS and some zip tools write 'café' as
    'cafe' + a combining accent (NFD), others as one letter (NFC); the two look the same everywhere and
    are one class. Val's matching of a run file's class names to a folder's compares by this too."""
    return unicodedata.normalize("NFC", name)


def _class_folders(d: Path, seen: _Seen) -> dict[str, list[str]]:
    """{class name: its image paths} for the subfolders of d that hold images. Raises UserError for two
    folders that are one name in two Unicode forms (which of them would be the class?)."""
    found = {name: _images_under(p, seen) for name, p in sorted(_subdirs(d, seen).items())}
    loose = [n for n in os.listdir(d) if is_image(n)]
    if loose and not any(found.values()):
        raise UserError(f"{d} holds images directly ({loose[0]}, ...) but no class folders; {_EXPECTED}")
    seen.other.extend(os.path.join(d, n) for n in loose)
    found = {k: v for k, v in found.items() if v}
    seen: dict[str, str] = {}
    for name in found:
        twin = seen.setdefault(class_key(name), name)
        if twin != name:  # ascii() shows the difference: 'caf\xe9' (NFC) and 'cafe\u0301' (NFD)
            raise UserError(f"{printable(d)} has class folders {ascii(twin)} and {ascii(name)}: one name written "
                            "in two Unicode forms (NFC and NFD, as macOS and some zip tools write names); move "
                            "the images of one into the other")
    return found


def _named_as(per_class: dict[str, list[str]], classes: list[str]) -> dict[str, list[str]]:
    """`per_class` (val/ or test/) with each folder named as train/ spells the same class (`class_key`)."""
    spelling = {class_key(c): c for c in classes}
    return {spelling.get(class_key(c), c): paths for c, paths in per_class.items()}


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
    seen = _Seen(root)
    if seen.real == os.sep or os.stat(root).st_dev in safeio.pseudo_devices():
        raise UserError(f"dataset {printable(root)} leads to {printable(seen.real)}, "
                        f"{'the whole file system' if seen.real == os.sep else 'a folder of the kernel'}, not a "
                        f"dataset; pass the folder that holds the class folders")
    dirs = {name.lower(): p for name, p in _subdirs(root, seen).items()}
    val_dir = next((dirs[n] for n in _VAL_NAMES if n in dirs), None)

    if "train" in dirs:
        train = _class_folders(dirs["train"], seen)
        if not train:
            raise UserError(f"{dirs['train']} has no class folders with images; {_EXPECTED}")
        classes = sorted(train)
        if val_dir is not None:
            val = _named_as(_class_folders(val_dir, seen), classes)
            _same_classes(classes, sorted(val), dirs["train"], val_dir)
            split = "folders"
        else:
            train, val = _split_per_class(train, val_split, seed)
            split = "val_split"
        test = _named_as(_class_folders(dirs["test"], seen), classes) if "test" in dirs else {}
        unknown = sorted(set(test) - set(classes))
        if unknown:
            raise UserError(f"{dirs['test']} has classes that train/ lacks: {', '.join(unknown)}; "
                            "rename or remove them")
    elif val_dir is not None:
        raise UserError(f"{root} has {val_dir.name}/ but no train/; {_EXPECTED}")
    else:
        per_class = _class_folders(root, seen)
        if not per_class:
            raise UserError(f"no images found under {root}; {_EXPECTED} "
                            f"(extensions: {' '.join(sorted(IMAGE_EXTS))})")
        classes = sorted(per_class)
        train, val = _split_per_class(per_class, val_split, seed)
        test, split = {}, "val_split"

    if len(classes) < 2:
        raise UserError(_one_class(root, dirs.get("train", root), classes[0]))
    index = {c: i for i, c in enumerate(classes)}
    layout = Layout(root=root, classes=classes, train=_samples(train, index), val=_samples(val, index),
                    test=_samples(test, index), split=split, special=sorted(seen.special),
                    outside=sorted(set(seen.outside)))
    return layout, sorted(seen.other)


def _one_class(root: Path, parent: Path, name: str) -> str:
    """The line for a dataset of one class: where its class folders may really be, if anywhere."""
    line = f"{printable(root)} has one class ({printable(name)}); a classifier needs two or more"
    folder = parent / name
    seen = _Seen(root)
    inner = sorted(n for n in _subdirs(folder, seen) if _images_under(folder / n, seen))
    if len(inner) >= 2:  # a wrapper: its subfolders are the classes (data/x/images/{cat,dog}/...)
        return (f"{line}. {printable(name)}/ holds the class folders ({', '.join(printable(n) for n in inner[:3])}"
                f"{', ...' if len(inner) > 3 else ''}): pass --data {printable(folder)}")
    where = f"{parent.name}/" if parent != root else ""
    return f"{line}; add a folder of images per class under {printable(root)}/{where} (e.g. {where}cat/, {where}dog/)"


def _same_classes(train: list[str], val: list[str], train_dir: Path, val_dir: Path) -> None:
    only_train = sorted(set(train) - set(val))
    only_val = sorted(set(val) - set(train))
    if only_train or only_val:
        parts = []
        if only_val:
            parts.append(f"only in {val_dir.name}/: {', '.join(only_val)}")
        if only_train:
            parts.append(f"only in {train_dir.name}/: {', '.join(only_train)}")
        raise UserError(f"{val_dir.name}/ and {train_dir.name}/ have different classes ({'; '.join(parts)}); "
                        "give both the same class folders")


def similar_classes(classes: list[str]) -> list[str]:
    """One warning line per group of class names that differ only by case ('Cat'/'cat'), or by case and
    Unicode normalisation ('CAFÉ'/'café' in NFD): they become separate classes, which is rarely what was
    meant. (Names that differ by normalisation alone are one class, or refused: `_class_folders`.)"""
    groups: dict[str, list[str]] = defaultdict(list)
    for c in classes:
        groups[class_key(c).casefold()].append(c)
    out = []
    for names in groups.values():
        if len(names) < 2:
            continue
        how = "only by case" if len({n.casefold() for n in names}) == 1 else "only by case and Unicode normalisation"
        # where normalisation differs, ascii() shows how: 'caf\xe9' (NFC) against 'cafe\u0301' (NFD)
        shown = ", ".join(repr(n) if how == "only by case" else ascii(n) for n in names)
        out.append(f"classes {shown} differ {how}; they are {len(names)} separate classes. "
                   "Rename the folders if they are one class")
    return out


def find_layout(root: str | Path, val_split: float = 0.2, seed: int = 0) -> Layout:
    """Find the dataset under `root` (see the module docstring for the layouts).

    Classes are sorted by name, spelled as train/'s folders are (val/ and test/ folders match them by
    `class_key`); samples are sorted by class, then path. Returns a Layout. Raises UserError when root
    is not a folder, holds no images in class folders, has a single class, has two class folders that
    are one name in two Unicode forms, or its val/ (or test/) classes differ from train/'s (naming them).
    """
    layout = _scan(root, val_split, seed)[0]
    for line in similar_classes(layout.classes):
        log.warning("%s: %s", printable(layout.root), printable(line))
    if layout.special:
        log.warning("%s: %s", printable(layout.root), special_line(layout.special))
    if layout.outside:
        log.warning("%s: %s", printable(layout.root), outside_line(layout.outside))
    return layout


def outside_line(outside: list[str]) -> str:
    """One line for the links to folders left out because they lead out of the data folder."""
    n = len(outside)
    return (f"left out {n} link{'' if n == 1 else 's'} to a folder outside the dataset, e.g. "
            f"{printable(outside[0])} -> {printable(os.path.realpath(outside[0]))}; links are followed only "
            "inside the data folder: move or copy that folder in, or pass it as --data")


def special_line(special: list[str]) -> str:
    """One line for the dataset entries left out because they are not regular files."""
    n = len(special)
    return (f"left out {n} entr{'y' if n == 1 else 'ies'} that {'is' if n == 1 else 'are'} not a regular file "
            "(a named pipe, device or socket; reading one would hang or never end), e.g. "
            f"{printable(special[0])}; only regular files are read")
