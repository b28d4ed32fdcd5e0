"""Code a weights file names: when it is imported, and the factory arguments it gives, bounded.

A dlenv run file of a model of your own records where the model came from: `model_name`
("models/net.py:build") and `model_source` ({ref, sha256, args, file}; dlenv.model.usermodel.provenance).
val, prune, export and --resume rebuild the model from it, which means importing a file, which runs its
code. A file someone sends could name any file. So:

- a reference the user typed with --model is the user's choice, and used;
- a reference read from the file is imported only when it is the model this project trained with
  (`project_model`): a relative path without `..` (or a package.module found in the working folder)
  whose files all lie inside the working folder with symlinks resolved, none under data/ (where
  `unpack` puts what archives hold) nor in any folder `unpack` made elsewhere (its `.dlenv-unpacked`
  marker in that folder or an ancestor, as written or with symlinks resolved), and whose file is byte
  for byte the one the run recorded (the sha256 in model_source);
- anything else (absolute, `..`, `~`, a symlink out, data/, an unpacked folder, an installed module, a
  changed file, a reference without a model_source) is refused in one line before any import, naming
  --model as the way to vouch for it.

The factory arguments a file gives are bounded (`read_source`). No torch import at module level.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dlenv.errors import UserError
from dlenv.files.safeio import UNPACKED_MARKER
from dlenv.model.usermodel import (
    Reference,
    build,
    file_sha256,
    is_reference,
    load,
    parse_reference,
    same_reference,
    shown,
)
from dlenv.options.declare import IMG_SIZE_MAX  # the bound run-state files keep too (files.runstate.MAX_IMG_SIZE)

log = logging.getLogger(__name__)

#: where `unpack` writes by default: code under it came out of an archive, not from the project's author
DATA_DIR = "data"
#: bounds on factory arguments read from a file (typed ones are the user's own)
MAX_ARGS = 32
MAX_INT = 65536
MAX_FLOAT = 1e6
MAX_TEXT = 256


def _arg_ok(v: Any) -> bool:
    if isinstance(v, bool) or v is None:
        return True
    if isinstance(v, int):
        return abs(v) <= MAX_INT
    if isinstance(v, float):
        return v == v and abs(v) <= MAX_FLOAT
    return isinstance(v, str) and len(v) <= MAX_TEXT


def read_source(source: Any, what: str) -> tuple[str, str | None, dict[str, Any]]:
    """(reference, sha256 or None, factory arguments) of a file's model_source entry, every value
    bounded. Raises UserError naming the entry, the value and the bound."""
    if not (isinstance(source, dict) and isinstance(source.get("ref"), str) and len(source["ref"]) <= MAX_TEXT
            and isinstance(source.get("args") or {}, dict)):
        raise UserError(f"{what}: its 'model_source' entry is malformed; pass the model again with "
                        "--model FILE.py:factory")
    sha = source.get("sha256")
    args = dict(source.get("args") or {})
    if len(args) > MAX_ARGS:
        raise UserError(f"{what}: its model_source gives {len(args)} factory arguments, more than {MAX_ARGS}; "
                        "the file was edited or damaged, use another run file")
    for k, v in args.items():
        # num_classes comes from the run file's own (bounded) entry, never from here. img_size is what
        # the trainer gave a factory that takes one (dlenv.model.models.factory_kwargs) and so is in every such
        # record; it is a size the model is built to (a ViT's position table), bounded as one.
        if not (isinstance(k, str) and k.isidentifier() and k != "num_classes"):
            raise UserError(f"{what}: its model_source names the factory argument {str(k)[:40]!r}, not a keyword "
                            "argument name; the file was edited or damaged, use another run file")
        if k == "img_size":
            if not (isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= IMG_SIZE_MAX):
                raise UserError(f"{what}: its model_source gives img_size={repr(v)[:40]}, not an image size of 16 "
                                f"to {IMG_SIZE_MAX} pixels; the file was edited or damaged, use another run file")
            continue
        if not _arg_ok(v):
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise UserError(f"{what}: its model_source gives {k}={shown}, beyond the bounds for a value read "
                            f"from a file (numbers within +-{MAX_INT} (integers) or +-{MAX_FLOAT:g}, text up to "
                            f"{MAX_TEXT} characters); the file was edited or damaged, use another run file")
    return source["ref"], sha if isinstance(sha, str) else None, args


def _module_files(target: str) -> list[Path] | None:
    """The files importing `target` (a.b.c) from the working folder would run (a/__init__.py,
    a/b/__init__.py, a/b/c.py), found without running any of them; None when it is not there."""
    from importlib.machinery import PathFinder

    search: list[str] | None = [str(Path.cwd())]
    parts = target.split(".")
    files = []
    for n in range(1, len(parts) + 1):
        spec = PathFinder.find_spec(".".join(parts[:n]), search)
        if spec is None or not spec.has_location or not spec.origin:
            return None  # not in the project folder, or a namespace package
        files.append(Path(spec.origin))
        search = list(spec.submodule_search_locations or [])
        if n < len(parts) and not search:
            return None
    return files


def _unpacked_folder(*paths: Path) -> Path | None:
    """The folder `dlenv unpack` made (its marker file in that folder) that holds any of `paths`, or
    None. Every ancestor up to the file system's root is looked at, not only those below the working
    folder: a user may run from inside an unpacked tree. The marker counts in any form (a file, a
    folder, a dangling link); one an archive put deeper down only makes the rule stricter."""
    for path in paths:
        for folder in path.parents:
            if os.path.lexists(folder / UNPACKED_MARKER):
                return folder
    return None


def project_model(ref: Reference, sha: str | None) -> str | None:
    """Why the reference `ref` read from a file is not the model this project trained with (see the
    module doc), or None when it is. Runs nothing: reads paths and the file's bytes only."""
    cwd = Path.cwd().resolve()
    if ref.is_file:
        rel = Path(ref.target)
        if rel.is_absolute() or ref.target.startswith("~"):
            return "an absolute path"
        if ".." in rel.parts:
            return "a path that climbs out of the working folder with '..'"
        files: list[Path] | None = [cwd / rel]
    else:
        files = _module_files(ref.target)
        if files is None:
            return f"a module not found in the working folder {cwd}"
    for f in files:
        if not f.is_file():
            return f"{shown(f)} not found in the working folder {cwd}"
        real = f.resolve()
        if not real.is_relative_to(cwd):
            return f"{shown(f)}, which leads outside the working folder {cwd}"
        if real.relative_to(cwd).parts[:1] == (DATA_DIR,):
            return f"{shown(real)}, under {DATA_DIR}/ where unpacked archives go"
        unpacked = _unpacked_folder(real, f.absolute())
        if unpacked:
            return f"{shown(real)}, inside {shown(unpacked)}/, which `dlenv unpack` wrote from an archive"
    if not sha:
        return "without the sha256 of the file it was trained with"
    if file_sha256(files[-1]) != sha:
        return (f"and {shown(files[-1])} is not the file it was trained with (sha256 {sha[:12]} then, "
                f"{file_sha256(files[-1])[:12]} now)")
    return None


def check_source(source: Any, given: str | None, what: str) -> Reference:
    """The import rule for a file's model source; returns the reference to build (nothing imported yet).

    A reference `given` with --model is the user's choice and used (a one-line warning when its file
    differs from the recorded one); else the file's own is used only when `project_model` accepts it.
    Raises UserError, naming why and --model as the way to vouch for it."""
    saved, sha, _ = read_source(source, what)
    if given and is_reference(given):
        ref = parse_reference(given)
        now = load(ref).sha256
        if sha and now and now != sha:
            log.warning("%s: %s differs from the file this run was trained with (sha256 %s then, %s now); "
                        "building the model from it as it is", what, ref.target, sha[:12], now[:12])
        return ref
    ref = parse_reference(saved)
    why = project_model(ref, sha)
    if why:
        raise UserError(f"{what} names --model {saved}, {why}; importing it would run its code, so it is not "
                        f"imported. If you trust it, pass --model {saved} (or where that file is now) yourself")
    return ref


def rebuild(source: Any, name: str, num_classes: int, given: str | None, what: str) -> Any:
    """A run file's model of your own, from its factory and recorded arguments, after `check_source`.
    Without a source (a bare state dict, a file that names a reference but not its origin) only a
    reference the user gave with --model is built."""
    if source is not None:  # the import rule first, then the recorded arguments, then the one call
        ref, args = check_source(source, given, what).text, read_source(source, what)[2]
    elif given and is_reference(given):
        ref, args = given, {}
    else:
        raise UserError(f"{what} names --model {name} but not where it came from (no model_source); "
                        f"importing it would run its code, so it is not imported. If you trust it, pass "
                        f"--model {name} yourself")
    return build(ref, num_classes, **args)


def check_resume(run_file: Any, given: str | None, what: str) -> None:
    """The rule before a resume builds the saved run's model. A resume builds the model its saved options
    name (config's `model`), whatever --model says, so that reference is the one checked: it passes
    when --model names it again (in any spelling), or when it is the reference model_source records and
    `project_model` accepts that. Raises UserError otherwise (nothing imported)."""
    if not isinstance(run_file, dict):
        return
    config = run_file.get("config") if isinstance(run_file.get("config"), dict) else {}
    target = config.get("model", run_file.get("model_name"))
    if not is_reference(target):
        return  # a torchvision or timm name: no code of the file's
    if given and is_reference(given) and same_reference(parse_reference(given), parse_reference(target)):
        check_source(run_file.get("model_source") or {"ref": target}, target, what)  # vouched for: used
        return
    source = run_file.get("model_source")
    if not source:
        rebuild(None, target, 1, None, what)  # refuses: a reference with no record of its origin
    saved, _, _ = read_source(source, what)
    if not same_reference(parse_reference(saved), parse_reference(target)):
        raise UserError(f"{what} would build --model {target}, but records where {saved} came from, not "
                        f"{target}; importing it would run its code, so it is not imported. If you trust it, "
                        f"pass --model {target} yourself")
    check_source(source, None, what)
