"""The image's lock: what the solver chose, recorded, and the PyTorch stack held in place.

Run by the Dockerfile with the `dl` env's python (docs/docker.md, "The lock", says how to rebuild from
what it writes):

    lock_env.py pinned ENV_FILE   conda-meta/pinned: every conda pin of the env file, in the pinned
                                  file's syntax ("python 3.10.*", "numpy >=1.23,<2"), so a later
                                  `conda install` in the image cannot swap Python, PyTorch or NumPy
    lock_env.py pip               the packages pip installed (not conda), name==version, with the
                                  PyTorch index line their +cuXXX versions need: `pip install
                                  --no-deps -r` of it reinstalls exactly these
    lock_env.py constraints       torch, torchvision, torchaudio == the installed versions, for
                                  PIP_CONSTRAINT: a `pip install` cannot replace the stack either
    lock_env.py conda KIND FILE   the conda half of the lock, conda's own `conda list --name dl
                                  --explicit --md5`, into FILE. KIND is the Dockerfile's ENV_KIND: for
                                  `conda` a missing conda fails the build with one line; for `pip` (an
                                  env built without conda, CI's image lane) there is no conda half and
                                  no FILE, and it says so
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata

TORCH_STACK = ("torch", "torchvision", "torchaudio")
_LOCAL_CUDA = re.compile(r"\+(cu\d+)$")


def pinned_lines(env: dict) -> list[str]:
    """conda-meta/pinned lines for an env file's conda dependencies that carry a version.

    'python=3.10' -> 'python 3.10.*' (conda's '=' means that prefix), 'pytorch::pytorch=1.13.1' ->
    'pytorch::pytorch 1.13.1.*', 'pytorch::pytorch-mutex=1.0=cuda' -> 'pytorch::pytorch-mutex 1.0.* cuda',
    'numpy>=1.23,<2' -> 'numpy >=1.23,<2'; 'pip' (no version) is left out.
    """
    out = []
    for dep in env.get("dependencies", []):
        if not isinstance(dep, str):
            continue
        m = re.fullmatch(r"\s*((?:[\w.-]+::)?[\w.-]+)\s*(.*?)\s*", dep)
        name, spec = m.group(1), m.group(2).replace(" ", "")
        if not spec:
            continue
        exact = re.fullmatch(r"=([^=<>!,]+)(?:=(\S+))?", spec)
        if exact:
            version, build = exact.groups()
            out.append(f"{name} {version}.*" + (f" {build}" if build else ""))
        else:
            out.append(f"{name} {spec}")
    return out


def _installer(dist: metadata.Distribution) -> str:
    return (dist.read_text("INSTALLER") or "").strip()


def pip_lines() -> list[str]:
    """name==version of every distribution pip installed (INSTALLER 'pip'; conda writes 'conda'), sorted,
    headed by the --extra-index-url that +cuXXX versions come from."""
    pins, indexes = {}, set()
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or _installer(dist) != "pip" or name.lower() == "dlenv":
            continue
        pins[name.lower()] = f"{name}=={dist.version}"
        local = _LOCAL_CUDA.search(dist.version)
        if local:
            indexes.add(f"--extra-index-url https://download.pytorch.org/whl/{local.group(1)}")
    return sorted(indexes) + [pins[k] for k in sorted(pins)]


def constraint_lines() -> list[str]:
    """torch, torchvision, torchaudio pinned to exactly what is installed (those installed): `===` where the
    version has no local label, since `torch==1.13.1` also admits `1.13.1+anything` (PEP 440), and a
    requirements.txt naming such a build would replace the image's torch under the constraint; the rule
    of dlenv.envcheck.stackguard.pin_lines, which this build-time script cannot import."""
    out = []
    for name in TORCH_STACK:
        try:
            v = metadata.version(name)
            out.append(f"{name}=={v}" if "+" in v else f"{name}==={v}")
        except metadata.PackageNotFoundError:
            continue
    return out


def conda_lock(kind: str, path: str) -> int:
    """Write conda's explicit list of the `dl` env to `path` (kind 'conda'); 0, or 1 with one line why."""
    if kind == "pip":
        print("lock: the dl env was built by pip (ENV_KIND=pip): no conda packages to lock; pip.txt is the lock")
        return 0
    conda = shutil.which("conda")
    if conda is None:
        print("lock: ENV_KIND=conda but this image has no conda on PATH; an env built without conda "
              "takes --build-arg ENV_KIND=pip", file=sys.stderr)
        return 1
    r = subprocess.run([conda, "list", "--name", "dl", "--explicit", "--md5"], capture_output=True, text=True)
    if r.returncode != 0 or "@EXPLICIT" not in r.stdout:
        last = (r.stderr.strip().splitlines() or ["no @EXPLICIT list"])[-1]
        print(f"lock: conda list --name dl --explicit --md5 failed: {last}", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(r.stdout)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["conda"] and len(argv) == 3 and argv[1] in ("conda", "pip"):
        return conda_lock(argv[1], argv[2])
    if argv[:1] == ["pinned"] and len(argv) == 2:
        import yaml

        with open(argv[1], encoding="utf-8") as fh:
            lines = pinned_lines(yaml.safe_load(fh))
    elif argv == ["pip"]:
        lines = pip_lines()
    elif argv == ["constraints"]:
        lines = constraint_lines()
    else:
        print("usage: lock_env.py pinned ENV_FILE | pip | constraints | conda conda|pip FILE", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
