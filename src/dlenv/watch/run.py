"""`dlenv watch`'s runner: the command started in a session of its own, signals passed on to its group,
samples taken every interval into watch.csv, then watch.png, watch.md and the paragraph. No torch here."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlenv.errors import UserError
from dlenv.watch.advice import advise, host_line, paragraph, summarize
from dlenv.watch.probes import Host, Nvml, Sample
from dlenv.watch.record import csv_columns, csv_row, plot


def _exit_status(rc: int) -> int:
    """The command's exit status as a shell gives it: a signal n is 128+n."""
    return 128 - rc if rc < 0 else rc


def _start(command: Sequence[str]) -> subprocess.Popen:
    try:
        return subprocess.Popen(list(command), start_new_session=True)
    except FileNotFoundError:
        raise UserError(f"{command[0]!r} not found on PATH; give the command as you would type it, "
                        "after --: dlenv watch -- python train.py") from None
    except PermissionError:
        raise UserError(f"{command[0]!r} cannot be run (permission denied; chmod +x, or "
                        f"python {command[0]})") from None


def _forwarding(proc: subprocess.Popen):
    """SIGINT, SIGTERM and SIGHUP passed on to the command's whole process group while it runs."""
    @contextlib.contextmanager
    def ctx():
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def forward(signum: int, frame: Any) -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    return ctx()


def watch(command: Sequence[str], out: Path, interval: float = 1.0, say=print) -> int:
    """Run `command`, sample the GPUs and the host every `interval` s into out/watch.csv, then write
    watch.png and watch.md and print the paragraph. Returns the command's exit status (128+n for a
    signal n)."""
    nvml, no_gpu = Nvml.open()
    names = nvml.names if nvml else []
    if no_gpu:
        say(f"dlenv watch: {no_gpu}; running the command and recording the host only")
    else:
        say(f"dlenv watch: watching {', '.join(f'GPU {i} ({n})' for i, n in enumerate(names))} every "
            f"{interval:g} s; the record goes to {out}")
    samples: list[Sample] = []
    csv_path = out / "watch.csv"
    t0 = time.monotonic()
    proc = _start(command)
    try:
        host = Host(proc.pid, _affinity(proc.pid))
        with _forwarding(proc), csv_path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(csv_columns(len(names)))
            host.sample()  # the baseline of the CPU and disk counters
            while True:
                try:
                    rc = proc.wait(timeout=interval)
                    break
                except subprocess.TimeoutExpired:
                    pass
                s = Sample(t=time.monotonic() - t0, **host.sample(), gpus=nvml.sample() if nvml else [])
                samples.append(s)
                writer.writerow(csv_row(s))
                fh.flush()  # a kill of the watcher leaves what was seen
    finally:
        if nvml:
            nvml.close()
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
    from dlenv.files.atomic import write_text

    write_text(out / "watch.md", md)
    if samples:
        plot(samples, names, out / "watch.png", f"{' '.join(command)[:100]}  ({seconds:.0f} s)", n_cpus)
    say("")
    say(text)
    say(f"dlenv watch: {how}; record in {out} (watch.csv, watch.md" + (", watch.png)" if samples else ")"))
    return status


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

