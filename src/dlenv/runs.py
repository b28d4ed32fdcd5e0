"""Run folders: `runs/exp`, `runs/exp2`, `runs/exp3`, ... as YOLO users know them, and `--resume auto`.

`new_run_dir` picks the first free name and creates it in one `mkdir` (so two runs started at once
never share a folder); `--exist-ok` writes into the named folder as is. `lock_run_dir` is what keeps
two runs out of one folder all the same (`--exist-ok`, or two resumes of one run): the trainer holds
an exclusive `flock` on the folder's `.dlenv.lock` for the run's life, and the kernel releases it when
the process ends, however it ends. `find_resume` turns `--resume PATH|auto` into a checkpoint path:
auto is the newest `last.pth` under the project folder. The names of a run folder's files are written
here once (LAST, BEST; dlenv.runstate writes and reads them). No torch here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import weakref
from pathlib import Path

from dlenv.errors import UserError

LOCK_FILE = ".dlenv.lock"
#: the run state a run saves each epoch (optimizer, RNG, position: what --resume needs)
LAST = "last.pth"
#: the weights of the best epoch with what it takes to use them (dlenv.train.state.slim)
BEST = "best_model.pth"


class RunLock:
    """An exclusive lock on a run folder, held while this object lives (or until `release`)."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


# folder -> its RunLock in this process: taking it again in the same process (an in-process resume
# right after a run) returns the same lock instead of refusing itself
_HELD: weakref.WeakValueDictionary[str, RunLock] = weakref.WeakValueDictionary()


def lock_run_dir(run_dir: str | Path) -> RunLock:
    """Lock `run_dir` for this run; keep the returned object as long as the run writes there.

    Raises UserError naming the process that holds it when another run writes into the same folder.
    On a file system without locks (some network mounts) the run goes on unlocked.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    held = _HELD.get(key)
    if held is not None and held._fd is not None:
        return held
    lock_path = run_dir / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)  # no locks here (ENOLCK, EOPNOTSUPP): nothing to hold
            return RunLock(run_dir, None)
        owner = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"{run_dir} is in use by another run (process {owner}); two runs in one folder "
                        "would mix their results.csv and checkpoints. Wait for it to end, or pass another "
                        "--name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    lock = RunLock(run_dir, fd)
    _HELD[key] = lock
    return lock


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
        candidates = sorted(Path(project).glob(f"*/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise UserError(f"--resume auto found no {project}/*/{LAST} to continue; start a run first "
                            "or pass the checkpoint path")
        return candidates[-1]
    path = Path(resume)
    if path.is_dir():
        path = path / LAST
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such checkpoint; pass a {LAST} path "
                        f"(e.g. {project}/exp/{LAST}) or --resume auto")
    return path
