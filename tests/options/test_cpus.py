"""dlenv.options.cpus: the CPUs a container really gives us, and the DataLoader workers auto starts on them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dlenv.options import cpus


def _fake_root(tmp_path, cgroup_lines, files):
    """A fake / with /proc/self/cgroup and the given cgroup files (path under sys/fs/cgroup -> text)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_lines)
    for rel, text in files.items():
        f = tmp_path / "sys/fs/cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


@pytest.mark.parametrize("cpu_max, count", [
    ("max 100000\n", 8),          # no quota: the mask
    ("200000 100000\n", 2),       # docker --cpus 2
    ("250000 100000\n", 2),       # docker --cpus 2.5 -> 2 whole CPUs
    ("50000 100000\n", 1),        # never below one
    ("1600000 100000\n", 8),      # a quota above the mask: the mask
    ("garbage\n", 8),             # not parsable: no quota
    ("200000\n", 8),              # one number only
    ("-5 100000\n", 8),
    ("200000 0\n", 8),            # a zero period
    ("2e5 100000\n", 8),
    ("200000 100000 7\n", 8),     # more than two fields
    ("9" * 300, 8),                # longer than a cgroup file: not read
    (None, 8),                     # no file
])
def test_cgroup_v2_quota_of_the_own_cgroup(monkeypatch, tmp_path, cpu_max, count):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    files = {} if cpu_max is None else {"slurm/job1/cpu.max": cpu_max}
    root = _fake_root(tmp_path, "0::/slurm/job1\n", files)
    assert cpus.cpu_budget(root).count == count


def test_cgroup_quota_of_a_parent_and_the_mount_root_count(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    # a container: /proc/self/cgroup names the host's path, the mount is the container's own cgroup
    root = _fake_root(tmp_path, "0::/docker/abc\n", {"cpu.max": "400000 100000\n"})
    budget = cpus.cpu_budget(root)
    assert budget.count == 4 and budget.why == "4 CPUs (cgroup quota 4.0 of 16)"


@pytest.mark.parametrize("quota, period, count", [
    ("-1\n", "100000\n", 8), ("300000\n", "100000\n", 3), ("50000\n", "100000\n", 1),
    ("x\n", "100000\n", 8), ("300000\n", "0\n", 8), ("300000\n", None, 8)])
def test_cgroup_v1_cfs_quota(monkeypatch, tmp_path, quota, period, count):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": quota}
    if period is not None:
        files["cpu,cpuacct/job/cpu.cfs_period_us"] = period
    root = _fake_root(tmp_path, "4:memory:/job\n3:cpu,cpuacct:/job\n", files)
    assert cpus.cpu_budget(root).count == count


def test_no_proc_no_cgroup_is_the_mask(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    budget = cpus.cpu_budget(tmp_path)
    assert (budget.count, budget.why) == (3, "3 CPUs (affinity 3 of 8)")


@pytest.mark.parametrize("env, expect", [({"OMP_NUM_THREADS": "3"}, 3), ({"OMP_NUM_THREADS": "0"}, 5),
                                         ({"OMP_NUM_THREADS": "two"}, 5), ({}, 5)])
def test_threads_follow_the_budget_unless_omp_num_threads_is_given(env, expect):
    n, why = cpus.threads(env, cpus.CpuBudget(5, 16, 5))
    assert n == expect and ("yours" in why) == (expect == 3)


def test_taskset_one_core_gives_one_thread_in_a_child():
    """Affinity set in a child process (as `taskset -c 0` would): one CPU, so one thread."""
    code = ("import os; os.sched_setaffinity(0, {0}); from dlenv.options import cpus; "
            "n, why = cpus.threads({}); print(n, why)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("1 1 CPU (affinity 1 of"), out.stdout


@pytest.mark.slow
def test_a_run_on_one_core_sets_torch_and_openmp_to_one_thread():
    """What the trainer applies (dlenv.train.run.use_threads of the plan's threads) in a child on one core:
    PyTorch's intra-op threads, and OMP_NUM_THREADS for its children."""
    code = ("import os; os.sched_setaffinity(0, {0}); os.environ.pop('OMP_NUM_THREADS', None); import torch; "
            "torch.set_num_threads(2); from dlenv.train.plan import _threads; from dlenv.train.run import use_threads; "
            "d = _threads(1); use_threads(d.value); "
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], d.why)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("1 1 1 CPU (affinity 1 of"), out.stdout


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
