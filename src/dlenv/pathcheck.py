"""Every path option checked before PyTorch loads, so that a typo is answered in a moment, not after the
seconds PyTorch takes to import (34 s on a loaded 2-core machine), and with the near name when there is one:
"--data data/digts: no such file or folder; did you mean data/digits?".

`check(command, cfg)` is called by the CLI between building the config and importing the command (and
`must_exist("--cfg", FILE)` before the build):
it raises UserError for an input that is not there (--data, --weights, --source, --log-dir, --resume,
--model FILE.py, --cfg, ...), for an output under a regular file (--out, --project), and for `train` without
--data in a workspace of several datasets (dlenv.data.demo.default_data). It returns the config with a bare
`--weights best_model.pth` resolved to the newest run's file (dlenv.runfolder.find_weights) and prints the
line that says which. A near miss names what was meant: `--weights best_modle.pth` the newest run's
best_model.pth (before a file of the folder that is less near), `--data ./dataset/val` (a path from another
tutorial) the dataset under data/ that holds val/ (--data takes the dataset root), `--model resnet-18` resnet18
(dlenv.model.modelnames, torchvision's names read without torch). What a file holds is judged later, by the
command that reads it. No torch here.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import itertools
import os
from pathlib import Path
from typing import Any

from dlenv import archives
from dlenv.errors import UserError, printable
from dlenv.model import modelnames
from dlenv.options import typos

#: command -> the options that name an input that must exist (a file or a folder)
INPUTS: dict[str, tuple[str, ...]] = {
    "data-report": ("dir",),
    "train": ("data", "resume", "weights"),
    "val": ("weights", "data"),
    "prune": ("weights", "data"),
    "export": ("weights", "data"),
    "predict": ("weights", "source"),
    "plot": ("log_dir",),
    "bench-data": ("data",),
    "unpack": ("archive",),
}
#: command -> the options that name an output (made if missing, but not under a regular file)
OUTPUTS: dict[str, tuple[str, ...]] = {
    "train": ("project", "cache_dir"), "val": ("out",), "prune": ("out",), "export": ("out",),
    "predict": ("project",), "bench-memory": ("out",), "bench-data": ("cache_dir",), "demo-data": ("dest",),
    "unpack": ("dest",),
}
#: what to do about a missing input that has no near name
FIXES = {
    "data": "pass a folder of class folders (or with train/ and val/), or unpack an archive first",
    "dir": "pass a folder of class folders (or with train/ and val/)",
    "weights": "pass the path of a .pth file (e.g. runs/exp/best_model.pth)",
    "resume": "pass a last.pth path (e.g. runs/exp/last.pth) or --resume auto",
    "source": "pass an image, a folder, a glob, a video or - (paths on stdin)",
    "log_dir": "pass the folder of your runs (e.g. runs)",
    "archive": f"pass the path of a {archives.suffixes_said()} file (e.g. data/pets.zip)",
}
#: what a missing input is called
WHAT = {"data": "no such folder", "dir": "no such folder", "log_dir": "no such folder", "weights": "not found",
        "resume": "no such run file", "archive": "no such file"}
#: where else a missing input is looked for: `dlenv unpack pets.zip` may mean data/pets.zip
ALSO_UNDER = {"archive": "data"}
#: the commands that read a trained model's file: a bare best_model.pth / last.pth is the newest run's
RUN_FILES = ("val", "predict", "prune", "export")
#: train's --weights names a file when it looks like one (a bare word like DEFAULT is the models' to explain)
_WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".pkl", ".tar")


def check(command: str, cfg: Any, say: Any = print) -> Any:
    """`cfg` with its path options checked (see the module doc); the same object when nothing was resolved.

    Raises UserError naming the option, the path and, where a near name exists, the one that was meant."""
    modelnames.check_early(getattr(cfg, "model", None))  # `--model resnet-18`: did you mean resnet18?
    if command in RUN_FILES and getattr(cfg, "weights", None):
        from dlenv.runfolder import find_weights

        _run_file_typo(cfg.weights)
        path, line = find_weights(cfg.weights)
        if line:
            say(line)
            cfg = dataclasses.replace(cfg, weights=str(path))
    for name in INPUTS.get(command, ()):
        value = getattr(cfg, name, None)
        if value is None or not _checked(command, name, str(value)):
            continue
        if name == "data":
            _split_for_root(str(value))
        must_exist(_flag(name), str(value), FIXES.get(name), what=WHAT.get(name, "no such file or folder"),
                   also_under=ALSO_UNDER.get(name))
    model = getattr(cfg, "model", None)
    if isinstance(model, str) and ":" in model and model.rpartition(":")[0].endswith(".py"):
        must_exist("--model", model.rpartition(":")[0], "pass FILE.py:factory with the file's path "
                   "(e.g. models/net.py:build)", shown=model, tail=":" + model.rpartition(":")[2], what="no such file")
    for name in OUTPUTS.get(command, ()):
        value = getattr(cfg, name, None)
        if value is not None:
            _under_file(_flag(name), str(value))
    if command == "train" and getattr(cfg, "resume", None) is None:
        from dlenv.data.demo import default_data  # no torch; raises for several datasets under data/

        default_data(cfg.data, cfg.synthetic)
    return cfg


def _run_file_typo(weights: str) -> None:
    """Raise UserError for a bare name close to a run file's (`best_modle.pth`) that is no file here, naming the
    newest run's file (dlenv.runfolder.find_weights), before any other file of the folder."""
    from dlenv.runfolder import BEST, LAST, find_weights

    path = Path(weights)
    if os.path.lexists(path) or path.parent != Path(".") or path.name in (BEST, LAST):
        return
    near = typos.closest(path.name, (BEST, LAST))
    here = did_you_mean(weights)
    if near is None or (here and typos.likeness(path.name, here) > typos.likeness(path.name, near)):
        return  # a file of the folder is nearer (`my_modle.pth`): must_exist names it
    try:
        found, _ = find_weights(near)
    except UserError:  # no run has it: the folder's own near names answer (must_exist)
        return
    raise UserError(f"--weights {printable(weights)}: not found; did you mean {near}? (the newest run's is "
                    f"{printable(str(found))})")


#: the folders a dataset root holds, which a path from another tutorial often ends in (`./dataset/val`)
SPLITS = ("train", "val", "valid", "validation", "test")
#: where datasets are unpacked (dlenv.data.unpack), and how many of its entries are looked at
DATA_ROOT, _MOST_DATASETS = "data", 1000


def _split_for_root(value: str) -> None:
    """Raise UserError for a missing --data that ends in a split (`./dataset/val`), with no near path of its own,
    when a dataset under data/ has that split: --data takes the dataset root."""
    path = Path(value)
    if os.path.lexists(path) or path.name.lower() not in SPLITS or did_you_mean(value):
        return  # there, or a near miss of its own (`dta/digts/train`) that must_exist names
    try:
        with os.scandir(DATA_ROOT) as it:
            roots = sorted(e.name for e in itertools.islice(it, _MOST_DATASETS) if not e.name.startswith("."))
    except OSError:
        return
    have = [r for r in roots if os.path.isdir(os.path.join(DATA_ROOT, r, path.name))]
    if not have:
        return
    named = [f"{DATA_ROOT}/{printable(r)}" for r in have[:3]] + (["..."] if len(have) > 3 else [])
    there = f"{named[0]}/{path.name} is there" if len(have) == 1 else f"each holds {path.name}/"
    raise UserError(f"--data {printable(value)}: no such folder; did you mean {' or '.join(named)}? (--data takes "
                    f"the dataset root, the folder that holds train/ and val/; {there})")


def _checked(command: str, name: str, value: str) -> bool:
    """Whether an input's value is a path to check (not --resume auto, --source - or a glob, train's
    --weights DEFAULT, a URL)."""
    if "://" in value:
        return False
    if name == "resume":
        return value.strip().lower() != "auto"
    if name == "source":
        return value != "-" and not glob.has_magic(value)
    if name == "weights" and command == "train":
        return os.sep in value or value.lower().endswith(_WEIGHT_SUFFIXES)
    return True


def must_exist(flag: str, path: str, fix: str | None = None, shown: str | None = None, tail: str = "",
               what: str = "no such file or folder", also_under: str | None = None) -> None:
    """Raise UserError unless `path` exists: "FLAG PATH: no such file or folder; did you mean NEAR?" (a near
    name of each missing part among its siblings, when every part has one; else, for a relative path, the
    same under the folder `also_under`), else "...; FIX"."""
    if os.path.lexists(path):
        return
    near = did_you_mean(path)
    if near is None and also_under and not os.path.isabs(path):
        near = did_you_mean(os.path.join(also_under, path))
    if near:
        hint = f"did you mean {printable(near + tail)}?"
    else:
        hint = fix or f"paths are relative to {printable(os.getcwd())}"
    raise UserError(f"{flag} {printable(shown or path)}: {what}; {hint}")


def did_you_mean(path: str) -> str | None:
    """`path` with each missing part replaced by the closest name beside it (difflib), when that gives a
    path that exists; else None."""
    parts = list(Path(path).parts)
    for i, part in enumerate(parts):
        here = Path(*parts[: i + 1])
        if os.path.lexists(here):
            continue
        parent = Path(*parts[:i]) if i else Path(".")
        try:
            with os.scandir(parent) as it:
                names = [e.name for e in it if not e.name.startswith(".")]
        except OSError:
            return None
        match = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        if not match:
            return None
        parts[i] = match[0]
    return str(Path(*parts))


def _under_file(flag: str, path: str) -> None:
    """Raise UserError when an output path goes through a regular file (it could never be made)."""
    for parent in Path(path).parents:
        if parent.is_file():
            raise UserError(f"cannot create {flag} folder {printable(path)}: {printable(str(parent))} is a file, "
                            "so nothing can be written under it; choose another path")


#: how a line names a positional input (data-report's folder, unpack's archive): it has no flag
POSITIONAL = {"dir": "dataset folder", "archive": "archive"}


def _flag(name: str) -> str:
    return POSITIONAL.get(name) or "--" + name.replace("_", "-")
