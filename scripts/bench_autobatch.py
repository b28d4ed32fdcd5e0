"""How good is `--batch-size auto`? find_max_batch against the true largest batch.

The true largest batch: each candidate runs a few real training steps (forward, backward, SGD step)
in a fresh process, so no try inherits another's cached memory; candidates are bracketed around
find_max_batch's raw answer and bisected to within 0.5%. find_max_batch itself runs the way the
trainer runs it: one process, one probe, doubling then bisection, then the safety margin. It
prints both, the ratio, and the search time (targets: within 10% and under 60 s for ResNet-50).

    python3 scripts/bench_autobatch.py                       # ResNet-50, 224 px, AMP
    python3 scripts/bench_autobatch.py --model vit_b_16 --checkpoint

Needs a CUDA GPU. dlenv need not be installed: src/ is put on the path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

FITS, OOM = 0, 3  # exit codes of a --try worker


def _setup(a: argparse.Namespace):
    import torch

    from dlenv.engine.precision import resolve_precision
    from dlenv.model.models import build_model

    dev = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True  # as the trainer sets it
    mode = resolve_precision(a.amp, a.amp_dtype, dev)

    def factory():
        torch.manual_seed(0)
        return build_model(a.model, 1000)

    return dev, mode, factory


def train_steps(a: argparse.Namespace, batch: int) -> int:
    """Inside a fresh process: `a.true_steps` training steps as the trainer runs them; FITS or OOM."""
    import torch
    import torch.nn.functional as F

    from dlenv.compat import is_oom
    from dlenv.engine.precision import Precision
    from dlenv.model.checkpointing import apply_checkpointing

    dev, mode, factory = _setup(a)
    model = factory()
    if a.checkpoint:
        apply_checkpointing(model)
    model = model.to(dev).train()
    precision = Precision(mode, dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    try:
        for _ in range(a.true_steps):
            x = torch.randn(batch, 3, a.img_size, a.img_size, device=dev)
            y = torch.randint(0, 1000, (batch,), device=dev)
            with precision.autocast():
                loss = F.cross_entropy(model(x), y)
            precision.backward(loss)
            precision.step(opt)
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    except Exception as e:
        if is_oom(e):
            return OOM
        raise
    return FITS


def try_in_fresh_process(a: argparse.Namespace, batch: int) -> bool:
    """Whether `batch` fits: real training steps in a fresh Python process."""
    cmd = [sys.executable, __file__, "--try-batch", str(batch), "--model", a.model, "--img-size",
           str(a.img_size), "--amp-dtype", a.amp_dtype, "--true-steps", str(a.true_steps)]
    cmd += ["--amp"] if a.amp else ["--no-amp"]
    cmd += ["--checkpoint"] if a.checkpoint else []
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True)
    if proc.returncode not in (FITS, OOM):
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"worker for batch {batch} failed with exit code {proc.returncode}")
    print(f"  true search: batch {batch}: {'fits' if proc.returncode == FITS else 'out of memory'}",
          file=sys.stderr, flush=True)
    return proc.returncode == FITS


def true_largest(a: argparse.Namespace, guess: int) -> tuple[int, int]:
    """(largest batch that fits, smallest that does not), bracketed from `guess` in 1% steps, then
    bisected to 0.5% (each try is a fresh process of ~15 s, so exact to the image would take long)."""
    step = max(1, guess // 100)
    if try_in_fresh_process(a, guess):
        lo, hi = guess, guess + step
        while try_in_fresh_process(a, hi):
            lo, hi = hi, hi + step
    else:
        hi, lo = guess, max(1, guess - step)
        while not try_in_fresh_process(a, lo):
            if lo == 1:
                raise SystemExit("even batch 1 does not fit")
            hi, lo = lo, max(1, lo - step)
    while hi - lo > max(1, lo // 200):
        mid = (lo + hi) // 2
        if try_in_fresh_process(a, mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--amp-dtype", default="auto", choices=("auto", "fp16", "bf16"))
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--true-steps", type=int, default=3, help="training steps per try of the true search")
    p.add_argument("--start", type=int, default=1, help="find_max_batch's first try")
    p.add_argument("--try-batch", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()

    from dlenv.engine.autobatch import find_max_batch
    from dlenv.engine.stepprobe import make_train_step_probe

    if a.try_batch:
        return train_steps(a, a.try_batch)

    t0 = time.perf_counter()
    dev, mode, factory = _setup(a)
    probe = make_train_step_probe(factory, mode, a.checkpoint, a.img_size, 1000, dev)
    tries: list[tuple[int, bool]] = []

    def logged(batch: int) -> bool:
        t = time.perf_counter()
        ok = probe(batch)
        tries.append((batch, ok))
        print(f"  find_max_batch: batch {batch}: {'fits' if ok else 'out of memory'} "
              f"({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
        return ok

    auto = find_max_batch(logged, start=a.start, what=a.model)
    seconds = time.perf_counter() - t0
    probe.close()
    raw = max(b for b, ok in tries if ok)
    print(f"find_max_batch: raw {raw}, with safety margin {auto}, {len(tries)} tries, {seconds:.1f} s",
          file=sys.stderr)

    true, fails = true_largest(a, raw)
    import torch

    print(f"\n{a.model}, {a.img_size} px, {mode}{', checkpointing' if a.checkpoint else ''} on "
          f"{torch.cuda.get_device_name(0)}; PyTorch {torch.__version__}. True: {a.true_steps} training steps "
          "in a fresh process per try, cuDNN autotuning on, as the trainer runs.\n")
    print("| true largest batch | find_max_batch raw | auto (with margin) | auto / true | tries | search s |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {true} (fails at {fails}) | {raw} | {auto} | {auto / true:.3f} | {len(tries)} | {seconds:.1f} |")
    within = abs(auto / true - 1) <= 0.10
    fast = seconds < 60
    print(f"\nwithin 10% of the true largest: {'PASS' if within else 'FAIL'}; "
          f"under 60 s: {'PASS' if fast else 'FAIL'}")
    return 0 if within and fast else 1


if __name__ == "__main__":
    raise SystemExit(main())
