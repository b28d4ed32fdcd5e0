"""The options of `dlenv watch`, declared once (dlenv.options.config registers the command; the CLI and the invoke
tasks are generated from this class as from config.py's). The command itself comes after `--` on the
command line (dlenv.cli puts it into `run`), or as one string in `--run` (invoke, a --cfg file). No torch
here: `dlenv --help` and `invoke --list` import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlenv.options.declare import opt
from dlenv.options.values import command_words, folder_name


@dataclass(frozen=True)
class WatchConfig:
    """Options of `watch`."""

    run: tuple = opt((), "the command to run and watch: everything after -- (dlenv watch -- python train.py), or "
                         "one quoted string (invoke watch --run 'python train.py')", parse=command_words)
    interval: float = opt(1.0, "seconds between samples", min=0.1, max=60.0)
    project: str = opt("runs/watch", "folder of the watch records")
    name: str = opt("exp", "record folder name (exp, exp2, ... when taken)", parse=folder_name)
    exist_ok: bool = opt(False, "write into an existing record folder of that name")
