"""`dlenv watch`'s runner: the command started in a session of its own and tied to the watcher's life
(`leash`: every signal passed on to its group, PR_SET_PDEATHSIG, a keeper of its group), samples taken
every interval into watch.csv, then watch.png, watch.md and the paragraph. No torch here."""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, environment_fault, printable, with_path
from dlenv.files.atomic import write_text
from dlenv.watch import leash
from dlenv.watch.advice import advise, host_line, paragraph, summarize
from dlenv.watch.probes import Host, Nvml, Sample
from dlenv.watch.record import csv_columns, csv_row, plot

#: a shell's statuses for a command it could not run
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126


def _exit_status(rc: int) -> int:
    """The command's exit status as a shell gives it: a signal n is 128+n."""
    return 128 - rc if rc < 0 else rc


def cannot_start(command: Sequence[str], exc: OSError) -> UserError:
    """The one line for a command that could not be started, with a shell's status (127 not found, 126
    the rest: not executable, no `#!` line, a folder)."""
    name = printable(command[0])
    if isinstance(exc, FileNotFoundError):
        return UserError(f"{name!r} not found on PATH; give the command as you would type it, after --: "
                         "dlenv watch -- python train.py", EXIT_NOT_FOUND)
    if exc.errno == errno.ENOEXEC:
        why = "it is not a program the system can run (a script without a #! line?); name its interpreter: " \
              f"dlenv watch -- bash {name} (or python {name})"
    elif isinstance(exc, PermissionError):
        why = f"permission denied; chmod +x {name}, or name its interpreter: dlenv watch -- python {name}"
    else:
        why = f"{exc.strerror or exc}"
    return UserError(f"{name!r} cannot be run: {why}", EXIT_CANNOT_RUN)


class _Record:
    """watch.csv, written as samples come; a write that fails (a full disk) stops the recording with one
    line that names the file, and the command goes on, watched to its end."""

    def __init__(self, path: Path, columns: list[str], say) -> None:
        self.path, self.say, self.fh = path, say, None
        self._do(lambda: self._open(columns))

    def _open(self, columns: list[str]) -> None:
        self.fh = self.path.open("w", newline="", encoding="utf-8")
        self.writer = csv.writer(self.fh)
        self.writer.writerow(columns)

    def write(self, row: list[Any]) -> None:
        if self.fh is not None:
            self._do(lambda: (self.writer.writerow(row), self.fh.flush()))  # a kill leaves what was seen

    def _do(self, work) -> None:
        try:
            work()
        except OSError as e:
            line = environment_fault(with_path(e, self.path)) or f"{self.path}: {e.strerror or e}"
            self.say(f"dlenv watch: cannot write the record: {line}; recording stopped, the command goes on")
            self.close()

    def close(self) -> None:
        fh, self.fh = self.fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # nothing is left in its buffer: each row was flushed
                fh.close()


def _run(command: Sequence[str], record: _Record, host_of, sample, interval: float):
    """Start `command` tied to the watcher, sample it every `interval` s until it ends; returns (proc,
    host). Raises UserError (126/127) where it cannot be started."""
    keeper = leash.Keeper()
    with leash.forwarding() as fwd:  # in place before the command starts: no signal falls between
        try:
            proc = leash.start(command)
        except OSError as e:
            keeper.release()
            raise cannot_start(command, e) from None
        keeper.hold(proc.pid)
        fwd.deliver(proc.pid)
        try:
            host = host_of(proc.pid)
            host.sample()  # the baseline of the CPU and disk counters
            while True:
                try:
                    proc.wait(timeout=interval)
                    break
                except subprocess.TimeoutExpired:
                    pass
                record.write(sample(host))
        finally:
            if proc.poll() is not None:  # else the watcher is failing: the keeper ends the group with it
                keeper.release()
    return proc, host


def watch(command: Sequence[str], out: Path, interval: float = 1.0, say=print) -> int:
    """Run `command`, sample the GPUs and the host every `interval` s into out/watch.csv, then write
    watch.png and watch.md and print the paragraph. Returns the command's exit status (128+n for a
    signal n), also where the record could not be written (each such file named in one line). Raises
    UserError with 127 (not found) or 126 (cannot be run) where the command cannot be started."""
    nvml, no_gpu = Nvml.open()
    names = nvml.names if nvml else []
    if no_gpu:
        say(f"dlenv watch: {no_gpu}; running the command and recording the host only")
    else:
        say(f"dlenv watch: watching {', '.join(f'GPU {i} ({n})' for i, n in enumerate(names))} every "
            f"{interval:g} s; the record goes to {out}")
    samples: list[Sample] = []
    t0 = time.monotonic()
    record = _Record(out / "watch.csv", csv_columns(len(names)), say)

    def sample(host: Host) -> list[Any]:
        s = Sample(t=time.monotonic() - t0, **host.sample(), gpus=nvml.sample() if nvml else [])
        samples.append(s)
        return csv_row(s)

    try:
        proc, host = _run(command, record, lambda pid: Host(pid, _affinity(pid)), sample, interval)
    finally:
        record.close()
        if nvml:
            nvml.close()
    rc = proc.returncode
    seconds = time.monotonic() - t0
    status = _exit_status(rc)
    summaries = summarize(samples, names)
    advice = advise(samples, names) if names and samples else []
    n_cpus = len(host.cpus or ()) or os.cpu_count() or 1
    text = paragraph(summaries, advice, seconds, no_gpu, host_line(samples, n_cpus))
    how = f"exit status {status}" + (f" ({signal.Signals(-rc).name})" if rc < 0 and -rc in
                                     signal.Signals._value2member_map_ else "")
    md = (f"# dlenv watch: {' '.join(command)}\n\n{len(samples)} samples every {interval:g} s over {seconds:.0f} s; "
          f"the command ended with {how}.\n\n{text}\n")
    written = ["watch.csv"] if (out / "watch.csv").is_file() else []
    written += _write_each(out, say, [
        ("watch.md", lambda: write_text(out / "watch.md", md)),
        ("watch.png", (lambda: plot(samples, names, out / "watch.png",
                                    f"{' '.join(command)[:100]}  ({seconds:.0f} s)", n_cpus)) if samples else None)])
    say("")
    say(text)
    say(f"dlenv watch: {how}; record in {out} ({', '.join(written) or 'nothing could be written'})")
    return status


def _write_each(out: Path, say, files) -> list[str]:
    """Write each (name, how) whose how is not None; a file that cannot be written (OSError, or a
    UserError from the atomic writer) is one line and the others are still written. Returns the names
    written."""
    done = []
    for name, how in files:
        if how is None:
            continue
        try:
            how()
            done.append(name)
        except OSError as e:
            line = environment_fault(with_path(e, out / name)) or f"{out / name}: {e.strerror or e}"
            say(f"dlenv watch: cannot write {name}: {line}")
        except UserError as e:
            say(f"dlenv watch: cannot write {name}: {e}")
    return done


def _affinity(pid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def main(cfg: Any) -> int:
    """`dlenv watch -- COMMAND ...`: the command run and watched; returns its exit status."""
    from dlenv import runfolder

    if not cfg.run:
        raise UserError("no command to watch; give it after --, e.g. dlenv watch -- python train.py "
                        "(invoke watch --run 'python train.py')")
    out = runfolder.new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
    sys.stdout.flush()
    return watch(cfg.run, out, cfg.interval)

