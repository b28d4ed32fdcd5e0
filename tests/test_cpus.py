"""dlenv.options.cpus: the CPUs a container really gives us, and the DataLoader workers auto starts on them."""

from __future__ import annotations

import os

import pytest

from dlenv.options import cpus


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    quota = tmp_path / "cpu.max"
    real_path = cpus.Path

    def fake_path(p):
        return quota if str(p) == "/sys/fs/cgroup/cpu.max" else real_path(p)

    monkeypatch.setattr(cpus, "Path", fake_path)
    quota.write_text("max 100000\n")
    assert cpus.usable_cpus() == 8          # no quota: the mask
    quota.write_text("250000 100000\n")
    assert cpus.usable_cpus() == 2          # docker --cpus 2.5 -> 2 whole CPUs
    quota.write_text("50000 100000\n")
    assert cpus.usable_cpus() == 1          # never below one
    quota.unlink()
    assert cpus.usable_cpus() == 8          # no cgroup v2 file: the mask


@pytest.mark.parametrize("n_cpus, workers", [(1, 1), (2, 2), (4, 4), (8, 8), (9, 8), (10, 8), (12, 10),
                                              (16, 14), (24, 22), (34, 32), (96, 32)])
def test_auto_workers_leave_the_trainer_two_cores_above_eight(n_cpus, workers):
    assert cpus.auto_workers(n_cpus) == workers


def test_auto_workers_never_fall_as_cores_grow():
    counts = [cpus.auto_workers(c) for c in range(1, 80)]
    assert counts == sorted(counts) and max(counts) == cpus.MAX_AUTO_WORKERS


MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("n, total, free, per_worker, kept", [
    (14, 64 * GiB, 64 * GiB, 100 * MiB, 14),   # --ipc=host: room for all
    (14, 8 * GiB, 8 * GiB, 882 * MiB, 9),      # as many as have room for their batches
    (14, 8 * GiB, 1 * GiB, 882 * MiB, 1),      # free, not total, is what is left
    (14, 512 * MiB, 512 * MiB, 10 * MiB, 2),   # a small /dev/shm: at most two, even when more would fit
    (14, 64 * MiB, 64 * MiB, 100 * MiB, 0),    # Docker's default with big batches: none
    (1, 512 * MiB, 512 * MiB, 10 * MiB, 1),    # never more than asked for
    (4, 8 * GiB, 8 * GiB, 0, 4),               # nothing to size by
])
def test_workers_that_fit_shm(n, total, free, per_worker, kept):
    assert cpus.workers_that_fit(n, total, free, per_worker) == kept


@pytest.mark.parametrize("n, total, free, per_worker, kept", [
    (14, 512 * MiB, 512 * MiB, 10 * MiB, 14),  # a number given is not capped at two on a small /dev/shm ...
    (8, 64 * MiB, 64 * MiB, 5 * MiB, 8),
    (14, 64 * MiB, 64 * MiB, 100 * MiB, 0),    # ... only held to what fits: batches past it kill a worker
    (2, 64 * MiB, 64 * MiB, 220 * MiB, 0),     # the issue's --workers 2 at 224 px, batch 64
    (3, 8 * GiB, 1 * GiB, 300 * MiB, 3),
    (3, 8 * GiB, 500 * MiB, 300 * MiB, 1),
])
def test_workers_that_fit_shm_for_a_number_given(n, total, free, per_worker, kept):
    assert cpus.workers_that_fit(n, total, free, per_worker, given=True) == kept
