"""A project's requirements.txt in the image: installed once, into the mounted workspace, never over PyTorch.

The people this image is for upload a project with a `requirements.txt` beside `train.py`. The image's
entrypoint (scripts/tools/entrypoint.sh) installs it at container start when it changed since the last
install, so a new container does not install it again:

- where: pip's user scheme under PYTHONUSERBASE, which the Dockerfile sets to a folder of the workspace
  per profile (`/root/workspace/.dlenv/cu<CUDA>`): it lives in the mount, so it outlasts the container,
  and Python puts its site-packages on sys.path by itself (`.pth` files work, console scripts land in
  its `bin/`, which is on PATH). What the env already has is not installed again; a newer version of a
  package the env has goes there and is found first; the env itself is never changed (`--user` never
  uninstalls outside the user site).
- under the profile's constraints: the PyTorch stack (dlenv.envcheck.stackguard: torch, torchvision,
  torchaudio, NumPy and what torch pins exactly) held at the exact installed version strings
  (`constraints.txt` beside it, pip's `-c`), so no requirement, direct or through a dependency, replaces
  the stack the image was built and checked with. A requirements line that names one of it at another
  version, or by a URL or a path, is refused in one line that names it and the profile that has a
  newer PyTorch. Pins are the first wall: after pip ran (or was cut), the user site is checked by
  content, and a distribution of the stack found there is removed and named in one line; where the
  stack would still be imported from elsewhere, the user site is set aside. The container's command
  then starts with the image's stack.
- bounded: pip waits at most PIP_TIMEOUT_S for the index and retries PIP_RETRIES times, and the whole
  install is cut (its process group killed) after INSTALL_LIMIT_S (DLENV_REQUIREMENTS_TIMEOUT), with
  one line; the command starts anyway.
- the stamp: `requirements.sha256` holds the hash of the requirements.txt last tried (the entrypoint
  compares it in the shell, without starting Python), `requirements.failed` the line of a try that
  failed (printed again at every start until the file changes), `requirements.log` pip's whole output.

`python -m dlenv.envcheck.projectreqs` installs now (whatever the stamp says); `--if-changed` is the
entrypoint's call. `status()` is what verify-env reports: installed, out of date, failed. No torch here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dlenv.envcheck import stackguard
from dlenv.envcheck.pins import MODERN_ENV_FILE
from dlenv.errors import printable

#: where the project lives in the image (the Dockerfile's WORKDIR and the documented mount point)
WORKSPACE = "/root/workspace"
FILE = "requirements.txt"
STAMP, FAILED, LOG, CONSTRAINTS = "requirements.sha256", "requirements.failed", "requirements.log", "constraints.txt"
#: the command that installs now, whatever the stamp says
RETRY = "python -m dlenv.envcheck.projectreqs"
_MODERN = (f"the modern profile (dlenv:cu128, built from {MODERN_ENV_FILE}: docs/docker.md) has a newer PyTorch; "
           "or remove that requirement")
#: pip's wait for one answer of the index (seconds) and its retries of a request: an index that accepts and
#: never answers costs about PIP_TIMEOUT_S x (PIP_RETRIES + 1) per request, not forever
PIP_TIMEOUT_S, PIP_RETRIES = 30, 2
#: the whole install's wall-clock limit (seconds), DLENV_REQUIREMENTS_TIMEOUT overrides it; then pip's
#: process group is killed and the container's command starts with the image's stack
INSTALL_LIMIT_S = 900
LIMIT_ENV = "DLENV_REQUIREMENTS_TIMEOUT"


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


def protected_versions(base: Path | None = None) -> dict[str, str]:
    """{canonical name: installed version} of the image's PyTorch stack (stackguard.protected_stack), read
    where the image keeps it: never from the user site under `base`."""
    return dict(stackguard.protected_stack(stackguard.image_paths(base or user_base())).versions)


def constraint_lines(versions: dict[str, str]) -> list[str]:
    """pip constraints that hold each protected package at exactly its installed version (local label
    included: 'torch===1.13.1' refuses '1.13.1+evil', which 'torch==1.13.1' would take)."""
    return stackguard.pin_lines(stackguard.Stack(versions))


def _profile() -> str:
    base = user_base()
    return base.name if base else "this"


def _refusal(asked: str, name: str, versions: dict[str, str]) -> str:
    return (f"{FILE}: {asked} would replace {name} {versions[name]} of this image's profile ({_profile()}), whose "
            f"PyTorch stack ({', '.join(stackguard.PROTECTED)} and what torch pins) stays as built; {_MODERN}")


def direct_conflicts(text: str, versions: dict[str, str]) -> list[str]:
    """The refusal line of each requirement in `text` (a requirements file) that names a protected package
    by a URL or a path ('torch @ file://...', './numpy-1.0-py3-none-any.whl': never the image's), or with a
    version its installed one does not satisfy exactly ('torch>=2', 'torch==1.13.1+evil' where torch is
    1.13.1); pip finds those that come through a dependency, and the check after pip what it let through.
    Lines pip takes as options, and those whose name no one can tell before pip builds them, are pip's."""
    out = []
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip()
        names = [n for n in stackguard.requirement_names(line) if n in versions]
        if not names:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:  # a path or a URL, named by its file
            out.append(_refusal(line, names[0], versions))
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.url or not req.specifier.contains(Version(versions[names[0]]), prereleases=True):
            out.append(_refusal(line, names[0], versions))
    return out


# pip's resolver, explaining a conflict: "The conflict is caused by:" then lines such as
# "    timm 9.0 depends on torch>=2.0" and "    The user requested (constraint) torch==1.13.1"
_DEPENDS = re.compile(r"^\s*(\S+ \S+) depends on (([A-Za-z0-9._-]+)\S*)", re.M)
_ERROR = re.compile(r"^ERROR: (.+)$", re.M)


def pip_failure_line(output: str, versions: dict[str, str], log: Path) -> str:
    """The one line for a pip run that failed: a dependency that would replace a protected package as
    the refusal, else pip's first ERROR line, with where its whole output is."""
    for m in _DEPENDS.finditer(output):
        name = canonicalize_name(m.group(3))
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
    """Install `root`'s requirements.txt into `base` under the protected pins, bounded in time, then keep the
    stack by content (`guard`); returns 0 when installed (or nothing to do), 1 when refused, failed, cut or
    when the stack had to be restored (the one line said, and kept for verify-env)."""
    root = root or workspace()
    base = base or user_base()
    req = root / FILE
    if not req.is_file():
        return 0
    if base is None:
        say(f"dlenv: {req}: no PYTHONUSERBASE to install it into (the image sets one); pip install -r {req} "
            "into your own environment")
        return 1
    versions = protected_versions(base)
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
    # --user: into PYTHONUSERBASE, never uninstalling what the env has; -c: the protected pins;
    # --timeout/--retries: an index that never answers is given up on (the wall-clock limit bounds the rest)
    cmd = [sys.executable, "-m", "pip", "install", "--user", "--no-warn-script-location", "--no-input",
           "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES),
           "-c", str(base / CONSTRAINTS), "-r", str(req)]
    limit = install_limit()
    code, output = run_bounded(cmd, cwd=root, env=env, limit=limit)
    (base / LOG).write_text(f"$ {' '.join(cmd)}\n{output}", encoding="utf-8")
    restored = guard(base, env)
    if code is None:
        line = (f"the install of {FILE} was cut after {limit:g} s ({LIMIT_ENV} sets the limit; pip's output so "
                f"far: {base / LOG}); the command starts with the image's stack; check the index or the network, "
                f"or run {RETRY} to try again")
        return _failed(base, req, "; ".join([line, *restored]), say)
    if code != 0:
        return _failed(base, req, "; ".join([pip_failure_line(output, versions, base / LOG), *restored]), say)
    if restored:
        return _failed(base, req, "; ".join(restored), say)
    (base / STAMP).write_text(file_hash(req) + "\n", encoding="utf-8")
    done = re.search(r"^Successfully installed (.+)$", output, re.M)
    say(f"dlenv: {FILE} installed ({done.group(1) if done else 'everything was already there'})")
    return 0


def install_limit() -> float:
    """The install's wall-clock limit: DLENV_REQUIREMENTS_TIMEOUT seconds when it is a positive number, else
    INSTALL_LIMIT_S."""
    try:
        value = float(os.environ.get(LIMIT_ENV, ""))
    except ValueError:
        return INSTALL_LIMIT_S
    return value if 0 < value < 1e6 else INSTALL_LIMIT_S


def run_bounded(cmd: list[str], cwd: Path, env: dict[str, str], limit: float) -> tuple[int | None, str]:
    """Run `cmd` in a process group of its own; (its exit status, its output), or (None, the output so far)
    when it ran past `limit` seconds: the whole group (pip and any build it started) is then killed. A stop
    signal of ours kills the group too before it goes on."""
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return None, out or ""
    finally:
        if proc.poll() is None:  # a signal or an error of ours: pip does not outlive it
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def guard(base: Path, env: dict[str, str] | None = None) -> list[str]:
    """Keep the image's stack by content after anything that could change the user site under `base`: remove
    each distribution of the stack found there (stackguard.intruders), and set the user site aside when the
    stack would still be imported from elsewhere. Returns one sentence per thing done ([] when all was in
    order)."""
    site = stackguard.user_site(base)
    stack = stackguard.protected_stack(stackguard.image_paths(base))
    said = []
    found = stackguard.intruders(site, stack)
    if found:
        names = ", ".join(i.what for i in found)
        try:
            for intruder in found:
                stackguard.remove(intruder, base)
            said.append(f"{site} held {names}, over this image's PyTorch stack; removed it, so the image's stays "
                        f"(a line of {FILE} or a dependency of one asks for it: remove that requirement; a newer "
                        "PyTorch is the modern profile's, docs/docker.md)")
        except OSError as e:
            said.append(f"{site} held {names}, over this image's PyTorch stack, and it could not be "
                        f"removed ({e.strerror}: {e.filename})")
    elsewhere = stackguard.shadowed(stack, base, env or dict(os.environ))
    if elsewhere:
        aside = _set_aside(site)
        said.append(f"{site} would still change the image's PyTorch stack ({'; '.join(elsewhere[:3])}); "
                    + (f"moved it to {aside}, so the command starts with the image's stack" if aside else
                       "and it cannot be moved aside: remove it, or start with DLENV_REQUIREMENTS=off"))
    return said


def _set_aside(site: Path) -> Path | None:
    """Rename the user site out of Python's way (nothing in it is lost); the new name, or None."""
    for n in range(1, 100):
        aside = site.with_name(f"{site.name}.set-aside-{n}")
        if not aside.exists():
            try:
                site.rename(aside)
            except OSError:
                return None
            return aside
    return None


def _failed(base: Path, req: Path, line: str, say) -> int:
    """Record a failed try (the line, and the file's hash: the next container does not try it again)."""
    (base / FAILED).write_text(line + "\n", encoding="utf-8")
    (base / STAMP).write_text(file_hash(req) + "\n", encoding="utf-8")
    say(f"dlenv: {printable(line)}")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=RETRY, description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--if-changed", action="store_true", help="only when requirements.txt changed since the last try")
    p.add_argument("--guard", action="store_true", help="only check that the user site leaves the PyTorch stack as "
                                                        "built (each container start does)")
    a = p.parse_args(argv)
    # a stop while pip runs ends pip's process group too (run_bounded's finally), not only this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = user_base()
    if a.guard:
        if base is None:
            return 0
        said = guard(base)
        for line in said:
            print(f"dlenv: {printable(line)}", file=sys.stderr)
        return 1 if said else 0
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
