"""The dataset report: what `dlenv data-report DIR` prints (and what `dlenv unpack` shows at the end).

Classes, counts per split, imbalance, image sizes (read from headers, not decoded), unreadable
files, and files that are in both train and val, for a layout `dlenv.data.folder` finds. It is cheap
by default; `check_images=True` decodes every image in a pool of processes. No torch here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import re
import statistics
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dlenv.data.folder import _scan, outside_line, similar_classes, special_line
from dlenv.errors import UserError, host_memory_short, printable
from dlenv.files.safeio import IMAGE_FILE, open_regular
from dlenv.options.cpus import usable_cpus

# ---------------------------------------------------------------------------------------------------
# Cheap per-file checks: size, magic bytes, and a format's end marker (a truncated file lacks it).

_MAGIC = (
    (b"\xff\xd8\xff", "jpeg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"BM", "bmp"),
    (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"GIF8", "gif"),
)


def _quick_check(path: str) -> tuple[int, str | None]:
    """(size in bytes, None or why the file looks broken), from its first and last bytes only."""
    try:
        with open_regular(path, "image", IMAGE_FILE) as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0, "zero-byte file"
            head = f.read(16)
            f.seek(max(0, size - 32))
            tail = f.read(32)
    except OSError as e:
        return 0, f"cannot read ({e.strerror or e})"
    except UserError as e:  # a file over IMAGE_FILE (FIFOs and devices never get here: folder.py)
        return 0, str(e)
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
            with open_regular(path, "image", IMAGE_FILE) as f, Image.open(f) as im:
                im.load()
        return None
    except UnidentifiedImageError:
        return "not an image"
    except UserError as e:  # not a regular file, or too big to be an image
        return str(e)
    except Exception as e:  # any decoder failure means the trainer could not use this file
        if host_memory_short(e):  # the machine's memory, not the file: the CLI's out-of-memory line
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        with contextlib.suppress(OSError):
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
                with open_regular(p, "image", IMAGE_FILE) as f, Image.open(f) as im:  # the header only
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
    with open_regular(path, "image", IMAGE_FILE) as f:
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
        problems.update(_decode_all(todo, usable_cpus() if workers is None else workers))  # 0: in this process
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
        "class_warnings": similar_classes(layout.classes),
        "flip": flip_hint(layout.classes),
        "counts": counts,
        "totals": {s: len(ps) for s, ps in splits.items()},
        "imbalance": {"ratio": round(train_counts[big] / max(train_counts[small], 1), 2),
                      "largest": big, "smallest": small},
        "image_sizes": _size_summary(readable, 1000, seed),
        "checked_images": check_images,
        "unreadable": [{"path": p, "split": split_of[p], "reason": problems[p]} for p in sorted(problems)],
        "duplicates": _cross_duplicates(splits, sizes),
        "other_files": {"count": len(other), "examples": other[:5]},
        "not_regular": layout.special,
        "links_outside": layout.outside,
    }


#: paths shown per group of identical files in the text report (--json lists all)
LEAK_PATHS_SHOWN = 3
def character_classes(classes: list[str]) -> str:
    """The class names that are single characters, as a short list ('0, 1, 2, 3, 4, 5, ...'), where they
    are most of the classes (digits, letters: a mirrored 'b' is a 'd', a mirrored '3' no digit at all);
    '' elsewhere. The one rule for flips: this report's line and `train --hflip auto` both read it."""
    chars = sorted(c for c in classes if len(c.strip()) == 1 and c.strip().isalnum())
    if len(chars) >= 2 and len(chars) * 2 >= len(classes):
        return ", ".join(chars[:6]) + (", ..." if len(chars) > 6 else "")
    return ""


def flip_hint(classes: list[str]) -> str:
    """The report's line on horizontal flips: a warning where `character_classes` finds characters (training
    with --hflip auto then flips none), else the flag named in passing."""
    shown = character_classes(classes)
    if shown:
        return (f"warning   the classes look like characters ({shown}): a mirror image can be another class or "
                "none; training flips none of them (--hflip auto, as --no-hflip)")
    return ("augment   training flips images left-right (--no-hflip where a mirror image is another class: "
            "digits, text)")


def format_report(report: dict[str, Any]) -> str:
    """The text screen of a `dataset_report` dict.

    Every name is printed with `printable` (a file name holding ESC, CR or a newline cannot clear the
    screen or fake a line), and every list is cut to its first entries with a count of the rest, so
    a line stays a line whatever the dataset holds.
    """
    report = _printable(report)
    splits = list(report["counts"])
    lines = [f"dataset   {report['root']}"]
    how = ("train/val folders" if report["split"] == "folders"
           else f"class folders, val split {report['val_split']:g} per class (files not copied)")
    lines.append(f"layout    {how}")
    lines.append(f"classes   {len(report['classes'])}    "
                 + "   ".join(f"{s} {report['totals'][s]}" for s in splits))
    width = min(40, max(len(c) for c in report["classes"] + ["class"]))
    lines.append("")
    lines.append(f"  {'class':<{width}}" + "".join(f"{s:>8}" for s in splits))
    for c in report["classes"]:
        lines.append(f"  {c:<{width}}" + "".join(f"{report['counts'][s][c]:>8}" for s in splits))
    for w in report.get("class_warnings", []):
        lines.append(f"warning   {w}")
    if report.get("flip"):
        lines.append(report["flip"])
    imb = report["imbalance"]
    note = "  (consider class weights or resampling)" if imb["ratio"] >= 3 else ""
    lines.append("")
    if imb["ratio"] <= 1:  # every class the same size: naming a "largest" and "smallest" misleads
        lines.append("balanced  every class has the same number of training images")
    else:
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
        same = [p for s in d for p in d[s]]
        more = f"  (+{len(same) - LEAK_PATHS_SHOWN} more with the same content)" if len(same) > LEAK_PATHS_SHOWN else ""
        lines.append("  " + "  =  ".join(same[:LEAK_PATHS_SHOWN]) + more)
    if len(dups) > 10:
        lines.append(f"  ... and {len(dups) - 10} more (--json lists all)")
    if report.get("not_regular"):
        lines.append(f"warning   {special_line(report['not_regular'])}")
    if report.get("links_outside"):
        lines.append(f"warning   {outside_line(report['links_outside'])}")
    other = report["other_files"]
    if other["count"]:
        lines.append(f"ignored   {other['count']} non-image file(s), e.g. {other['examples'][0]}")
    return "\n".join(lines)


def _printable(obj: Any) -> Any:
    """`obj` (a report) with every string, key included, passed through `printable`."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {_printable(k): _printable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_printable(v) for v in obj]
    return obj


# In JSON, json.dumps escapes C0 controls itself; these it leaves raw (C1 controls, bidi overrides,
# the surrogates of non-UTF-8 file names, which cannot even be printed): written as \\uXXXX escapes,
# which JSON readers turn back into the same string.
_JSON_RAW = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                       "\ud800-\udfff]")


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON text that prints safely: non-ASCII names readable, unsafe characters escaped."""
    text = json.dumps(report, indent=2, ensure_ascii=False)
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def main(cfg: Any) -> int:
    """`dlenv data-report DIR [--json] [--check-images]`: print the report; 0 on success."""
    if not cfg.dir:
        raise UserError("data-report needs a dataset folder: dlenv data-report DIR")
    workers = None if cfg.workers == "auto" else int(cfg.workers)
    report = dataset_report(cfg.dir, val_split=cfg.val_split, check_images=cfg.check_images,
                            workers=workers)
    print(to_json(report) if cfg.json else format_report(report))
    return 0
