"""dlenv.cpus: the CPUs a container really gives us."""

from __future__ import annotations

import os

from dlenv import cpus


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
