"""environment.yml's dependencies as pip requirements, for the CI image lane's pip-built `dl` env.

conda names become their PyPI names (pytorch::pytorch=1.13.1 -> torch==1.13.1); what only conda has
(python, pip, pytorch-cuda, pytorch-mutex, mkl: the wheels bring their own CUDA and BLAS) is left out;
the env file's own pip part is kept as written (its `-r requirements.txt` resolved against the env
file). Prints one requirement a line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

PYPI_NAMES = {"pytorch": "torch"}
CONDA_ONLY = {"python", "pip", "pytorch-cuda", "pytorch-mutex", "mkl"}


def requirements(env_file: Path) -> list[str]:
    env = yaml.safe_load(env_file.read_text(encoding="utf-8"))
    out = []
    for dep in env.get("dependencies", []):
        if isinstance(dep, dict):  # the pip: part
            for line in dep.get("pip", []):
                if line.startswith("-r "):
                    line = f"-r {(env_file.parent / line[3:].strip()).resolve()}"
                out.append(line)
            continue
        m = re.fullmatch(r"\s*(?:[\w.-]+::)?([\w.-]+)\s*(.*?)\s*", dep)
        name, spec = m.group(1), m.group(2).replace(" ", "")
        if name in CONDA_ONLY:
            continue
        exact = re.fullmatch(r"=([^=<>!,]+)(?:=\S+)?", spec)
        out.append(PYPI_NAMES.get(name, name) + (f"=={exact.group(1)}" if exact else spec))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        print("usage: env-requirements.py ENV_FILE", file=sys.stderr)
        raise SystemExit(2)
    print("\n".join(requirements(Path(sys.argv[1]))))
