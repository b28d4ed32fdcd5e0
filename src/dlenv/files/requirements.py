"""A project's requirements.txt held against what this Python has installed: each requirement satisfied, missing,
or at another version (importlib.metadata for what is installed, packaging's Requirement and SpecifierSet for
what a line asks, as pip reads it). `dlenv verify-env` reports it, and a model file whose import fails for a
missing module (`ModuleNotFoundError: einops`) is told whether requirements.txt lists it (`missing_module_hint`).

Installing it is dlenv.envcheck.projectreqs's (the image's entrypoint); this module only reads. The file is read
as every file from outside is: a regular file of at most MAX_BYTES, at most MAX_LINES lines judged. Lines pip
takes that name no requirement (-r, -c, -e, --index-url, a path) are counted as not checked. No torch here.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from dlenv.errors import UserError, printable
from dlenv.files.safeio import read_regular

FILE = "requirements.txt"
#: the most bytes and requirement lines read: far past any project's list
MAX_BYTES, MAX_LINES = 256 * 1024, 5000
#: import names whose distribution is called otherwise (the rest: the same name)
DISTRIBUTION_OF = {"cv2": "opencv-python", "PIL": "Pillow", "sklearn": "scikit-learn", "skimage": "scikit-image",
                   "yaml": "PyYAML", "bs4": "beautifulsoup4", "google": "protobuf", "Crypto": "pycryptodome",
                   "attr": "attrs", "dateutil": "python-dateutil", "dotenv": "python-dotenv", "jwt": "PyJWT"}
#: what to run to install it, outside the image and in it
INSTALL = f"pip install -r {FILE}"
IN_IMAGE = "in the image a new container installs it at start"


@dataclass(frozen=True)
class Judged:
    """One requirement line: its name (None for a line that names none), its state (ok, missing, version,
    skipped: its marker excludes this Python, unchecked: not a requirement dlenv can judge), the version
    installed, and the line as written."""

    line: str
    name: str | None
    state: str
    installed: str | None = None


def read_lines(path: Path) -> list[str]:
    """The requirement lines of `path`: continuations joined, comments and blank lines dropped, at most
    MAX_LINES. Raises UserError for a file that is not a small regular UTF-8 text file."""
    raw = read_regular(path, MAX_BYTES, what=FILE)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{printable(str(path))} is not UTF-8 text; save it as text, one requirement a line"
                        ) from None
    lines, held = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        line, held = (held + line), ""
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
        if len(lines) >= MAX_LINES:
            break
    return lines


def judge_line(line: str) -> Judged:
    """The state of one requirement line in this Python."""
    if line.startswith("-") or line.startswith(".") or "/" in line.split("@", 1)[0]:
        return Judged(line, None, "unchecked")  # -r/-c/-e/--index-url, a path: pip's to read
    try:
        req = Requirement(line.split(" --", 1)[0].strip())  # without pip's per-line options (--hash=...)
    except InvalidRequirement:
        return Judged(line, None, "unchecked")
    try:
        if req.marker is not None and not req.marker.evaluate():
            return Judged(line, req.name, "skipped")
    except UndefinedEnvironmentName:
        return Judged(line, req.name, "unchecked")
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return Judged(line, req.name, "missing")
    if req.url or not req.specifier or req.specifier.contains(installed, prereleases=True):
        return Judged(line, req.name, "ok", installed)
    return Judged(line, req.name, "version", installed)


def judged(folder: str | Path | None = None) -> list[Judged] | None:
    """Each line of `folder`'s requirements.txt (default: the working folder) judged; None without the file."""
    path = Path(folder or os.getcwd()) / FILE
    if not os.path.lexists(path):
        return None
    return [judge_line(line) for line in read_lines(path)]


def summary(results: list[Judged]) -> tuple[str, str, str]:
    """(ok or warn, the one line, its fix) of judged requirements, for verify-env."""
    named = [r for r in results if r.state in ("ok", "missing", "version")]
    missing = [r.name for r in results if r.state == "missing"]
    other = [f"{r.name} {r.installed} (wants {r.line})" for r in results if r.state == "version"]
    unchecked = sum(r.state == "unchecked" for r in results)
    parts = [f"{FILE}: {len(named) - len(missing) - len(other)} of {len(named)} installed"]
    if missing:
        parts.append(f"missing: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}")
    if other:
        parts.append(f"another version: {', '.join(other[:4])}{', ...' if len(other) > 4 else ''}")
    if unchecked:
        parts.append(f"{unchecked} line{'s' if unchecked > 1 else ''} not checked (options, paths)")
    bad = bool(missing or other)
    return ("warn" if bad else "ok"), printable("; ".join(parts)), (f"{INSTALL} ({IN_IMAGE})" if bad else "")


def missing_module_hint(module: str, folder: str | Path | None = None) -> str:
    """What to say of `module` that a model file imports and this Python lacks: whether requirements.txt (in
    `folder`, default the working folder) lists its distribution. Never raises: '' when it cannot tell."""
    top = module.split(".", 1)[0]
    dist = DISTRIBUTION_OF.get(top, top)
    try:
        results = judged(folder)
    except (UserError, OSError):
        results = None
    if results is None:
        return f"; add {dist} to a {FILE} beside your scripts and {INSTALL} ({IN_IMAGE})"
    wanted = canonicalize_name(dist)
    listed = next((r for r in results if r.name and canonicalize_name(r.name) == wanted), None)
    if listed is None:
        return f"; add {dist} to {FILE} (it does not list it), then {INSTALL} ({IN_IMAGE})"
    return (f"; {FILE} lists {dist} ({printable(listed.line)}) but it is not installed: {INSTALL} ({IN_IMAGE}; "
            "`dlenv verify-env` says what else is missing)")
