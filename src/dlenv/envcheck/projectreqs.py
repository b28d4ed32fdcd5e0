"""A project's requirements.txt in the image: installed once, into the mounted workspace, never over PyTorch.

The people this image is for upload a project with a `requirements.txt` beside `train.py`. The image's
entrypoint (scripts/entrypoint.sh) installs it at container start when it changed since the last
install, so a new container does not install it again:

- where: pip's user scheme under PYTHONUSERBASE, which the Dockerfile sets to a folder of the workspace
  per profile (`/root/workspace/.dlenv/cu<CUDA>`): it lives in the mount, so it outlasts the container,
  and Python puts its site-packages on sys.path by itself (`.pth` files work, console scripts land in
  its `bin/`, which is on PATH). What the env already has is not installed again; a newer version of a
  package the env has goes there and is found first; the env itself is never changed (`--user` never
  uninstalls outside the user site).
- under the profile's constraints: torch, torchvision, torchaudio and NumPy pinned to the versions
  installed (`constraints.txt` beside it, pip's `-c`), so no requirement, direct or through a
  dependency, replaces the PyTorch stack the image was built and checked with. A requirement that
  would is refused in one line that names it and the profile that has a newer PyTorch.
- the stamp: `requirements.sha256` holds the hash of the requirements.txt last tried (the entrypoint
  compares it in the shell, without starting Python), `requirements.failed` the line of a try that
  failed (printed again at every start until the file changes), `requirements.log` pip's whole output.

`python -m dlenv.envcheck.projectreqs` installs now (whatever the stamp says); `--if-changed` is the
entrypoint's call. `status()` is what verify-env reports: installed, out of date, failed. No torch here.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dlenv.envcheck.pins import MODERN_ENV_FILE
from dlenv.errors import printable

#: the PyTorch stack and the NumPy it was built against: never replaced by a project's requirements
PROTECTED = ("torch", "torchvision", "torchaudio", "numpy")
#: where the project lives in the image (the Dockerfile's WORKDIR and the documented mount point)
WORKSPACE = "/root/workspace"
FILE = "requirements.txt"
STAMP, FAILED, LOG, CONSTRAINTS = "requirements.sha256", "requirements.failed", "requirements.log", "constraints.txt"
#: the command that installs now, whatever the stamp says
RETRY = "python -m dlenv.envcheck.projectreqs"
_MODERN = (f"the modern profile (dlenv:cu128, built from {MODERN_ENV_FILE}: docs/docker.md) has a newer PyTorch; "
           "or remove that requirement")


@dataclass(frozen=True)
class Status:
    """What verify-env says of a project's requirements.txt: state is none (no file, or not in the image),
    installed, out-of-date or failed; `detail` the words for it, `fix` what to do."""

    state: str
    detail: str
    file: str = ""
    fix: str = ""


def workspace() -> Path:
    return Path(os.environ.get("DLENV_WORKSPACE", WORKSPACE))


def user_base() -> Path | None:
    """The folder the requirements install into (PYTHONUSERBASE, set by the image), or None outside it."""
    base = os.environ.get("PYTHONUSERBASE")
    return Path(base) if base else None


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def protected_versions() -> dict[str, str]:
    """{name: installed version} of the PROTECTED packages that are installed."""
    out = {}
    for name in PROTECTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def constraint_lines(versions: dict[str, str]) -> list[str]:
    """pip constraints that hold each protected package at its installed version."""
    return [f"{name}=={v}" for name, v in versions.items()]


def _profile() -> str:
    base = user_base()
    return base.name if base else "this"


def _refusal(asked: str, name: str, versions: dict[str, str]) -> str:
    return (f"{FILE}: {asked} would replace {name} {versions[name]} of this image's profile ({_profile()}), whose "
            f"PyTorch stack ({', '.join(PROTECTED)}) stays as built; {_MODERN}")


def direct_conflicts(text: str, versions: dict[str, str]) -> list[str]:
    """The refusal line of each requirement in `text` (a requirements file) that names a protected package
    with a version its installed one does not satisfy ('torch>=2' where torch is 1.13.1); pip finds those
    that come through a dependency. Lines pip takes as options, and those that do not parse, are pip's."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        if name in versions and (req.marker is None or req.marker.evaluate()) and req.specifier and \
                not req.specifier.contains(versions[name].split("+")[0], prereleases=True) and \
                not req.specifier.contains(versions[name], prereleases=True):
            out.append(_refusal(line, name, versions))
    return out


# pip's resolver, explaining a conflict: "The conflict is caused by:" then lines such as
# "    timm 9.0 depends on torch>=2.0" and "    The user requested (constraint) torch==1.13.1"
_DEPENDS = re.compile(r"^\s*(\S+ \S+) depends on ((" + "|".join(PROTECTED) + r")\b\S*)", re.M | re.I)
_ERROR = re.compile(r"^ERROR: (.+)$", re.M)


def pip_failure_line(output: str, versions: dict[str, str], log: Path) -> str:
    """The one line for a pip run that failed: a dependency that would replace a protected package as
    the refusal, else pip's first ERROR line, with where its whole output is."""
    for m in _DEPENDS.finditer(output):
        name = m.group(3).lower()
        if name in versions:
            return _refusal(f"{m.group(1)} (it depends on {m.group(2)})", name, versions)
    err = _ERROR.search(output)
    said = err.group(1).strip() if err else (output.strip().splitlines() or ["pip failed"])[-1]
    return (f"pip could not install {FILE}: {said[:300]} (pip's whole output: {log}); fix it, or run {RETRY} "
            "to try again")


def status(root: Path | None = None, base: Path | None = None) -> Status:
    """What verify-env reports for `root`'s requirements.txt installed under `base` (see Status)."""
    root = root or workspace()
    base = base or user_base()
    req = root / FILE
    if not req.is_file():
        return Status("none", f"no {FILE} in {root}")
    if base is None:
        return Status("none", f"{req}: installed by the image only (outside it: pip install -r {req} into your "
                              "own environment)", str(req))
    stamp = base / STAMP
    try:
        same = stamp.is_file() and stamp.read_text().strip() == file_hash(req)
        said = (base / FAILED).read_text(encoding="utf-8").strip() if (base / FAILED).is_file() else None
    except OSError as e:  # e.g. a mount this --user cannot read: verify-env reports it, does not crash
        return Status("failed", f"{e.filename or req} cannot be read ({e.strerror})", str(req),
                      "make the workspace readable by the container's user (docker run --user $(id -u):$(id -g))")
    if not same:
        return Status("out-of-date", f"{req} changed since it was installed (or never was)", str(req),
                      f"a new container installs it at start, or run {RETRY}")
    if said is not None:
        return Status("failed", said, str(req), f"fix {FILE}: a new container installs it at start, or run {RETRY}")
    return Status("installed", f"{req} installed in {base} (under {base / CONSTRAINTS})", str(req))


def install(root: Path | None = None, base: Path | None = None, say=print) -> int:
    """Install `root`'s requirements.txt into `base` under the protected pins; returns 0 when installed
    (or nothing to do), 1 when refused or failed (the one line said, and kept for verify-env)."""
    root = root or workspace()
    base = base or user_base()
    req = root / FILE
    if not req.is_file():
        return 0
    if base is None:
        say(f"dlenv: {req}: no PYTHONUSERBASE to install it into (the image sets one); pip install -r {req} "
            "into your own environment")
        return 1
    versions = protected_versions()
    try:
        text = req.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        say(f"dlenv: cannot install {req}: {e.strerror}; make it readable by the container's user")
        return 1
    try:
        base.mkdir(parents=True, exist_ok=True)
        (base / CONSTRAINTS).write_text("".join(f"{c}\n" for c in constraint_lines(versions)), encoding="utf-8")
        (base / FAILED).unlink(missing_ok=True)
    except OSError as e:
        say(f"dlenv: cannot install {req}: {base} is not writable ({e.strerror}); start the container with "
            "--user $(id -u):$(id -g) or make the workspace writable")
        return 1
    refused = direct_conflicts(text, versions)
    if refused:
        return _failed(base, req, refused[0], say)
    say(f"dlenv: installing {req} into {base} (once; pins: {', '.join(constraint_lines(versions))})")
    env = dict(os.environ, PYTHONUSERBASE=str(base), PIP_DISABLE_PIP_VERSION_CHECK="1")
    # --user: into PYTHONUSERBASE, never uninstalling what the env has; -c: the protected pins
    cmd = [sys.executable, "-m", "pip", "install", "--user", "--no-warn-script-location", "--no-input",
           "-c", str(base / CONSTRAINTS), "-r", str(req)]
    proc = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    (base / LOG).write_text(f"$ {' '.join(cmd)}\n{output}", encoding="utf-8")
    if proc.returncode != 0:
        return _failed(base, req, pip_failure_line(output, versions, base / LOG), say)
    (base / STAMP).write_text(file_hash(req) + "\n", encoding="utf-8")
    done = re.search(r"^Successfully installed (.+)$", output, re.M)
    say(f"dlenv: {FILE} installed ({done.group(1) if done else 'everything was already there'})")
    return 0


def _failed(base: Path, req: Path, line: str, say) -> int:
    """Record a failed try (the line, and the file's hash: the next container does not try it again)."""
    (base / FAILED).write_text(line + "\n", encoding="utf-8")
    (base / STAMP).write_text(file_hash(req) + "\n", encoding="utf-8")
    say(f"dlenv: {printable(line)}")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=RETRY, description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--if-changed", action="store_true", help="only when requirements.txt changed since the last try")
    a = p.parse_args(argv)
    if a.if_changed:
        s = status()
        if s.state in ("installed", "none"):
            return 0
        if s.state == "failed":
            print(f"dlenv: {printable(s.detail)}", file=sys.stderr)
            return 1
    return install(say=lambda line: print(line, file=sys.stderr, flush=True))


if __name__ == "__main__":
    raise SystemExit(main())
