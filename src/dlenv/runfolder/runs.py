"""`dlenv runs`'s rows: every run folder under --log-dir read, one row each (dlenv.runfolder.runsview prints them).

A run is a folder holding config.yaml or results.csv (the run folder's contract, dlenv.runfolder.results), found
under --log-dir at most MAX_DEPTH folders down, without following links. Its row says its name, model, data,
epochs done of planned, best top-1, img/s and peak GPU memory (of its epochs), wall time (the epochs' sum) and how
it ended (status.yaml, dlenv.runfolder.runstatus; a run of an older version is judged by its files).

Run folders from elsewhere are untrusted: only regular files are opened (a FIFO never blocks, dlenv.files.safeio),
each within a size bound; config.yaml is read as any --cfg file (no YAML aliases, bounded nodes,
dlenv.options.cfgfile); a file that is a link out of its folder is not read; every name and value is printed
escaped (dlenv.errors.printable); a number outside its column's bounds, NaN or infinite, is shown as missing.
A folder that cannot be read is a row `unreadable: why`, never a traceback. No torch, no pandas here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, need_folder, printable
from dlenv.files import safeio
from dlenv.options.cfgfile import load_yaml, read_yaml
from dlenv.runfolder import LAST, config_notes, results, runstatus
from dlenv.runfolder.plots import CONFIG, RESULTS, natural_key

#: how deep under --log-dir run folders are looked for (runs/<name>, runs/<project>/<name>, ...)
MAX_DEPTH = 3
#: the most folders looked at, however many there are
MAX_FOLDERS = 20_000
#: the largest results.csv read (100,000 epochs of ~150 bytes)
RESULTS_LIMIT = 32 * safeio.MIB
#: the longest text shown in a cell of the table
CELL = 40

#: column -> (heading, numeric); the order of the table
COLUMNS: dict[str, tuple[str, bool]] = {
    "name": ("name", False), "model": ("model", False), "data": ("data", False), "epochs": ("epochs", True),
    "top1": ("best top-1", True), "img_per_s": ("img/s", True), "peak_gib": ("peak GiB", True),
    "wall_s": ("wall", True), "status": ("status", False),
}
#: results.csv column -> the range its values may take; one outside is missing, not a number
BOUNDS = {"top1": (0.0, 100.0), "img_per_s": (0.0, 1e9), "mem_reserved_gib": (0.0, 1e5),
          "mem_alloc_gib": (0.0, 1e5), "epoch_s": (0.0, 1e8), "data_wait": (0.0, 1.0), "val_loss": (0.0, 1e9),
          "train_loss": (0.0, 1e9), "epoch": (1.0, 1e5)}


def find_run_dirs(root: Path) -> list[tuple[Path, str | None]]:
    """(folder, why it is unreadable or None) of every run under `root` (itself included), in natural order.
    A link to a folder outside `root` is a row of its own (not followed); one inside it is found under its name."""
    top = os.path.realpath(root)
    found: list[tuple[Path, str | None]] = []
    todo, seen = [(root, 0)], 0
    while todo and seen < MAX_FOLDERS:
        folder, depth = todo.pop()
        seen += 1
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            found.append((folder, f"cannot list it ({e.strerror})"))
            continue
        names = {e.name for e in entries}
        if CONFIG in names or RESULTS in names or runstatus.STATUS in names:
            found.append((folder, None))
            continue
        for e in entries:
            if e.name.startswith(".") or depth >= MAX_DEPTH:
                continue
            if e.is_symlink():
                target = os.path.realpath(e.path)
                if os.path.isdir(target) and not _inside(target, top):
                    found.append((Path(e.path), "a link to a folder outside --log-dir, not followed"))
            elif e.is_dir(follow_symlinks=False):
                todo.append((Path(e.path), depth + 1))
    return sorted(found, key=lambda f: natural_key(_rel(f[0], root)))


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _rel(folder: Path, root: Path) -> str:
    rel = os.path.relpath(folder, root)
    return folder.name if rel == "." else rel


def _own_file(run: Path, name: str) -> Path:
    """run/name, refused (UserError) when it is a link that leads out of the run folder."""
    path = run / name
    if os.path.islink(path) and not _inside(os.path.realpath(path), os.path.realpath(run)):
        raise UserError(f"its {name} is a link out of its folder, not read")
    return path


def number(value: Any, column: str) -> float | None:
    """`value` as a float within BOUNDS[column], else None (NaN, infinite, absurd, not a number)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    lo, hi = BOUNDS.get(column, (-1e12, 1e12))
    return x if math.isfinite(x) and lo <= x <= hi else None


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        return None
    text = printable(str(value).strip())
    return (text if len(text) <= CELL else text[:CELL - 3] + "...") or None


def read_config(run: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(options, notes) of the run's config.yaml: ({}, {}) without one. Raises UserError for one that cannot be
    read (a FIFO, too big, an alias bomb, not UTF-8, a link out of the folder)."""
    path = _own_file(run, CONFIG)
    if not os.path.lexists(path):
        return {}, {}
    try:
        options, text = read_yaml(path)
    except UserError as e:
        raise UserError(f"config.yaml: {str(e).split(', e.g.')[0]}") from None
    except OSError as e:
        raise UserError(f"config.yaml: {e.strerror}") from None
    return options, config_notes(text)


def read_epochs(run: Path) -> list[dict[str, str]]:
    """The rows of the run's results.csv ([] without one), by epoch. Raises UserError for one that cannot be read."""
    path = _own_file(run, RESULTS)
    if not os.path.lexists(path):
        return []
    try:
        data = safeio.read_regular(path, RESULTS_LIMIT, "results.csv")
    except UserError as e:
        raise UserError(str(e).replace(f" {printable(os.fspath(path))}", "").split(";")[0]) from None
    except OSError as e:
        raise UserError(f"results.csv: {e.strerror}") from None
    rows = [r for r in results.parse_rows(data)[1] if number(r.get("epoch"), "epoch") is not None]
    return sorted(rows, key=lambda r: float(r["epoch"]))


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [x for x in (number(r.get(name), name) for r in rows) if x is not None]


def run_row(run: Path, root: Path, unreadable: str | None = None) -> dict[str, Any]:
    """The table's row of one run folder (every key of COLUMNS, plus what --compare reads); never raises."""
    row: dict[str, Any] = {k: None for k in COLUMNS}
    row.update(name=printable(_rel(run, root)), planned=None, path=printable(run))
    if unreadable:
        row["status"] = f"unreadable: {unreadable}"
        return row
    try:
        options, notes = read_config(run)
        epochs = read_epochs(run)
        status = _read_status(run)
    except UserError as e:
        row["status"] = f"unreadable: {printable(e)}"
        return row
    row["options"], row["notes"], row["rows"] = options, notes, epochs
    row["model"] = _text(options.get("model"))
    row["data"] = ("synthetic" if options.get("synthetic") is True else
                   _text(Path(str(options["data"])).name) if isinstance(options.get("data"), str) else
                   _text(notes.get("data")))
    planned = options.get("epochs")
    row["planned"] = int(planned) if isinstance(planned, int) and 0 < planned <= 100_000 else None
    done = int(max(column(epochs, "epoch"), default=0))
    row["epochs"] = done
    top1, speed, wall = column(epochs, "top1"), column(epochs, "img_per_s"), column(epochs, "epoch_s")
    peaks = column(epochs, "mem_reserved_gib") or column(epochs, "mem_alloc_gib")
    row["top1"] = max(top1) if top1 else None
    row["img_per_s"] = speed[-1] if speed else None
    row["peak_gib"] = max(peaks) if peaks else None
    row["wall_s"] = sum(wall) if wall else None
    row["status"] = _status_text(run, status, done, row["planned"])
    return row


def _read_status(run: Path) -> tuple[str, str] | None:
    path = _own_file(run, runstatus.STATUS)
    if not os.path.lexists(path):
        return None
    try:
        return runstatus.read_status(run, load_yaml(path))
    except UserError as e:
        raise UserError(f"status.yaml: {str(e).split(', e.g.')[0]}") from None


def _status_text(run: Path, status: tuple[str, str] | None, done: int, planned: int | None) -> str:
    if status is not None:
        state, line = status
        return f"{state}: {line}" if line and state != "finished" else state
    if runstatus.lock_held(run):
        return "running"
    if planned is not None and done >= planned:
        return "finished"
    if os.path.lexists(run / LAST):  # a run of a version that wrote no status.yaml
        return f"stopped: resume with dlenv train --resume {printable(run / LAST)}"
    return "ended before its first save" if done == 0 else "stopped"


def collect(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every run's row under `log_dir`. Raises UserError when it is no folder or holds no run."""
    root = Path(log_dir)
    need_folder(root, "--log-dir", "pass the folder of your runs (e.g. runs)")
    found = find_run_dirs(root)
    if not found:
        raise UserError(f"--log-dir {printable(root)}: no run folder (config.yaml or results.csv) in it or its "
                        "subfolders; train a run first (dlenv train) or pass the folder that holds runs/<name>/")
    return [run_row(run, root, why) for run, why in found]
