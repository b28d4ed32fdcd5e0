"""How many DataLoader workers a loader gets: the one sizing rule (`decide_workers`), and what the workers'
batches in flight take in /dev/shm (`shipped_bytes`, `shm_per_worker`).

Deciding reads the CPUs this process may use and /dev/shm's free space; it builds nothing and says
nothing. A reduction comes back as the sentence that says why: the input plan (dlenv.data.plan) keeps it
for the trainer to say with its other decisions, and the eval loader (dlenv.data.loaders) logs it.
"""

from __future__ import annotations

import shutil

from dlenv.data.decode import stored_size
from dlenv.errors import UserError
from dlenv.options.cpus import auto_workers, usable_cpus, workers_that_fit

#: batches each worker prepares ahead (DataLoader's prefetch_factor); also what sizes the /dev/shm check
PREFETCH_FACTOR = 4


def shipped_bytes(img_size: int, on_device: bool) -> int:
    """One sample as DataLoader workers ship it: a uint8 stored square on the device path
    (dlenv.data.fastpath crops it on the GPU), a float32 crop on the CPU path."""
    side = stored_size(img_size)
    return 3 * side * side if on_device else 3 * img_size * img_size * 4


def shm_per_worker(batch_size: int, sample_bytes: int) -> int:
    """Bytes of /dev/shm one DataLoader worker's batches in flight take: PREFETCH_FACTOR batches of
    `sample_bytes` samples (as the workers ship them), with 50% headroom."""
    return int(batch_size * sample_bytes * PREFETCH_FACTOR * 1.5)


def decide_workers(workers: int | str, batch_size: int | None = None, img_size: int = 224,
                   shm: str = "/dev/shm", sample_bytes: int | None = None, share: int = 1) -> tuple[int, str]:
    """(DataLoader worker count, why it is fewer than asked: "" when it is not): a number given, or 'auto'
    (`auto_workers` of the usable CPUs), reduced so the batches in flight fit in /dev/shm. Workers pass
    every batch through shared memory, and a worker that writes past a full /dev/shm dies of SIGBUS
    mid-run (Docker's default is 64 MiB: two workers' float32 batches of 64 x 224 px need ~300 MiB), so a
    number given is held to what fits too (`workers_that_fit`); 0 loads in the main process, which needs
    no shared memory. The sentence for a reduction names --ipc=host / --shm-size. `sample_bytes`: one
    sample as the workers ship it (default: the CPU path's float32 3 x img_size^2; the device path ships
    uint8 stored squares, a third of that). `share`: processes of the node that each start this many
    workers (a number given with --gpus N): each is held to its share of the free space. Raises UserError
    for anything else.
    """
    if isinstance(workers, str) and workers.strip().isdigit():
        workers = int(workers)
    given = isinstance(workers, int) and not isinstance(workers, bool)
    if given:
        if workers < 0:
            raise UserError(f"workers {workers} must be 0 or more (or auto)")
        n = workers
    elif str(workers).strip().lower() != "auto":
        raise UserError(f"workers {workers!r} must be a number or auto")
    else:
        n = auto_workers(usable_cpus())
    if n == 0:
        return 0, ""
    try:
        usage = shutil.disk_usage(shm)
    except OSError:  # no /dev/shm (not Linux): nothing to size against
        return n, ""
    per_worker = shm_per_worker(batch_size or 64, sample_bytes or shipped_bytes(img_size, False))
    fit = workers_that_fit(n, usage.total, usage.free // max(1, share), per_worker, given=given)
    if fit >= n:
        return n, ""
    asked = f"--workers {n}" if given else f"the {n} workers --workers auto picks"
    instead = f"{fit} worker{'s' if fit > 1 else ''}" if fit else "0 workers (loading in the main process, slower)"
    return fit, (f"{shm} has {usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB, too little for "
                 f"{asked} (~{per_worker / 2**20:.0f} MiB of batches in flight each); using {instead}. "
                 "Start the container with --ipc=host or --shm-size=8g for more")
