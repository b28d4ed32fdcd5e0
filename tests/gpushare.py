"""One GPU shared by the workers of `pytest -m gpu -n 4` (scripts/gpu_all.sh).

Most GPU tests use a few GiB and run side by side. Three kinds of test, three ways to hold the card:
- a `whole_gpu` test (one that compares speeds) has it alone: a readers-writer lock on a file the workers
  share, with a turnstile so that a waiting `whole_gpu` test is not starved by a stream of shared ones. The
  suite runs these last (conftest), when no long shared test can hold the turnstile's queue;
- a test that fills a card to an out-of-memory or probes it for the largest batch does so on a card of its
  own size (`card_of`, PyTorch's per-process cap), and takes one of the card's places of that size (`place`),
  so that the capped tests beside each other and the small ones never add up to more than the card;
- the rest share it.
Outside xdist (one process): nothing to share, nothing taken.

`share(alone)` is the lock itself, for a module fixture that measures on the card (module fixtures are
set up before the per-test lock is taken). DLENV_GPU_TIMELINE=FILE appends, per test and per place, when it
asked for the card, when it got it and when it let go: where a suite's wall time goes.
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
            _timeline(name, 'alone' if alone else 'shared', asked, got, time.time())


def _timeline(name: str, kind: str, asked: float, got: float, done: float) -> None:
    path = os.environ.get("DLENV_GPU_TIMELINE")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{worker}\t{kind}\t{asked:.2f}\t{got:.2f}\t{done:.2f}\t{name}\n")


AS_ON = 24  # GiB: the card of issue 54's notebook user; an out-of-memory test fills this much, not an H200's 141
SMALL = 16  # GiB left to the small tests beside the capped ones (the largest use about 8)


def places(total_gib: float) -> int:
    """How many cards of AS_ON GiB fit beside the small tests on a card of `total_gib`: 2 on an H100 80GB,
    5 on an H200 (more than the 4 workers)."""
    return max(1, int((total_gib - SMALL) // AS_ON))


@contextlib.contextmanager
def place(total_gib: float | None = None):
    """One of the card's places of AS_ON GiB, for as long as a test (or the Jupyter kernel it drives) fills
    or probes that much; waits while every place is taken. `total_gib`: the card's (default: GPU 0's)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    if total_gib is None:
        import torch

        total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    n = places(total_gib)
    base = os.path.join(tempfile.gettempdir(), f"dlenv-gpu-{run}")
    name = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    asked = time.time()
    while True:
        for i in range(n):
            fh = open(f"{base}.place{i}", "a")  # noqa: SIM115 (held for the test's duration, closed below)
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            got = time.time()
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
                _timeline(name, f"place{i}", asked, got, time.time())
            return
        time.sleep(0.2)


@contextlib.contextmanager
def card_of(gib: float = AS_ON):
    """This process sees a card of `gib` GiB (at most AS_ON; PyTorch's per-process cap), in one of the card's
    places: an out-of-memory comes as on such a card, in a fraction of the time that filling a whole H100 or
    H200 takes, and leaves the rest to the tests beside it. Yields the batch of ResNet-50 fp32 at 224 px that
    needs twice that (about 21 GiB per 256)."""
    import torch

    assert gib <= AS_ON, f"a card of {gib} GiB does not fit one place of {AS_ON}"
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    with place(total):
        torch.cuda.empty_cache()  # the cap counts what is reserved: what earlier tests of this process still
        held = torch.cuda.memory_reserved(0) / 2**30  # hold comes on top, or a 2 GiB card had no room at all
        torch.cuda.set_per_process_memory_fraction(min(1.0, (gib + held) / total))
        try:
            yield int(min(gib, total) / 21 * 256 * 2)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
