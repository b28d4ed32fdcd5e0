"""results.csv: the contract between the trainer, the plots and the reports.

The trainer appends one row per epoch (`append_row`); `invoke plot` and reports read the file
(`read_results`) and never reach into a running trainer. Columns are fixed here, in this order, so a
run in progress is always readable. No torch here: the plots import this module.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from dlenv.atomic import write_atomic

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
    "oom_retries": "steps retried with a halved micro-batch after CUDA out of memory",
}


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append one epoch's row (writing the header first if the file is new), flushed to disk."""
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise KeyError(f"results.csv has no column(s) {sorted(unknown)}")
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        if new:
            w.writeheader()
        w.writerow({k: _fmt(row.get(k)) for k in COLUMNS})
        fh.flush()
        os.fsync(fh.fileno())


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def read_results(path: str | Path):
    """results.csv as a pandas DataFrame (numeric columns as floats). A partial last line is dropped."""
    import io

    import pandas as pd

    text = Path(path).read_text(encoding="utf-8")
    if not text.endswith("\n"):  # a row the trainer is writing right now: not a row yet
        text = text[: text.rfind("\n") + 1]
    df = pd.read_csv(io.StringIO(text), on_bad_lines="skip")
    for c in df.columns:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df.dropna(subset=["epoch"]) if "epoch" in df.columns else df


def truncate_after(path: str | Path, epoch: int) -> None:
    """Drop rows after `epoch` (a resumed run rewrites the epochs it repeats)."""
    path = Path(path)
    if not path.exists():
        return
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    keep = [r for r in rows if r.get("epoch") and float(r["epoch"]) <= epoch]

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
            w.writeheader()
            w.writerows({k: r.get(k, "") for k in COLUMNS} for r in keep)

    write_atomic(path, write)
