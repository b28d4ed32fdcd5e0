"""The image's PyTorch stack, kept as built: what it is, pins that hold it exactly, and a check by content
that a folder pip installed into (the user site a project's requirements.txt goes to) holds none of it.

Pins alone are not a wall: PEP 440 lets `torch==1.13.1` accept `1.13.1+evil` (a local label is ignored
when the pin has none), a direct URL or a path names no version at all, and a wheel can ship a `torch/`
folder under any distribution name. So:

- `protected_stack` reads the stack from the installed distributions' own metadata (importlib.metadata,
  never a table): torch, torchvision, torchaudio and NumPy, plus every distribution torch's metadata
  pins with `==` (its CUDA libraries, triton): torch was built and checked against exactly those. Each
  is held at its installed version string (`pin_lines`: `===` when it has no local label, so
  `+evil` is not the same version; `==1.13.1+cu117` when it has one, which PEP 440 compares exactly).
- `requirement_names` says which distribution a requirements line installs, URL and path lines
  included (parsed with `packaging`, the library pip vendors), so such a line is judged by its name.
- `intruders` looks at what is in the folder after pip ran: a distribution of the stack by name, one
  whose files hold a top-level module of the stack, and a loose module of the stack no distribution
  owns. `remove` deletes each one's files (its RECORD's, never a file outside the folder or reached
  through a link that leaves it), so the next `import torch` finds the image's.
- `shadowed` asks a fresh interpreter (user site on, as the container's command runs) where each
  module of the stack would be imported from; anything but the image's copy (an editable install's
  finder, a `.pth` that adds a folder) is reported, and the caller sets the folder aside.
No torch here: only metadata and files are read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from importlib import machinery, metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)

#: the PyTorch stack and the NumPy it was built against; torch's own `==` dependencies are added to these
PROTECTED = ("torch", "torchvision", "torchaudio", "numpy")
#: what the interpreter asked in `shadowed` may take (it only starts Python and looks up specs)
SHADOW_CHECK_S = 60


@dataclass(frozen=True)
class Stack:
    """The protected distributions ({canonical name: installed version}) and their top-level modules."""

    versions: dict[str, str]
    modules: frozenset[str] = frozenset()


@dataclass
class Intruder:
    """Something in the user site that would take the stack's place: `what` for the line, `paths` to remove."""

    what: str
    paths: list[Path] = field(default_factory=list)


def user_site(base: Path) -> Path:
    """The site-packages of pip's user scheme under `base` (what `pip install --user` fills)."""
    return Path(sysconfig.get_path("purelib", scheme="posix_user", vars={"userbase": str(base)}))


def image_paths(base: Path | None) -> list[str]:
    """sys.path without the user site and the working folder: where the image's own packages are."""
    drop = {os.path.realpath(user_site(base))} if base is not None else set()
    return [p for p in sys.path if p and os.path.realpath(p) not in drop]


def _top_modules(dist: metadata.Distribution) -> set[str]:
    """The top-level modules a distribution installs that are real modules or regular packages (a namespace
    folder, `nvidia/` of the CUDA wheels for instance, is shared by design and shadows nothing): from its
    top_level.txt where it has one (short), else from its RECORD."""
    listed = (dist.read_text("top_level.txt") or "").split()
    if listed:
        return {n for n in listed if n.isidentifier() and _is_module(dist, n)}
    names = set()
    for f in dist.files or ():
        parts = f.parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".egg-info")):
            continue
        if len(parts) == 1:
            stem = _module_stem(parts[0])
            if stem:
                names.add(stem)
        elif len(parts) == 2 and _module_stem(parts[1]) == "__init__" and parts[0].isidentifier():
            names.add(parts[0])
    return names


def _is_module(dist: metadata.Distribution, name: str) -> bool:
    """Whether top-level `name` of an installed `dist` is a regular package or a module file."""
    suffixes = machinery.all_suffixes()
    return any(Path(str(dist.locate_file(f"{name}/__init__{x}"))).is_file() or
               Path(str(dist.locate_file(f"{name}{x}"))).is_file() for x in suffixes)


def _module_stem(filename: str) -> str | None:
    for suffix in machinery.all_suffixes():
        if filename.endswith(suffix) and filename[: -len(suffix)].isidentifier():
            return filename[: -len(suffix)]
    return None


def _exact_pins(dist: metadata.Distribution) -> list[str]:
    """Canonical names of what `dist` requires with `==`/`===` and this machine installs (its markers hold)."""
    out = []
    for line in dist.requires or ():
        try:
            req = Requirement(line)
            applies = req.marker is None or req.marker.evaluate({"extra": ""})
        except (InvalidRequirement, ValueError):
            continue
        if applies and any(s.operator in ("==", "===") and "*" not in s.version for s in req.specifier):
            out.append(canonicalize_name(req.name))
    return out


def protected_stack(paths: list[str] | None = None) -> Stack:
    """The installed stack as found on `paths` (default sys.path), read from its distributions' metadata."""
    paths = paths if paths is not None else sys.path
    found: dict[str, metadata.Distribution] = {}

    def look(name: str) -> bool:  # by its folder's name, the first on the path (the one imported)
        dist = next(iter(metadata.distributions(name=name, path=paths)), None)
        if dist is not None:
            found[name] = dist
        return dist is not None

    wanted = [n for n in PROTECTED if look(n)]
    if "torch" in found:
        wanted += [n for n in _exact_pins(found["torch"]) if n not in wanted and look(n)]
    versions = {n: found[n].version for n in wanted}
    modules = frozenset(m for n in wanted for m in _top_modules(found[n]))
    return Stack(versions, modules)


def pin_lines(stack: Stack) -> list[str]:
    """pip constraints that hold each protected distribution at exactly its installed version string."""
    return [f"{n}=={v}" if "+" in v else f"{n}==={v}" for n, v in stack.versions.items()]


def requirement_names(line: str) -> list[str]:
    """The canonical names a requirements line installs, as far as the line says: 'torch @ file://...' and
    'Torch[extra]>=1' are torch, a path or URL to 'numpy-1.0-py3-none-any.whl' (or an sdist, or one with
    '#egg=numpy') is numpy; [] for an option line, a folder or what does not parse (pip judges those)."""
    line = line.split(" #")[0].strip()
    if not line or line.startswith("#"):
        return []
    if line.startswith(("-e ", "--editable ", "--editable=")):
        line = line.split(None, 1)[1] if " " in line else line.partition("=")[2]
    elif line.startswith("-"):
        return []
    egg = line.partition("#egg=")[2].split("&")[0]
    if egg:
        return [canonicalize_name(egg.split("[")[0])]
    try:
        return [canonicalize_name(Requirement(line).name)]
    except InvalidRequirement:
        pass
    last = line.split(";")[0].strip().rstrip("/").rpartition("/")[2].split("?")[0]
    try:
        return [canonicalize_name(parse_wheel_filename(last)[0])]
    except InvalidWheelFilename:
        pass
    try:
        return [canonicalize_name(parse_sdist_filename(last)[0])]
    except InvalidSdistFilename:
        return []


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`'s folder, links followed, lies in `root`: removing `path` then touches nothing outside."""
    parent = os.path.realpath(path.parent)
    real_root = os.path.realpath(root)
    return parent == real_root or parent.startswith(real_root + os.sep)


def intruders(site: Path, stack: Stack) -> list[Intruder]:
    """What in `site` would take the place of the stack (see the module's docstring)."""
    if not site.is_dir():
        return []
    found, owned = [], set()
    for dist in metadata.distributions(path=[str(site)]):
        name = canonicalize_name(dist.metadata["Name"] or "?")
        files = [site / f for f in dist.files or ()]
        info = getattr(dist, "_path", None)  # the .dist-info folder itself (PathDistribution)
        tops = _top_modules(dist)
        owned |= tops
        hit = name in stack.versions and name or next(iter(sorted(tops & stack.modules)), None)
        if hit:
            what = f"{name} {dist.version}" + ("" if hit == name else f" (its files hold {hit}/)")
            found.append(Intruder(what, files + ([Path(info)] if info else [])))
    for entry in sorted(os.scandir(site), key=lambda e: e.name):
        module = _module_stem(entry.name) if not entry.is_dir() else entry.name
        if module in stack.modules and module not in owned and (
                not entry.is_dir() or any(_module_stem(f) == "__init__" for f in _listing(entry.path))):
            found.append(Intruder(f"{entry.name} (no distribution owns it)", [Path(entry.path)]))
    return found


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def remove(intruder: Intruder, base: Path) -> None:
    """Delete an intruder's files under `base` (never through a link that leaves it), then the folders it left
    empty. Raises OSError when a file cannot be removed."""
    folders, site = set(), user_site(base)
    for p in intruder.paths:
        if not _inside(p, base):
            top = site / p.relative_to(site).parts[0] if p.is_relative_to(site) and p != site else None
            if top is not None and top.is_symlink():  # a link out of the site: it goes, what it names stays
                top.unlink()
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.is_symlink() or p.exists():
            p.unlink()
        folders.add(p.parent)
    stop = {base, user_site(base), base / "bin"}
    for d in sorted(folders, key=lambda d: len(d.parts), reverse=True):
        while _inside(d, base) and d not in stop and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent


_WHERE = ("import importlib.util, json, sys\nout = {}\nfor m in sys.argv[1:]:\n"
          "    try:\n        s = importlib.util.find_spec(m)\n    except Exception as e:\n"
          "        out[m] = 'error: ' + type(e).__name__\n        continue\n"
          "    out[m] = s and (s.origin or ' '.join(s.submodule_search_locations or ()))\n"
          "print(json.dumps(out))\n")


def shadowed(stack: Stack, base: Path, env: dict[str, str]) -> list[str]:
    """The modules of the stack that a fresh Python with `base` as its user site would import from anywhere
    but the image's own copy ('torch from /ws/.dlenv/x/torch/__init__.py'); [] when all are the image's.
    A check that cannot run (it timed out, it crashed) is reported as one entry too."""
    paths = image_paths(base)
    mine = {}
    for m in sorted(stack.modules):
        spec = machinery.PathFinder.find_spec(m, paths)
        mine[m] = spec and (spec.origin or " ".join(spec.submodule_search_locations or ()))
    run_env = dict(env, PYTHONUSERBASE=str(base))
    run_env.pop("PYTHONNOUSERSITE", None)
    try:
        proc = subprocess.run([sys.executable, "-c", _WHERE, *sorted(mine)], cwd=str(base), env=run_env,
                              capture_output=True, text=True, timeout=SHADOW_CHECK_S)
        theirs = json.loads(proc.stdout)
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        return [f"the check of where the stack is imported from did not finish ({type(e).__name__})"]
    return [f"{m} from {theirs.get(m)}" for m, origin in mine.items()
            if origin and (not theirs.get(m) or os.path.realpath(str(theirs[m])) != os.path.realpath(origin))]
