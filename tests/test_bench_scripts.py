"""The benchmark scripts' own rules, on a CPU: a comparison that drops a requested row fails."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass's module must be importable while its class is made
    spec.loader.exec_module(mod)
    return mod


def test_bench_parity_fails_on_a_missing_row():
    parity = _script("bench_parity")
    requested = [("resnet50", ["fp32", "--amp"])]
    both = {("resnet50", c, side): (100.0, 1.0) for c in ("fp32", "--amp") for side in ("old", "new")}
    assert parity.missing_rows(requested, both) == []
    del both[("resnet50", "--amp", "new")]
    assert parity.missing_rows(requested, both) == ["resnet50 '--amp' (new)"]
    assert parity.missing_rows(requested, both, only="vit_b_16") == []


def test_bench_parity_asks_only_for_rows_bench_train_has():
    parity, train = _script("bench_parity"), _script("bench_train")
    labels = {(name, label) for name, _, variants in train.CONFIGS for label, _ in variants}
    asked = {(model, c) for model, configs in parity.DEFAULT for c in configs}
    assert asked <= labels, asked - labels


def test_bench_train_refuses_a_configuration_it_does_not_have():
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_train.py"), "--device", "cpu", "--no-yardstick",
                        "--config=--amp --checkpoint"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "no configuration '--amp --checkpoint'" in p.stdout


def test_bench_parity_runs_one_configuration_per_process_trees_back_to_back():
    parity = _script("bench_parity")
    asked = [("resnet50", ["fp32", "--amp"]), ("vit_b_16", ["fp32"])]
    runs = parity.schedule(asked, rounds=2, only="resnet50")
    assert runs == [("resnet50", "fp32", "old", 0), ("resnet50", "fp32", "new", 0),
                    ("resnet50", "--amp", "old", 0), ("resnet50", "--amp", "new", 0),
                    ("resnet50", "fp32", "new", 1), ("resnet50", "fp32", "old", 1),
                    ("resnet50", "--amp", "new", 1), ("resnet50", "--amp", "old", 1)]
    assert len(parity.schedule(asked, rounds=1)) == 6


# scripts/bench_ceiling.py: the schedule of its children under --budget, their rows, the ratios and the table


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_bench_ceiling_gives_each_child_at_most_what_is_left_and_goes_on_after_a_timeout():
    ceiling = _script("bench_ceiling")
    jobs = ceiling.plan_jobs(None, list(ceiling.OPTIMIZERS), "cuda", dlenv=True)
    assert [j.mode for j in jobs] == ["eager", "default", ceiling.DLENV, "reduce-overhead",
                                      "max-autotune-no-cudagraphs"]
    clock, budget = _Clock(), 240.0
    deadline = clock.now + budget
    took = {"eager": 20.0, ceiling.DLENV: 60.0, "reduce-overhead": 50.0}  # default and max-autotune run out
    given = []

    def spawn(job, timeout):
        given.append((job.mode, timeout, deadline - clock.now))
        if job.mode not in took:
            clock.now += timeout
            return ceiling.ChildRun([{"type": "phase", "optimizer": job.optimizers[0], "phase": "warmup"}],
                                    timed_out=True, rc=None)
        clock.now += took[job.mode]
        return ceiling.ChildRun([{"type": "row", "mode": job.mode, "optimizer": o, "img_s": 1000.0, "status": "ok"}
                                 for o in job.optimizers])

    rows, _ = ceiling.run_schedule(jobs, budget, spawn, clock=clock)
    assert [m for m, _, _ in given] == [j.mode for j in jobs]  # every child started, after the timeout too
    assert all(0 < timeout <= left - ceiling.MARGIN_S for _, timeout, left in given)
    assert clock.now - (deadline - budget) <= budget
    status = {(r["mode"], r["optimizer"]): r["status"] for r in rows}
    default_s = dict((m, t) for m, t, _ in given)["default"]
    assert status[("default", "sgd-foreach")] == f"not measured: compile took over {default_s:.0f} s"
    assert status[("default", "adamw-fused")].startswith("not measured: compile took over")
    assert status[(ceiling.DLENV, "auto")] == "ok" and status[("reduce-overhead", "adamw-fused")] == "ok"
    assert status[("max-autotune-no-cudagraphs", "sgd-foreach")].startswith("not measured")
    assert len(rows) == 2 * 4 + 1


def test_bench_ceiling_starts_no_child_once_the_budget_is_spent():
    ceiling = _script("bench_ceiling")
    jobs = ceiling.plan_jobs(["eager", "default"], ["sgd-foreach"], "cuda", dlenv=False)
    clock, started = _Clock(), []

    def spawn(job, timeout):
        started.append(job.mode)
        clock.now += 30.0
        return ceiling.ChildRun([{"type": "row", "mode": job.mode, "optimizer": "sgd-foreach", "img_s": 9.0,
                                  "status": "ok"}])

    rows, _ = ceiling.run_schedule(jobs, 35.0, spawn, clock=clock)
    assert started == ["eager"]
    assert rows[1] == {"mode": "default", "optimizer": "sgd-foreach", "status": "not measured: --budget 35 s spent"}


def test_bench_ceiling_says_why_a_child_left_no_row():
    ceiling = _script("bench_ceiling")
    job = ceiling.Job("default", ("sgd-foreach", "adamw-fused"))
    first = {"type": "row", "mode": "default", "optimizer": "sgd-foreach", "img_s": 5.0, "status": "ok"}
    timed = [{"type": "phase", "phase": "warmup"}, {"type": "phase", "phase": "timed"}, first,
             {"type": "phase", "phase": "warmup"}]
    rows = ceiling.rows_of(job, ceiling.ChildRun(timed, timed_out=True, rc=None), 50.0)
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "not measured: stopped after 50 s (--budget)"
    crashed = ceiling.rows_of(job, ceiling.ChildRun([{"type": "error", "message": "BackendCompilerFailed: x"}],
                                                    rc=1), 50.0)
    assert [r["status"] for r in crashed] == ["failed: BackendCompilerFailed: x"] * 2
    assert ceiling.rows_of(job, ceiling.ChildRun([], rc=-9), 50.0)[0]["status"].endswith("status -9 before this row")


def test_bench_ceiling_table_gives_each_row_over_the_best_plain_one():
    ceiling = _script("bench_ceiling")
    rows = [{"mode": "eager", "optimizer": "sgd-foreach", "img_s": 3000.0, "ms_per_step": 85.3, "warmup_s": 4.0,
             "status": "ok"},
            {"mode": "default", "optimizer": "sgd-foreach", "img_s": 4000.0, "ms_per_step": 64.0, "warmup_s": 50.0,
             "status": "ok"},
            {"mode": "max-autotune-no-cudagraphs", "optimizer": "sgd-foreach", "status": "not measured: compile "
                                                                                          "took over 80 s"},
            {"mode": ceiling.DLENV, "optimizer": "auto: sgd", "img_s": 5000.0, "ms_per_step": 51.2, "warmup_s": 70.0,
             "status": "ok", "note": "--compile auto: on"}]
    best, xs = ceiling.ratios(rows)
    assert best is rows[1]  # dlenv's row is never the yardstick, however fast
    assert xs == [0.75, 1.0, None, 1.25]
    md = ceiling.table(rows, "H100")
    lines = md.splitlines()
    assert lines[0] == "H100"
    assert "| **default** | sgd-foreach | 4,000 | 64.0 | 50.0 | **1.000 (best)** | ok |" in lines
    assert "| eager | sgd-foreach | 3,000 | 85.3 | 4.0 | 0.750 | ok |" in lines
    assert ("| max-autotune-no-cudagraphs | sgd-foreach | - | - | - | - | not measured: compile took over 80 s |"
            in lines)
    assert "dlenv's default long run: 1.250x the best plain row." in lines
    assert sum("(best)" in line for line in lines) == 1
    assert ceiling.ratios(rows[2:3]) == (None, [None])


def test_bench_ceiling_busy_share_merges_overlapping_kernels():
    ceiling = _script("bench_ceiling")
    got = ceiling.busy_share([(10.0, 20.0), (15.0, 25.0), (40.0, 50.0)])
    assert got == {"span_us": 40.0, "busy_us": 25.0, "sum_us": 30.0}


def test_bench_ceiling_plans_eager_alone_on_a_cpu_and_refuses_an_unknown_mode():
    ceiling = _script("bench_ceiling")
    assert [j.mode for j in ceiling.plan_jobs(None, ["sgd-foreach"], "cpu", dlenv=True)] == ["eager", ceiling.DLENV]
    assert [j.mode for j in ceiling.plan_jobs(["reduce-overhead", "eager"], ["sgd-foreach"], "cpu", dlenv=False)] \
        == ["eager", "reduce-overhead"]
    with pytest.raises(ValueError, match="'max-autotune'"):
        ceiling.plan_jobs(["max-autotune"], ["sgd-foreach"], "cuda", dlenv=False)


@pytest.mark.slow
def test_bench_ceiling_measures_the_plain_loop_in_a_child(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "bench_ceiling.py"), "--device", "cpu", "--model", "resnet18",
                        "--batch-size", "2", "--img-size", "32", "--steps", "1", "--warmup", "1", "--modes", "eager",
                        "--no-dlenv", "--budget", "120", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(tmp_path / "bench_ceiling.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["optimizer"], r["status"]) for r in rows] == [("eager", "sgd-foreach", "ok"),
                                                                        ("eager", "adamw-fused", "ok")]
    assert all(float(r["img_s"]) > 0 for r in rows)
    md = (tmp_path / "bench_ceiling.md").read_text()
    assert md.count("(best)") == 1 and "resnet18, batch 2, 32 px" in md
