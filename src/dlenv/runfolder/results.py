"""results.csv: the contract between the trainer, the plots and the reports.

The trainer appends one row per epoch (`append_row`); `invoke plot` and reports read the file
(`read_results`) and never reach into a running trainer. Columns are fixed here, in this order, so a
run in progress is always readable; a new column goes at the end, and a file an older version wrote
(fewer columns) is rewritten with today's header, its rows kept and the new columns empty, before a
row is appended to it (a resumed run). Readers take the columns the file's header names. No torch
here: the plots import this module.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from dlenv.errors import with_path
from dlenv.files.atomic import write_atomic
from dlenv.options.declare import EPOCHS_MAX

log = logging.getLogger(__name__)

#: column -> meaning (with unit). The order is the file's column order.
COLUMNS: dict[str, str] = {
    "epoch": "epoch number, from 1",
    "train_loss": "mean training loss over the epoch",
    "val_loss": "validation loss",
    "top1": "validation top-1 accuracy, %",
    "top5": "validation top-5 accuracy, %",
    "lr": "learning rate at the end of the epoch",
    "img_per_s": "training images per second (all GPUs)",
    "data_wait": "share of the epoch spent waiting for data, 0-1",
    "epoch_s": "epoch wall time, seconds",
    "mem_alloc_gib": "peak memory allocated by tensors, GiB (0 on CPU)",
    "mem_reserved_gib": "peak memory reserved by the caching allocator, GiB (0 on CPU)",
    "batch_size": "micro-batch per GPU at the end of the epoch",
    "accum_steps": "micro-batches per optimizer step at the end of the epoch",
    "oom_retries": "re-plans at half the micro-batch after CUDA out of memory (--batch-size auto)",
    "gpu_busy": "share of the epoch's training time a kernel ran on the GPU (NVML utilisation sampled each "
                "second, as `dlenv watch` reports it), 0-1 (empty on CPU or without NVML)",
}


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one epoch's row (writing the header first if the file is new), flushed to disk.

    A file that ends in the middle of a line (a write cut off by a kill) gets its line ended first,
    so the cut-off line stays one unreadable line that readers skip, and the new row stays whole.
    """
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise KeyError(f"results.csv has no column(s) {sorted(unknown)}")
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        _upgrade_header(path)
    try:
        with path.open("a+b") as fh:
            if not new:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            text = io.StringIO(newline="")
            w = csv.DictWriter(text, fieldnames=list(COLUMNS))
            if new:
                w.writeheader()
            w.writerow({k: _fmt(row.get(k)) for k in COLUMNS})
            fh.write(text.getvalue().encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as e:
        raise with_path(e, path) from None


def _upgrade_header(path: Path) -> None:
    """A results.csv whose header is not today's (written by an older version): rewritten atomically with
    today's columns, its rows kept (columns it lacks left empty), so the next row lines up with the header."""
    try:
        with path.open("rb") as fh:
            first = fh.readline(64 * 1024)
    except OSError as e:
        raise with_path(e, path) from None
    today = ",".join(COLUMNS).encode()
    if first.rstrip(b"\r\n") == today or not first.lstrip(b"\xef\xbb\xbf").startswith(b"epoch"):
        return  # today's, or no header to line up with (the reader skips what it cannot read)
    _, rows, _ = _parse(path.read_bytes())

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(COLUMNS), extrasaction="ignore")
            w.writeheader()
            w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)

    write_atomic(path, write)


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def _parse(data: bytes) -> tuple[list[str], list[dict[str, str]], list[int]]:
    """(header, rows, numbers of the lines that could not be read) of results.csv's bytes.

    The header is the first line that starts with `epoch`. A row is a line of valid UTF-8 without NUL
    bytes, with as many fields as the header and a number in its epoch field; any other line is
    unreadable (a cut-off write, a corrupted disk block, an edit gone wrong) and is left out. A last
    line without its newline is a row being written right now: it is not a row yet, nor an error.
    """
    lines = data.split(b"\n")
    lines.pop()  # the part after the last newline: empty, or a row still being written
    header: list[str] = []
    rows: list[dict[str, str]] = []
    bad: list[int] = []
    for number, raw in enumerate(lines, start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            if b"\0" in raw:
                raise ValueError("NUL byte")
            fields = next(csv.reader([raw.decode("utf-8")]))
        except (ValueError, csv.Error):
            bad.append(number)
            continue
        if not header:
            if fields and fields[0].strip().lstrip("\ufeff") == "epoch":  # a BOM: saved by a spreadsheet
                header = [f.strip().lstrip("\ufeff") for f in fields]
            else:
                bad.append(number)
            continue
        if len(fields) != len(header) or not _is_epoch(fields[0]):
            bad.append(number)
            continue
        rows.append(dict(zip(header, fields, strict=True)))
    return header, rows, bad


def parse_rows(data: bytes) -> tuple[list[str], list[dict[str, str]], list[int]]:
    """(header, rows, numbers of the lines that could not be read) of results.csv's bytes, read by the caller
    (bounded, a regular file: dlenv.runfolder.runs); rows as text. See `_parse`."""
    return _parse(data)


def _is_number(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def _is_epoch(s: str) -> bool:
    """An epoch number as the trainer writes it: 1 to --epochs's maximum (1e20 would be a figure's axis of
    zero width and matplotlib's warnings)."""
    return _is_number(s) and 1 <= float(s) <= EPOCHS_MAX


def read_results(path: str | Path):
    """results.csv as a pandas DataFrame (numeric columns as floats), sorted by epoch.

    Lines that cannot be read are left out (see `_parse`); their line numbers are in
    `df.attrs["dropped"]`. A partial last line is not a row yet and is not counted.
    """
    import pandas as pd

    header, rows, bad = _parse(Path(path).read_bytes())
    df = pd.DataFrame(rows, columns=header or None)
    for c in df.columns:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if "epoch" in df.columns:
        df = df.dropna(subset=["epoch"]).sort_values("epoch", kind="stable").reset_index(drop=True)
    df.attrs["dropped"] = bad
    return df


def truncate_after(path: str | Path, epoch: int) -> None:
    """Drop rows after `epoch` (a resumed run rewrites the epochs it repeats).

    Lines that cannot be read are left out of the rewritten file, and then nothing is lost: the file
    as it was is kept beside it as results.csv.before-resume-<time>, and a warning names both.
    """
    path = Path(path)
    if not path.exists():
        return
    original = path.read_bytes()
    _, rows, bad = _parse(original)
    keep = [r for r in rows if float(r["epoch"]) <= epoch]
    if bad:
        kept = path.with_name(f"{path.name}.before-resume-{time.strftime('%Y%m%d-%H%M%S')}")
        write_atomic(kept, lambda tmp: tmp.write_bytes(original))
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        log.warning("%s: %d line(s) could not be read (line %s) and are left out; the file as it was is "
                    "kept in %s", path, len(bad), shown, kept)

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
            w.writeheader()
            w.writerows({k: r.get(k, "") for k in COLUMNS} for r in keep)

    write_atomic(path, write)
