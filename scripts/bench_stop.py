"""How long a stop takes: SIGTERM to `dlenv train --gpus 2 --device cpu` (two ranks talking gloo, the stop
vote's path) in the middle of an optimizer step, to the line that says last.pth is saved, for steps of 1 s
and 10 s (a model of its own whose forward sleeps that long; docs/distributed.md, "Stopping").

    python scripts/bench_stop.py [--steps 1,10] [--into 0.3]

For each step time: trains the demo data (written small, once), waits for the progress line after the first
step, waits `--into` of a step more, sends SIGTERM to the launcher (which passes it to every rank, as Slurm
and Docker signal every process), and times, from the signal: the signal's own line (the way on), the
`stopping after optimizer step` line (before the save), `stopped by ...; saved` (after it), and the exit.
One line per step time; the numbers go to docs, with this command and the machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = '''
import time

from torch import nn


class Slow(nn.Module):
    """A linear classifier whose training forward takes STEP_S seconds."""

    def __init__(self, num_classes, step_s):
        super().__init__()
        self.fc, self.step_s = nn.Linear(3, num_classes), step_s

    def forward(self, x):
        if self.training:
            time.sleep(self.step_s)
        return self.fc(x.mean((2, 3)))


def factory(num_classes, step_s=1.0):
    return Slow(num_classes, float(step_s))
'''


def measure(folder: Path, step_s: float, into: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "dlenv", "train", "--gpus", "2", "--device", "cpu", "--data", str(folder / "demo"),
           "--model", f"{folder / 'slow.py'}:factory", "--model-args", f"step_s={step_s}", "--img-size", "32",
           "--batch-size", "2", "--workers", "0", "--epochs", "1", "--project", str(folder / "runs"), "--exist-ok",
           "--name", f"step{step_s:g}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: dict[str, float] = {}
    marks = {"way on": "SIGTERM: saving last.pth", "stopping": "stopping after optimizer step",
             "saved": "stopped by SIGTERM; saved", "first step": "epoch 1/1"}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            for name, text in marks.items():
                if text in line and name not in seen:
                    seen[name] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while "first step" not in seen:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("bench_stop: no progress line after the first step:\n" + "".join(lines[-20:]))
        time.sleep(0.01)
    time.sleep(into * step_s)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=600)
    t_exit = time.monotonic()
    reader.join(timeout=10)
    if "saved" not in seen:
        raise SystemExit(f"bench_stop: no 'saved' line (exit {rc}):\n" + "".join(lines[-20:]))
    return {"step_s": step_s, "exit": rc, **{k: seen[k] - t0 for k in ("way on", "stopping", "saved") if k in seen},
            "exited": t_exit - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1,10", help="step times in seconds, comma-separated")
    ap.add_argument("--into", type=float, default=0.3, help="how far into a step the signal comes (0..1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "slow.py").write_text(MODEL)
        subprocess.run([sys.executable, "-m", "dlenv", "demo-data", "--dest", str(folder / "demo"),
                        "--train-per-class", "4", "--val-per-class", "1", "--size", "32"], check=True,
                       capture_output=True)
        for step_s in (float(s) for s in args.steps.split(",")):
            r = measure(folder, step_s, args.into)
            print(f"step {step_s:g} s, SIGTERM {args.into:.0%} into a step of 2 CPU ranks: the way on after "
                  f"{r.get('way on', float('nan')):.2f} s, 'stopping' (before the save) after "
                  f"{r.get('stopping', float('nan')):.2f} s, saved after {r['saved']:.2f} s, exit {r['exit']} after "
                  f"{r['exited']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
