"""Run folders: `runs/exp`, `runs/exp2`, `runs/exp3`, ... as YOLO users know them, and `--resume auto`.

`new_run_dir` picks the first free name and creates it in one `mkdir` (so two runs started at once
never share a folder); `--exist-ok` writes into the named folder as is. `find_resume` turns
`--resume PATH|auto` into a checkpoint path: auto is the newest `last.pth` under the project folder.
No torch here.
"""

from __future__ import annotations

import re
from pathlib import Path

from dlenv.errors import UserError


def new_run_dir(project: str | Path, name: str, exist_ok: bool = False) -> Path:
    """Create and return project/name, or the first free project/name2, name3, ... .

    With `exist_ok` the folder project/name is used even if it exists. Raises UserError for a name
    that is not a plain folder name.
    """
    if not name or name in (".", "..") or re.search(r"[/\\]", name):
        raise UserError(f"--name {name!r} must be a plain folder name (no slashes), e.g. --name exp")
    project = Path(project)
    try:
        project.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --project folder {project} ({e.strerror}); choose another") from None
    if exist_ok:
        path = project / name
        path.mkdir(exist_ok=True)
        return path
    n = 1
    while True:
        path = project / (name if n == 1 else f"{name}{n}")
        try:
            path.mkdir()  # atomic: fails if another run took this name a moment ago
            return path
        except FileExistsError:
            n += 1


def find_resume(resume: str, project: str | Path = "runs") -> Path:
    """The checkpoint to resume: `resume` itself, or for 'auto' the newest project/*/last.pth.

    Raises UserError when the file does not exist or no run has a last.pth.
    """
    if resume.strip().lower() == "auto":
        candidates = sorted(Path(project).glob("*/last.pth"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise UserError(f"--resume auto found no {project}/*/last.pth to continue; start a run first "
                            "or pass the checkpoint path")
        return candidates[-1]
    path = Path(resume)
    if path.is_dir():
        path = path / "last.pth"
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such checkpoint; pass a last.pth path "
                        f"(e.g. {project}/exp/last.pth) or --resume auto")
    return path
