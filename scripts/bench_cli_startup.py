"""Startup time of `dlenv --help` and `invoke --list`, and proof that neither imports torch.

    python3 scripts/bench_cli_startup.py [--runs 10] [--limit 0.5]

Each command runs once to warm the file cache, then --runs times; the table gives min / median / max
wall time of the whole process (what a user waits for) and whether torch was imported, read from
`python -X importtime`. Exits 1 if a median is over --limit seconds or torch was imported.
Where the dlenv console script or invoke is not installed, it runs `python -m dlenv` from ./src and
marks invoke as missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # dlenv from this checkout where it is not installed


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    return env


def commands() -> list[tuple[str, list[str] | None, list[str], Path]]:
    """(label, argv to time or None if missing, python -m argv for the import check, cwd)."""
    py = sys.executable
    dlenv = shutil.which("dlenv")
    out = [("dlenv --help", [dlenv, "--help"] if dlenv else [py, "-m", "dlenv", "--help"],
            ["-m", "dlenv", "--help"], REPO)]
    # the image's /etc/invoke.yaml finds dlenv's tasks from its workspace; elsewhere this repo's tasks.py
    cwd = Path("/root/workspace") if Path("/etc/invoke.yaml").is_file() else REPO
    if importlib.util.find_spec("invoke") is None:
        out.append(("invoke --list", None, [], cwd))
    else:
        invoke = shutil.which("invoke")
        out.append(("invoke --list", [invoke, "--list"] if invoke else [py, "-m", "invoke", "--list"],
                    ["-m", "invoke", "--list"], cwd))
    return out


def imports_torch(module_argv: list[str], cwd: Path) -> bool:
    """Whether `python -X importtime <module_argv>` imports torch (importtime lists every module)."""
    r = subprocess.run([sys.executable, "-X", "importtime", *module_argv], capture_output=True, text=True,
                       cwd=cwd, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(module_argv)} failed: {r.stderr.strip().splitlines()[-1:]}")
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return "torch" in names


def timings(argv: list[str], cwd: Path, runs: int) -> list[float]:
    """Wall seconds of `runs` runs of argv, after one untimed warm-up run."""
    subprocess.run(argv, capture_output=True, cwd=cwd, env=_env(), check=True)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, cwd=cwd, env=_env(), check=True)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    parser.add_argument("--limit", type=float, default=0.5, help="median seconds allowed (default 0.5)")
    args = parser.parse_args()

    print(f"python {sys.version.split()[0]} · {os.cpu_count()} CPUs · {args.runs} runs each")
    print(f"{'command':<16} {'min s':>7} {'median s':>9} {'max s':>7}  {'torch':<8} verdict")
    ok = True
    for label, argv, module_argv, cwd in commands():
        if argv is None:
            print(f"{label:<16} {'-':>7} {'-':>9} {'-':>7}  {'-':<8} not installed here")
            continue
        t = timings(argv, cwd, args.runs)
        torch_loaded = imports_torch(module_argv, cwd)
        med = statistics.median(t)
        good = med < args.limit and not torch_loaded
        ok &= good
        verdict = "ok" if good else ("imports torch" if torch_loaded else f"over {args.limit} s")
        print(f"{label:<16} {min(t):>7.3f} {med:>9.3f} {max(t):>7.3f}  "
              f"{'yes' if torch_loaded else 'no':<8} {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
