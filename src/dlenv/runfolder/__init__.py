"""A run folder and its files, in one home: the folder here, and beside it what each file holds.

    dlenv.runfolder             the folder: its name, its lock, `--resume auto`, the names of its files
    dlenv.runfolder.results     results.csv, one row per epoch (no torch: the plots read it)
    dlenv.files.runstate    the run-state files (last.pth, best_model.pth): their format,
                                `save_state` and `load_state`, atomic and safe
    dlenv.runfolder.trainstate  what the trainer keeps in them: its counters (TrainState), the saves of
                                an epoch, config.yaml, and a --resume put back into a new run

Run folders: `runs/exp`, `runs/exp2`, `runs/exp3`, ... as YOLO users know them, and `--resume auto`.

`new_run_dir` picks the first free name and creates it in one `mkdir` (so two runs started at once
never share a folder); a taken name that ends in a digit gets `-2`, `-3`, ... (`exp3-2`, not `exp32`:
a run's config.yaml records the folder it got, so `--cfg runs/exp3/config.yaml` asks for `exp3`
again). `--exist-ok` writes into the named folder as is. `lock_run_dir` is what keeps two runs out
of one folder all the same (`--exist-ok`, or two resumes of one run): the trainer holds an exclusive
`flock` on the folder's `.dlenv.lock` for the run's life; the lock file is removed when the run ends
(`RunLock.release`: when the trainer lets go of it, or at exit), and a kill that leaves it behind
leaves no lock, as the kernel releases a flock with its process. `find_resume` turns
`--resume PATH|auto` into a run-state path: auto is the newest `last.pth` under the project folder;
`find_weights` turns a bare `--weights best_model.pth` (or `last.pth`) that names no file into the newest
run's file, for val, predict, prune and export. "Newest" is by the start each run records in its config.yaml
(`# started: SECONDS (DATE)`, written when the run or its latest resume started), read bounded and checked:
a file's modification time is whatever the archive or the copy it came from said (a run unpacked dated
2100 was picked over every run trained here). A run without a plausible recorded start is judged by its
file's time, and one whose file is dated in the future is never preferred; the line that names the chosen
file says which.
The names of a run folder's files are written here once (LAST, BEST; dlenv.files.runstate writes and
reads them). No torch here: importing any module of this package runs this one first.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import fcntl
import os
import re
import time
import weakref
from pathlib import Path
from typing import Any

from dlenv import invocation
from dlenv.errors import UserError, printable
from dlenv.files import safeio

LOCK_FILE = ".dlenv.lock"
#: the run state a run saves each epoch (optimizer, RNG, position: what --resume needs)
LAST = "last.pth"
#: the weights of the best epoch with what it takes to use them (dlenv.runfolder.trainstate.slim)
BEST = "best_model.pth"
#: a run folder's own files, which a command's --out never replaces: the run's resume state, its weights, its
#: history and its options (losing any of them loses the run, or what it says about itself)
OWN_FILES = (LAST, BEST, "results.csv", "config.yaml")
#: the note of config.yaml's head that records when the run (or its latest resume) started
STARTED = "started"
#: how far past this machine's clock a recorded time may lie (a run copied from a machine whose clock is ahead)
CLOCK_SKEW_S = 3600
#: no run started before 2000-01-01 (a time of 0, 1970, is a file that lost its date)
EARLIEST = 946_684_800
#: the most of config.yaml read for its start (the note is in its first lines)
_HEAD_BYTES = 64 * 1024


class RunLock:
    """An exclusive lock on a run folder, held while this object lives (or until `release`); also a
    context manager that releases it when its block ends."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Remove the folder's lock file and end the lock; a second call does nothing.

        The file is removed while the lock is still held, and only while the name still points at this
        lock's file: a run that opened the file a moment earlier and gets the lock after this one finds
        the name gone and starts over (`lock_run_dir`), so two runs never hold two different files.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path / LOCK_FILE):
                os.unlink(self.path / LOCK_FILE)
        except OSError:
            pass  # the folder was removed or made read-only meanwhile: the lock still ends below
        finally:
            os.close(fd)  # closing the file releases the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` names the file open as `fd` (False when the name is gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


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
    while True:
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
                            "would mix their results.csv and run files. Wait for it to end, or pass another "
                            "--name") from None
        if _same_file(fd, lock_path):
            break
        os.close(fd)  # the run that held it ended and removed the file between our open and flock
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    lock = RunLock(run_dir, fd)
    _HELD[key] = lock
    return lock


@atexit.register
def _release_all() -> None:
    """At exit, end the locks something still holds (a traceback kept its run), removing their files."""
    for lock in list(_HELD.values()):
        lock.release()


def new_run_dir(project: str | Path, name: str, exist_ok: bool = False) -> Path:
    """Create and return project/name, or the first free project/name2, name3, ... .

    A name that ends in a digit goes on with a dash: exp3, exp3-2, exp3-3 (exp32 would read as the
    32nd exp, and resnet50's next is not resnet502); exp3-2 asked again goes on to exp3-3. With
    `exist_ok` the folder project/name is used even if it exists. Raises UserError for a name that
    is not a plain folder name.
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
    path = project / name
    again = re.fullmatch(r"(.*\d)-(\d+)", name)  # exp3-2 asked again goes on to exp3-3, not exp3-2-2
    stem, n = (again[1], int(again[2])) if again else (name, 1)
    sep = "-" if stem[-1].isdigit() else ""
    while True:
        try:
            path.mkdir()  # atomic: fails if another run took this name a moment ago
            return path
        except FileExistsError:
            n += 1
            path = project / f"{stem}{sep}{n}"


def config_notes(text: str) -> dict[str, str]:
    """The `# key: value` notes config.yaml carries above the options (what auto chose, and why), from its text."""
    return dict(ln[2:].split(": ", 1) for ln in text.splitlines() if ln.startswith("# ") and ": " in ln)


def started_note(t: float) -> str:
    """config.yaml's value of STARTED for time `t`: whole seconds since 1970, then the date for people."""
    return f"{int(t)} ({time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t))})"


def _date(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return f"{t:.3g} s"


def _plausible(t: float) -> str | None:
    """Why `t` cannot be when a run started (in the future beyond CLOCK_SKEW_S, or before 2000), else None."""
    if t > time.time() + CLOCK_SKEW_S:
        return f"{_date(t)} is in the future"
    return f"{_date(t)} is before any run" if t < EARLIEST else None


def recorded_start(run_dir: str | Path) -> tuple[float | None, str]:
    """(when the run in `run_dir` started, as its config.yaml records it, or None; why not when None).

    The file is read up to _HEAD_BYTES, only as a regular file; the value must be whole seconds
    (`# started: 1718000000 (...)`) that `_plausible` accepts."""
    try:
        with safeio.open_regular(Path(run_dir) / "config.yaml", "config.yaml") as fh:
            head = fh.read(_HEAD_BYTES).decode("utf-8", "replace")
    except (UserError, OSError):
        return None, "it has no readable config.yaml"
    found = re.search(rf"^# {STARTED}: (.*)$", head, re.M)
    if not found:
        return None, "its config.yaml records no start"
    value = found[1].strip()
    number = re.fullmatch(r"(\d{1,12})(?: \(.*\))?", value)
    if not number:
        return None, f"its config.yaml's start {printable(value[:24])!r} is not a time"
    t = float(number[1])
    why = _plausible(t)
    return (None, f"its config.yaml's start {why}") if why else (t, "")


def newest(files: list[Path]) -> tuple[Path, str]:
    """(the file of the run that started last, how that was judged). Runs are ordered by `recorded_start`;
    one without it by its file's modification time, unless that time is in the future (then it comes last).
    Ties go to the later name."""
    keyed = []
    for f in files:
        t, why = recorded_start(f.parent)
        if t is None:
            mtime = f.stat().st_mtime
            ahead = mtime > time.time() + CLOCK_SKEW_S
            t = float("-inf") if ahead else mtime
            if ahead:
                why += f", and its file is dated {_date(mtime)}, in the future: it comes last"
        keyed.append((t, str(f), f, why))
    keyed.sort(key=lambda k: (k[0], k[1]))
    best = keyed[-1]
    if best[3]:
        return best[2], f"by file time: {best[3]}"
    unsure = sum(1 for k in keyed if k[3])
    without = f"; {unsure} without one by file time" if unsure else ""
    return best[2], f"by the start its config.yaml records{without}"


def find_weights(weights: str, project: str | Path = "runs") -> tuple[Path, str | None]:
    """(the file `--weights` means, the line that says which when it was looked up, else None).

    A path that exists is itself. A bare run-file name (best_model.pth or last.pth, no folder) that is no
    file here is the newest project/*/<name> (`newest`), so `--weights best_model.pth` after
    a run means that run's. Anything else is returned as given, for the reader to judge. Raises
    UserError for a bare run-file name when no run has that file.
    """
    path = Path(weights)
    if path.exists() or path.name not in (BEST, LAST) or path.parent != Path("."):
        return path, None
    found = [p for p in Path(project).glob(f"*/{path.name}") if p.is_file()]
    if not found:
        raise UserError(f"--weights {weights}: no such file here and no run under {project}/ has one; train a "
                        f"run first ({invocation.command('train', '')}) or pass its path "
                        f"(e.g. {project}/exp/{path.name})")
    chosen, how = newest(found)
    others = f" of {len(found)} runs, {how}" if len(found) > 1 else ""
    return chosen, f"--weights {weights}: {printable(chosen)} (the newest run's{others})"


def find_resume(resume: str, project: str | Path = "runs") -> Path:
    """The run file to resume: `resume` itself, or for 'auto' the newest project/*/last.pth (`newest`).

    Raises UserError when the file does not exist or no run has a last.pth.
    """
    return find_resume_said(resume, project)[0]


def find_resume_said(resume: str, project: str | Path = "runs") -> tuple[Path, str | None]:
    """(`find_resume`, the line that names the file --resume auto chose and how, else None)."""
    if resume.strip().lower() == "auto":
        candidates = [p for p in Path(project).glob(f"*/{LAST}") if p.is_file()]
        if not candidates:
            raise UserError(f"--resume auto found no {project}/*/{LAST} to continue; start a run first "
                            "or pass the run file's path")
        chosen, how = newest(candidates)
        others = f" of {len(candidates)} runs, {how}" if len(candidates) > 1 else ""
        return chosen, f"--resume auto: {printable(chosen)} (the newest run's{others})"
    path = Path(resume)
    if path.is_dir():
        path = path / LAST
    if not path.is_file():
        raise UserError(f"--resume {resume}: no such run file; pass a {LAST} path "
                        f"(e.g. {project}/exp/{LAST}) or --resume auto")
    return path, None


def resumed_device(cfg: Any) -> Any:
    """`cfg` with the device of the run it resumes where the command names none (--device auto): a resume
    goes on where the run was, a CPU run on the CPU. Read here, before any process starts (the GPU check
    would refuse a CPU run), from the config.yaml beside the file (its `device:` line); the trainer takes
    the same value from the file itself (dlenv.runfolder.trainstate.RESUME_FROM_RUN_UNLESS_GIVEN)."""
    if not cfg.resume or cfg.device != "auto":
        return cfg
    try:
        path = find_resume(cfg.resume, cfg.project)
        text = safeio.read_text(path.parent / "config.yaml", what="config.yaml")
    except (UserError, OSError):  # no file, or none beside it: the trainer says what is wrong
        return cfg
    found = re.search(r"^device: ([\w:]+)$", text, re.M)
    return dataclasses.replace(cfg, device=found[1]) if found and found[1] != "auto" else cfg


def check_replaceable(out: Path, source: Path, flag: str = "--out") -> Path:
    """`out`, unless writing it would destroy what the user has: the input file itself (`source`), or one of
    a run folder's own files (OWN_FILES in a folder that holds a config.yaml). An earlier output of the same
    command (runs/exp/best_model_pruned.pth) may be replaced. UserError naming the file and a free name."""
    if not out.exists():
        return out
    free = printable(out.with_name(f"{out.stem}_out{out.suffix}"))
    if out.resolve() == source.resolve():
        raise UserError(f"{flag} {printable(out)} is the input file; write to another file, e.g. {free}")
    if out.name in OWN_FILES and (out.parent / "config.yaml").is_file():
        raise UserError(f"{flag} {printable(out)} would replace the {out.name} of the run in {printable(out.parent)}, "
                        f"and that run would be lost; pass a new name, e.g. {free}")
    return out
