"""The options of the run-folder verbs, `dlenv plot` and `dlenv runs`, declared once (dlenv.options.config
registers the commands; the CLI and the invoke tasks are generated from these classes as from every other).

They live beside config.py because that module is at its size limit. No torch here: `dlenv --help` and
`invoke --list` import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlenv.options.declare import opt
from dlenv.options.values import parse_str


def two_runs(v: Any) -> tuple[str, str] | None:
    """--compare A B (the CLI gives a list), 'A,B' or 'A B' (invoke, a --cfg file): the two run names."""
    if v is None:
        return None
    parts = [parse_str(x) for x in v] if isinstance(v, (list, tuple)) else str(v).replace(",", " ").split()
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ValueError("two run names, e.g. --compare exp exp2")
    return parts[0], parts[1]


@dataclass(frozen=True)
class PlotConfig:
    """Options of `plot`."""

    log_dir: str = opt("runs", "folder of runs (each with results.csv), or one run folder")


@dataclass(frozen=True)
class RunsConfig:
    """Options of `runs`."""

    log_dir: str = opt("runs", "folder of runs (each with config.yaml or results.csv), or one run folder")
    sort: str | None = opt(None, "sort by a column: name, model, data, epochs, top1, img_per_s, peak_gib, wall_s, "
                                 "status (numbers largest first)", parse=parse_str)
    compare: tuple[str, str] | None = opt(None, "two runs side by side: the options and decisions that differ, "
                                                "the final metrics, where the time went", parse=two_runs, nargs=2)
    format: str = opt("table", "table, or csv or json: the data behind it", choices=("table", "csv", "json"))
