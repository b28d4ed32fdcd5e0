"""`python -m dlenv VERB ...`: the `dlenv` command, once the working folder cannot stand in for its modules.

`python -m` puts the working folder first on sys.path, so an `argparse.py`, `yaml/` or `numpy.py` lying
there (an unpacked archive's, a colleague's) would be imported in place of the real one. Before anything
more is imported this start looks: a module in the working folder that would take the place of one of
Python's own or an installed one ends it in one line, exit 2; otherwise the working folder leaves
sys.path, so `python -m dlenv` imports exactly what the `dlenv` command imports. A `dlenv/` package in
the working folder is imported instead of this file, so nothing here can catch that one: the docs and
every hint name the `dlenv` command (or `python -P -m dlenv`, `python -I -m dlenv` on 3.10), never plain
`python -m dlenv`. Only modules Python loaded before this file ran are used here (os, sys, importlib's).
"""

import importlib.machinery
import os
import sys


def _module_in(entry: os.DirEntry) -> str | None:
    """The top-level module a working-folder entry would be imported as (a package or a module file), or None."""
    if entry.is_dir():
        inits = (os.path.join(entry.path, "__init__" + s) for s in importlib.machinery.all_suffixes())
        return entry.name if any(os.path.isfile(p) for p in inits) else None  # no __init__: never ahead of a real one
    for suffix in importlib.machinery.all_suffixes():
        if entry.name.endswith(suffix) and len(entry.name) > len(suffix):
            stem = entry.name[: -len(suffix)]
            return stem if stem.isidentifier() else None
    return None


def _takes_the_place(name: str, path: str) -> bool:
    """Whether module `name` in the working folder (at `path`) hides another: one of Python's own, or one
    found without the working folder (sys.path has lost it by now) at another place."""
    if name in sys.builtin_module_names:  # built in: found before any folder is looked at
        return False
    if name in getattr(sys, "stdlib_module_names", ()):
        return True
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(name, None) if find else None
        except Exception:  # noqa: BLE001 (a third-party finder's fault is not this folder's)
            continue
        if spec is not None:
            origin = spec.origin or (list(spec.submodule_search_locations or ()) or [""])[0]
            here = os.path.realpath(path)
            return not (os.path.realpath(origin) == here or os.path.realpath(origin).startswith(here + os.sep))
    return False


def _shown(name: str) -> str:
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in name)


def refuse_a_shadowing_folder() -> int | None:
    """Drop the working folder from sys.path when `python -m` put it there; returns 2 after one line on stderr
    when it holds a module that would have taken another's place, None when the start may go on."""
    if not sys.path:
        return None
    try:
        cwd = os.getcwd()
        first_is_cwd = sys.path[0] == "" or os.path.samefile(sys.path[0], cwd)
    except OSError:
        return None
    if not first_is_cwd:  # -P, -I, PYTHONSAFEPATH, or a start that did not add it
        return None
    del sys.path[0]
    try:
        with os.scandir(cwd) as entries:
            found = [(m, e.name + ("/" if e.is_dir() else "")) for e in entries
                     if (m := _module_in(e)) and _takes_the_place(m, e.path)]
    except OSError:
        return None
    if not found:
        return None
    found.sort()
    names = ", ".join(_shown(f) for _, f in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    print(f"dlenv: error: the working folder {_shown(cwd)} holds {names}, which `python -m dlenv` would import in "
          f"place of the real {_shown(found[0][0])}; run the dlenv command (`dlenv VERB`, which never imports from "
          "the working folder), or start from another folder", file=sys.stderr)
    return 2


if __name__ == "__main__":
    refused = refuse_a_shadowing_folder()
    if refused is not None:
        raise SystemExit(refused)
    from dlenv.cli import main

    raise SystemExit(main())
