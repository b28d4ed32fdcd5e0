"""The benchmark scripts' own rules, on a CPU: a comparison that drops a requested row fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
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
