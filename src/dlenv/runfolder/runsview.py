"""What `dlenv runs` prints: the table of the rows dlenv.runfolder.runs read, sorted (--sort), the data behind it
(--format csv|json), or two runs compared (--compare A B).

The comparison has three parts: the options and the decisions (config.yaml's options and its `# key: value` notes,
what auto chose) that differ; the final metrics; and where each run's time went (wall time, the share spent
waiting for data from results.csv's data_wait, and the compile decision: results.csv records no compile time).
As text, or as the rows (part, key, A, B) in CSV or JSON. No torch here.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from dlenv.errors import UserError, printable
from dlenv.options.typos import word_hint
from dlenv.runfolder import runs
from dlenv.runfolder.plots import natural_key

#: what else --sort takes for a column
ALIASES = {"top-1": "top1", "best_top1": "top1", "img/s": "img_per_s", "imgs": "img_per_s", "peak": "peak_gib",
           "memory": "peak_gib", "mem": "peak_gib", "wall": "wall_s", "time": "wall_s"}

def sort_key(column: str) -> str:
    """The column --sort names (a heading or an alias too). Raises UserError with the closest one."""
    name = column.strip().lower().replace(" ", "_")
    name = ALIASES.get(name, name)
    if name in runs.COLUMNS:
        return name
    raise UserError(f"--sort {printable(column)!r} is not a column{word_hint(column, runs.COLUMNS)} (columns: "
                    f"{', '.join(runs.COLUMNS)})")


def sorted_rows(rows: list[dict[str, Any]], column: str) -> list[dict[str, Any]]:
    """`rows` by `column`: numbers largest first, text in natural order; missing values last."""
    numeric = runs.COLUMNS[column][1]
    have = [r for r in rows if r[column] is not None]
    missing = [r for r in rows if r[column] is None]
    if numeric:
        return sorted(have, key=lambda r: -r[column]) + missing
    return sorted(have, key=lambda r: natural_key(str(r[column]))) + missing


def cell(row: dict[str, Any], column: str) -> str:
    """How the table shows one value."""
    v = row[column]
    if column == "epochs":
        return f"{v if v is not None else '?'}/{row['planned'] if row['planned'] is not None else '?'}"
    if v is None:
        return "-"
    if column == "top1":
        return f"{v:.2f}"
    if column == "img_per_s":
        return f"{v:,.0f}"
    if column == "peak_gib":
        return f"{v:.2f}"
    if column == "wall_s":
        return clock(v)
    return str(v)


def clock(seconds: float) -> str:
    """'1:02:03' (h:mm:ss), '2:03' under an hour."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table, the status last and unpadded."""
    lines = [[runs.COLUMNS[c][0] for c in runs.COLUMNS]] + [[cell(r, c) for c in runs.COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(runs.COLUMNS) - 1)]
    numeric = [runs.COLUMNS[c][1] for c in runs.COLUMNS]
    out = []
    for line in lines:
        cells = [(v.rjust(w) if numeric[i] else v.ljust(w)) for i, (v, w) in enumerate(zip(line, widths, strict=False))]
        out.append("  ".join([*cells, line[-1]]))
    return "\n".join(out)


def records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data behind the table: one plain dict a run (epochs done and planned apart)."""
    keys = ["name", "model", "data", "epochs", "planned", "top1", "img_per_s", "peak_gib", "wall_s", "status"]
    return [{k: r.get(k) for k in keys} for r in rows]


def as_csv(items: list[dict[str, Any]]) -> str:
    """`items` (dicts of one set of keys) as CSV text with a header."""
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=list(items[0]) if items else [], lineterminator="\n")
    w.writeheader()
    w.writerows({k: "" if v is None else v for k, v in item.items()} for item in items)
    return text.getvalue()


def main(cfg: Any) -> int:
    """`dlenv runs`: print the table (or --compare A B, or --format csv/json); returns 0."""
    column = sort_key(cfg.sort) if cfg.sort else None  # a typo is said before any folder is read
    rows = runs.collect(cfg.log_dir)
    if cfg.compare:
        print(show_compare(rows, cfg.compare, cfg.format), end="")
        return 0
    if column:
        rows = sorted_rows(rows, column)
    if cfg.format == "json":
        print(json.dumps(records(rows), indent=1))
    elif cfg.format == "csv":
        print(as_csv(records(rows)), end="")
    else:
        print(table(rows))
    return 0


#: the notes that differ from run to run whatever was asked (when it started), left out of the comparison
_ALWAYS_DIFFER = {"started", "name"}


def pick(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The row of the run named `name` (its name under --log-dir, or its folder's last part). Raises UserError
    with the closest name; for a run that could not be read, with why."""
    wanted = printable(name.strip().rstrip("/"))
    found = [r for r in rows if r["name"] == wanted] or [r for r in rows if r["name"].rsplit("/", 1)[-1] == wanted]
    if not found:
        near = word_hint(wanted, [r["name"] for r in rows])
        raise UserError(f"--compare {wanted!r}: no such run under --log-dir{near}; dlenv runs lists them")
    row = found[0]
    if "options" not in row:
        raise UserError(f"--compare {wanted!r}: the run cannot be read ({row['status']}); compare another")
    return row


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        value = json.dumps(value, default=str)
    text = printable(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _final(row: dict[str, Any]) -> dict[str, Any]:
    last = row["rows"][-1] if row["rows"] else {}
    return {
        "epochs": cell(row, "epochs"), "best top-1": cell(row, "top1"),
        "last top-1": _fmt(runs.number(last.get("top1"), "top1"), "{:.2f}"),
        "last val loss": _fmt(runs.number(last.get("val_loss"), "val_loss"), "{:.4f}"),
        "img/s": cell(row, "img_per_s"), "peak GiB": cell(row, "peak_gib"), "status": row["status"]}


def _time(row: dict[str, Any]) -> dict[str, Any]:
    wall = sum(runs.column(row["rows"], "epoch_s"))
    waits = [(runs.number(r.get("data_wait"), "data_wait"), runs.number(r.get("epoch_s"), "epoch_s"))
             for r in row["rows"]]
    waited = sum(w * s for w, s in waits if w is not None and s is not None)
    return {"wall": clock(wall) if row["rows"] else "-",
            "waiting for data": f"{clock(waited)} ({100 * waited / wall:.0f}%)" if wall else "-",
            "compile": _shown(row["notes"].get("compile_rule") or row["options"].get("compile")),
            "compile time": "not recorded in results.csv"}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else spec.format(x)


def comparison(rows: list[dict[str, Any]], names: tuple[str, str]) -> list[tuple[str, str, str, str]]:
    """(part, key, A's, B's) of the two runs: options and decisions that differ, final metrics, time."""
    a, b = pick(rows, names[0]), pick(rows, names[1])
    out: list[tuple[str, str, str, str]] = []
    for part, key in (("option", "options"), ("decision", "notes")):
        keys = [k for k in {**a[key], **b[key]} if k not in _ALWAYS_DIFFER]
        for k in sorted(keys, key=str):
            va, vb = a[key].get(k), b[key].get(k)
            if va != vb:
                out.append((part, printable(k), _shown(va), _shown(vb)))
    for part, of in (("final", _final), ("time", _time)):
        fa, fb = of(a), of(b)
        out += [(part, k, str(fa[k]), str(fb[k])) for k in fa]
    return out


def show_compare(rows: list[dict[str, Any]], names: tuple[str, str], fmt: str = "table") -> str:
    """The comparison of runs `names` as text (fmt "table"), CSV or JSON."""
    found = comparison(rows, names)
    a, b = (printable(n.strip().rstrip("/")) for n in names)
    if fmt == "json":
        return json.dumps([dict(zip(("part", "key", a, b), r, strict=False)) for r in found], indent=1) + "\n"
    if fmt == "csv":
        return as_csv([dict(zip(("part", "key", "a", "b"), r, strict=False)) for r in found])
    titles = {"option": "options that differ", "decision": "decisions that differ (config.yaml's notes)",
              "final": "final metrics", "time": "where the time went"}
    width = max([len(r[1]) for r in found] + [10])
    wa = max([len(r[2]) for r in found] + [len(a)])
    lines = [f"{'':<{width}}  {a:<{wa}}  {b}"]
    for part, title in titles.items():
        mine = [r for r in found if r[0] == part]
        if part in ("option", "decision") and not mine:
            lines.append(f"{title}: none")
            continue
        lines.append(f"{title}:")
        lines += [f"{k:<{width}}  {va:<{wa}}  {vb}" for _, k, va, vb in mine]
    return "\n".join(lines) + "\n"
