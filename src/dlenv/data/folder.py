"""What is in a dataset folder: its layout (`find_layout`) and a report on it (`dataset_report`).

Two layouts are understood, both of class folders:

    root/train/<class>/*.jpg + root/val/<class>/*.jpg   (val/ may be valid/ or validation/;
                                                         an optional test/ is kept apart)
    root/<class>/*.jpg                                  (split into train/val per class by a seeded
                                                         fraction; no file is copied or moved)

The report is what `dlenv data-report DIR` prints (and what `dlenv unpack` shows at the end): classes,
counts per split, imbalance, image sizes (read from headers, not decoded), unreadable files, and files
that are in both train and val. It is cheap by default; `check_images=True` decodes every image in
a pool of processes. No torch here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import statistics
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlenv.cpus import usable_cpus
from dlenv.errors import UserError

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
        raise UserError(f"{val_dir.name}/ and {train_dir.name}/ have different classes ({'; '.join(parts)}); "
                        "give both the same class folders")


def find_layout(root: str | Path, val_split: float = 0.2, seed: int = 0) -> Layout:
    """Find the dataset under `root` (see the module docstring for the layouts).

    Classes are sorted by name; samples are sorted by class, then path. Returns a Layout. Raises
    UserError when root is not a folder, holds no images in class folders, has a single class, or
    its val/ (or test/) classes differ from train/'s (naming them).
    """
    return _scan(root, val_split, seed)[0]


# ---------------------------------------------------------------------------------------------------
# Cheap per-file checks: size, magic bytes, and a format's end marker (a truncated file lacks it).

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"BM", "bmp"),
    (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"GIF8", "gif"),
)


def _quick_check(path: str) -> tuple[int, str | None]:
    """(size in bytes, None or why the file looks broken), from its first and last bytes only."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0, "zero-byte file"
        with open(path, "rb") as f:
            head = f.read(16)
            f.seek(max(0, size - 32))
            tail = f.read(32)
    except OSError as e:
        return 0, f"cannot read ({e.strerror or e})"
    kind = next((k for m, k in _MAGIC if head.startswith(m)), None)
    if kind is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        kind = "webp"
        if int.from_bytes(head[4:8], "little") + 8 > size:
            return size, "suspect: truncated"
    if kind is None:
        return size, "suspect: not an image"
    if (kind == "jpeg" and b"\xff\xd9" not in tail) or (kind == "png" and b"IEND" not in tail):
        return size, "suspect: truncated"
    if kind == "bmp" and int.from_bytes(head[2:6], "little") > size:
        return size, "suspect: truncated"
    return size, None


def decode_problem(path: str) -> str | None:
    """Fully decode one image; None when it is fine, else a short reason (one line)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as im:
                im.load()
        return None
    except UnidentifiedImageError:
        return "not an image"
    except Exception as e:  # any decoder failure means the trainer could not use this file
        msg = " ".join(str(e).split()) or type(e).__name__
        if os.path.getsize(path) == 0:
            return "zero-byte file"
        return f"truncated ({msg})" if "truncat" in msg.lower() else f"cannot decode ({msg})"


def _decode_chunk(paths: list[str]) -> list[tuple[str, str]]:
    return [(p, r) for p in paths if (r := decode_problem(p)) is not None]


def _decode_all(paths: list[str], workers: int) -> dict[str, str]:
    """{path: reason} for every path that fails to decode, using `workers` processes."""
    if not paths:
        return {}
    if workers <= 1 or len(paths) < 64:
        return dict(_decode_chunk(paths))
    import multiprocessing as mp

    # Chunks of a few hundred files keep inter-process traffic tiny (only failures come back).
    n_chunks = max(workers * 4, len(paths) // 500)
    chunks = [paths[i::n_chunks] for i in range(n_chunks)]
    # forkserver: no fork of a possibly multi-threaded parent, and far cheaper than spawn.
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else None)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return dict(pair for part in pool.map(_decode_chunk, chunks) for pair in part)


# ---------------------------------------------------------------------------------------------------
# The report.


def _size_summary(paths: list[str], limit: int, seed: int) -> dict[str, Any]:
    """Image sizes and modes of up to `limit` files chosen at random, from their headers only."""
    from PIL import Image

    chosen = paths if len(paths) <= limit else random.Random(seed).sample(paths, limit)
    sizes, modes = [], Counter()
    for p in chosen:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(p) as im:  # reads the header; pixels are not decoded
                    sizes.append(im.size)
                    modes[im.mode] += 1
        except Exception:  # broken files are reported by the checks; sizes are a summary
            continue
    if not sizes:
        return {"sampled": 0}
    ws, hs = [w for w, _ in sizes], [h for _, h in sizes]
    common = Counter(f"{w}x{h}" for w, h in sizes).most_common(5)
    return {
        "sampled": len(sizes), "of": len(paths),
        "width": {"min": min(ws), "median": statistics.median(ws), "max": max(ws)},
        "height": {"min": min(hs), "median": statistics.median(hs), "max": max(hs)},
        "common": [[s, n] for s, n in common], "modes": dict(modes.most_common()),
    }


def _hash(path: str, limit: int | None = None) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if limit is not None:
            h.update(f.read(limit))
        else:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _cross_duplicates(splits: dict[str, list[str]], sizes: dict[str, int]) -> list[dict[str, list[str]]]:
    """Files with identical content in train and in val (or test), found by size, then the hash of
    the first 64 KiB, then the full hash: only candidates are read in full."""
    if "train" not in splits or len(splits) < 2:
        return []
    def spans(group: list[tuple[str, str]]) -> bool:
        names = {s for s, _ in group}
        return "train" in names and len(names) > 1

    groups = [[(s, p) for s, ps in splits.items() for p in ps if sizes.get(p)]]
    keys = (sizes.__getitem__, functools.partial(_hash, limit=1 << 16), _hash)
    with ThreadPoolExecutor(max_workers=8) as pool:
        for key in keys:
            mapper = map if key is keys[0] else pool.map
            nxt = []
            for group in groups:
                by = defaultdict(list)
                for item, k in zip(group, mapper(key, [p for _, p in group]), strict=True):
                    by[k].append(item)
                nxt += [g for g in by.values() if spans(g)]
            groups = nxt
    out = []
    for g in sorted(groups, key=lambda g: min(p for _, p in g)):
        entry: dict[str, list[str]] = defaultdict(list)
        for s, p in sorted(g):
            entry[s].append(p)
        out.append(dict(entry))
    return out


def dataset_report(root: str | Path, val_split: float = 0.2, seed: int = 0, check_images: bool = False,
                   workers: int | None = None) -> dict[str, Any]:
    """A JSON-able report on the dataset under `root`.

    Keys: root, split, classes, counts ({split: {class: n}}), totals, imbalance (largest/smallest
    train class), image_sizes (from up to 1000 headers), unreadable ([{path, split, reason}]: zero-byte,
    truncated, not an image; every image is decoded when `check_images`, in `workers` processes,
    default all usable CPUs), duplicates ([{train: [...], val: [...]}] by content), other_files.
    Raises UserError as `find_layout` does.
    """
    layout, other = _scan(root, val_split, seed)
    splits = {s: [p for p, _ in getattr(layout, s)] for s in ("train", "val", "test")}
    splits = {s: ps for s, ps in splits.items() if ps}
    split_of = {p: s for s, ps in splits.items() for p in ps}
    paths = list(split_of)

    quick = {p: _quick_check(p) for p in paths}  # ~20 us a file; threads only add overhead here
    sizes = {p: size for p, (size, _) in quick.items()}
    if check_images:
        problems = {p: why for p, (_, why) in quick.items() if why and not why.startswith("suspect")}
        todo = [p for p in paths if p not in problems]
        problems.update(_decode_all(todo, workers or usable_cpus()))
    else:
        problems = {}
        for p, (_, why) in quick.items():
            if why and why.startswith("suspect"):
                why = decode_problem(p)  # only suspects are decoded, to confirm
            if why:
                problems[p] = why

    counts = {s: {c: 0 for c in layout.classes} for s in splits}
    for s in splits:
        for _, label in getattr(layout, s):
            counts[s][layout.classes[label]] += 1
    train_counts = counts["train"]
    big = max(train_counts, key=train_counts.get)
    small = min(train_counts, key=train_counts.get)
    readable = [p for p in paths if p not in problems]
    return {
        "root": str(layout.root),
        "split": layout.split,
        "val_split": val_split if layout.split == "val_split" else None,
        "classes": layout.classes,
        "counts": counts,
        "totals": {s: len(ps) for s, ps in splits.items()},
        "imbalance": {"ratio": round(train_counts[big] / max(train_counts[small], 1), 2),
                      "largest": big, "smallest": small},
        "image_sizes": _size_summary(readable, 1000, seed),
        "checked_images": check_images,
        "unreadable": [{"path": p, "split": split_of[p], "reason": problems[p]} for p in sorted(problems)],
        "duplicates": _cross_duplicates(splits, sizes),
        "other_files": {"count": len(other), "examples": other[:5]},
    }


def format_report(report: dict[str, Any]) -> str:
    """The text screen of a `dataset_report` dict."""
    splits = list(report["counts"])
    lines = [f"dataset   {report['root']}"]
    how = ("train/val folders" if report["split"] == "folders"
           else f"class folders, val split {report['val_split']:g} per class (files not copied)")
    lines.append(f"layout    {how}")
    lines.append(f"classes   {len(report['classes'])}    "
                 + "   ".join(f"{s} {report['totals'][s]}" for s in splits))
    width = max(len(c) for c in report["classes"] + ["class"])
    lines.append("")
    lines.append(f"  {'class':<{width}}" + "".join(f"{s:>8}" for s in splits))
    for c in report["classes"]:
        lines.append(f"  {c:<{width}}" + "".join(f"{report['counts'][s][c]:>8}" for s in splits))
    imb = report["imbalance"]
    note = "  (consider class weights or resampling)" if imb["ratio"] >= 3 else ""
    lines.append("")
    lines.append(f"imbalance {imb['ratio']:g}x: largest {imb['largest']}, smallest {imb['smallest']}{note}")
    sz = report["image_sizes"]
    if sz.get("sampled"):
        w, h = sz["width"], sz["height"]
        modes = ", ".join(f"{m} {n}" for m, n in sz["modes"].items())
        common = ", ".join(f"{s} ({n})" for s, n in sz["common"][:3])
        lines.append(f"sizes     {sz['sampled']} of {sz['of']} read: width {w['min']}-{w['max']} "
                     f"(median {w['median']:g}), height {h['min']}-{h['max']} (median {h['median']:g}); "
                     f"most common {common}; modes {modes}")
    bad = report["unreadable"]
    checked = "every image decoded" if report["checked_images"] else \
        "quick check; --check-images decodes every image"
    lines.append(f"unreadable {len(bad)} ({checked})")
    for b in bad[:20]:
        lines.append(f"  {b['path']}: {b['reason']}")
    if len(bad) > 20:
        lines.append(f"  ... and {len(bad) - 20} more (--json lists all)")
    dups = report["duplicates"]
    lines.append(f"leaks     {len(dups)} file(s) with the same content in train and val/test")
    for d in dups[:10]:
        lines.append("  " + "  =  ".join(p for s in d for p in d[s]))
    if len(dups) > 10:
        lines.append(f"  ... and {len(dups) - 10} more (--json lists all)")
    other = report["other_files"]
    if other["count"]:
        lines.append(f"ignored   {other['count']} non-image file(s), e.g. {other['examples'][0]}")
    return "\n".join(lines)


def main(cfg: Any) -> int:
    """`dlenv data-report DIR [--json] [--check-images]`: print the report; 0 on success."""
    if not cfg.dir:
        raise UserError("data-report needs a dataset folder: dlenv data-report DIR")
    workers = None if cfg.workers == "auto" else int(cfg.workers)
    report = dataset_report(cfg.dir, val_split=cfg.val_split, check_images=cfg.check_images,
                            workers=workers)
    print(json.dumps(report, indent=2, ensure_ascii=False) if cfg.json else format_report(report))
    return 0
