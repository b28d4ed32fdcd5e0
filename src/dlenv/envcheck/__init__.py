"""verify-env: can this environment train on a GPU? One screen to paste into a bug report.

Four steps, each a small function, so tests on a CPU can feed made-up facts (an sm_90 GPU with
PyTorch 1.13's arch list, a 64 MB /dev/shm) through the same checks a real run uses:

    collect()  -> Facts        versions, pins, driver, GPUs, real kernel runs, /dev/shm, disk, CPUs  (facts)
    checks()   -> [Check]      each fact judged: ok / warn / fail / info, with a one-line fix      (judge)
    verdict()  -> (ok, line)   ok only when nothing failed (a GPU is needed unless --allow-cpu)    (judge)
    render_text() / render_json()                                                                 (render)

The profiles' pins are read by `pins`, the kernel runs are `kernels`.

The kernel check runs conv2d and matmul, forward and backward, on each GPU in fp32, fp16 and (from
sm_80) bf16, and compares outputs and gradients with the same inputs computed in fp32 on the CPU.
torch is imported only inside collect(), so a broken torch install is itself reported as a fact.
"""

from __future__ import annotations

import sys
from typing import Any

from dlenv.envcheck.facts import Facts, Gpu, Kernel, collect, cuda_string, cudnn_string, parse_nvidia_smi
from dlenv.envcheck.judge import Check, checks, verdict
from dlenv.envcheck.kernels import kernel_check, kernel_dtypes, relative_error
from dlenv.envcheck.pins import pin_matches, profile_name, read_pins
from dlenv.envcheck.render import render_json, render_text

__all__ = ["Check", "Facts", "Gpu", "Kernel", "checks", "collect", "cuda_string", "cudnn_string", "kernel_check",
           "kernel_dtypes", "main", "parse_nvidia_smi", "pin_matches", "profile_name", "read_pins", "relative_error",
           "render_json", "render_text", "verdict"]


def main(cfg: Any) -> int:
    """`dlenv verify-env` / `invoke verify-env`: print the screen (or JSON); 0 only if it can train.

    A failure also goes to stderr as one line, so `verify-env > report.txt` still shows why.
    """
    facts = collect(cfg.workers)
    results = checks(facts, cfg.allow_cpu)
    ok, line = verdict(facts, results, cfg.allow_cpu)
    if cfg.json:
        print(render_json(facts, results, ok, line))
    else:
        print(render_text(facts, results, line if ok else None))
    sys.stdout.flush()
    if not ok:
        print(f"verify-env: {line}", file=sys.stderr)
    return 0 if ok else 1
