"""One GPU shared by the workers of `pytest -m gpu -n 4` (scripts/gpu_all.sh).

Most GPU tests use a few GiB and run side by side; a `whole_gpu` test (one that fills the card to an
out-of-memory, probes it for the largest batch, or compares speeds) runs alone. A readers-writer lock on a
file the workers share, with a turnstile so that a waiting `whole_gpu` test is not starved by a stream of
shared ones. Outside xdist (one process): nothing to share, nothing taken.

`share(alone)` is the lock itself, for a module fixture that measures on the card (module fixtures are
set up before the per-test lock is taken). DLENV_GPU_TIMELINE=FILE appends, per test, when it asked for the
card, when it got it and when it let go: where a suite's wall time goes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time


@contextlib.contextmanager
def share(alone: bool, name: str = ""):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = os.path.join(tempfile.gettempdir(), f"dlenv-gpu-{run}")
    asked = time.time()
    with open(base + ".turnstile", "a") as gate, open(base + ".lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        got = time.time()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            _timeline(name, alone, asked, got, time.time())


def _timeline(name: str, alone: bool, asked: float, got: float, done: float) -> None:
    path = os.environ.get("DLENV_GPU_TIMELINE")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{worker}\t{'alone' if alone else 'shared'}\t{asked:.2f}\t{got:.2f}\t{done:.2f}\t{name}\n")


AS_ON = 24  # GiB: the card of issue 54's notebook user; an out-of-memory test fills this much, not an H200's 141


@contextlib.contextmanager
def card_of(gib: float = AS_ON):
    """This process sees a card of `gib` GiB (PyTorch's per-process cap): an out-of-memory comes as on such a
    card, in a fraction of the time that filling a whole H100 or H200 takes, and leaves the rest to the tests
    beside it. Yields the batch of ResNet-50 fp32 at 224 px that needs twice that (about 21 GiB per 256)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    torch.cuda.empty_cache()  # the cap counts what is reserved
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib / total))
    try:
        yield int(min(gib, total) / 21 * 256 * 2)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
