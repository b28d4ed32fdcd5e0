"""The image profiles' pins: read from the conda env files (and the requirements files they include),
and matched against what is installed. No torch here."""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The source checkout (or /opt/dlenv in the image): where the profiles' env files live.
ROOT = Path(__file__).resolve().parents[3]
ENV_FILES = ("environment.yml", "environment.modern.yml")
MODERN_ENV_FILE = "environment.modern.yml"

_PIN_NAMES = {"pytorch": "torch", "pytorch-cuda": "cuda", "opencv-python-headless": "opencv",
              "opencv-python": "opencv"}


def _spec(conda_or_pip: str) -> tuple[str, str] | None:
    """'pytorch::pytorch=1.13.1' / 'numpy>=1.23,<2' / 'torch==2.1+cu128' -> (our name, pip specifier)."""
    s = conda_or_pip.split("#")[0].strip()
    if not s or s.startswith("-"):
        return None
    s = s.split("::")[-1].replace(" ", "")
    m = re.match(r"([A-Za-z0-9_.\-]+)(.*)", s)
    if not m:
        return None
    name, rest = m.group(1).lower().replace("_", "-"), m.group(2)
    name = _PIN_NAMES.get(name, name)
    if rest.startswith("=") and not rest.startswith("=="):  # conda: '=1.13.1[=build]' is a prefix match
        version = rest[1:].split("=")[0]
        rest = f"=={version}" if "*" in version else f"=={version}.*"
    return name, rest


def _read_requirements(path: Path, seen: set[Path]) -> list[str]:
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            lines += _read_requirements(path.parent / line.split(None, 1)[1], seen)
        elif line and not line.startswith("-"):
            lines.append(line)
    return lines


def read_pins(env_file: str | Path) -> dict[str, str]:
    """The pins of a conda env file and the requirements files it includes with `-r`.

    Returns {package: pip-style specifier}, with conda's prefix match written as '==1.13.1.*', the
    names we show ('torch', 'cuda', 'opencv'), and 'cuda' from pytorch-cuda=X or a torch '+cuXYZ'.
    Raises OSError or yaml.YAMLError for an unreadable file.
    """
    import yaml

    path = Path(env_file)
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries: list[str] = []
    for dep in data.get("dependencies", []):
        if isinstance(dep, dict):  # the pip: section
            for line in dep.get("pip", []):
                line = str(line).strip()
                if line.startswith(("-r ", "--requirement ")):
                    entries += _read_requirements(path.parent / line.split(None, 1)[1], set())
                else:
                    entries.append(line)
        else:
            entries.append(str(dep))
    pins: dict[str, str] = {}
    for entry in entries:
        entry, _, marker = entry.partition(";")  # a pip line for another machine (environment markers)
        if marker.strip() and not _marker_applies(marker):
            continue
        parsed = _spec(entry)
        if parsed and parsed[1]:
            pins.setdefault(parsed[0], parsed[1])
    local = re.search(r"\+cu(\d+)(\d)$", pins.get("torch", ""))
    if local and "cuda" not in pins:
        pins["cuda"] = f"=={local.group(1)}.{local.group(2)}.*"
    return pins


def _marker_applies(marker: str) -> bool:
    """Whether a pip environment marker ('platform_machine == "aarch64"') holds here; True if unreadable."""
    try:
        from packaging.markers import InvalidMarker, Marker
    except ImportError:
        return True
    try:
        return Marker(marker.split("#")[0].strip()).evaluate()
    except InvalidMarker:
        return True


def profile_name(pins: dict[str, str]) -> str | None:
    """'cu116' for a profile whose CUDA pin is 11.6; None without one."""
    m = re.match(r"==(\d+)\.(\d+)", pins.get("cuda", ""))
    return f"cu{m.group(1)}{m.group(2)}" if m else None


def pin_matches(installed: str, spec: str) -> bool | None:
    """Whether a version satisfies a pip-style specifier; None if it cannot be compared."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        version = Version(installed)
        spec_set = SpecifierSet(spec)
    except (InvalidSpecifier, InvalidVersion):
        return None
    if spec_set.contains(version, prereleases=True):
        return True
    # '==1.13.1.*' also accepts '1.13.1+cu116': compare the public version when the pin has no local part
    return "+" not in spec and spec_set.contains(Version(version.public), prereleases=True)


def find_env_file(torch_version: str | None) -> Path | None:
    """The env file of the profile this environment was built from.

    In the image DLENV_ENV_FILE names it. Elsewhere, the profile whose torch pin has the installed
    torch's major.minor; None when no profile matches (e.g. CI's 'newest' lane).
    """
    named = os.environ.get("DLENV_ENV_FILE")
    if named and Path(named).is_file():
        return Path(named)
    if not torch_version:
        return None
    mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    for name in ENV_FILES:
        path = ROOT / name
        try:
            spec = read_pins(path).get("torch", "")
        except Exception:  # a missing or broken env file just doesn't identify the profile
            continue
        if re.match(rf"==+{re.escape(mm)}\.", spec):
            return path
    return None
