"""scripts/bench_pipeline.py's pieces on the CPU: which variants run at which core count (--where), the
per-epoch readings (what torch.compile compiled, the held CPUs' busy share), and the tables it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_pipeline  # noqa: E402
import benchhost  # noqa: E402

from dlenv import compat  # noqa: E402

ISSUE_49 = ["synthetic", "default", "default-serial", "default-long", "nvimgcodec", "synthetic-compiled",
            "default-compiled"]
WHERE = ["default-serial=2,4", "default-long=4", "default=2,8,16", "nvimgcodec=8", "synthetic-compiled=16",
         "default-compiled=16"]


@pytest.mark.parametrize("cores, want", [
    (2, ["synthetic", "default", "default-serial"]),
    (4, ["synthetic", "default-serial", "default-long"]),
    (8, ["synthetic", "default", "nvimgcodec"]),
    (16, ["synthetic", "default", "synthetic-compiled", "default-compiled"]),
])
def test_where_keeps_each_variant_to_its_core_counts(cores, want):
    assert bench_pipeline.variants_at(ISSUE_49, WHERE, cores) == want


@pytest.mark.parametrize("spec", ["defaults=4", "default", "default=", "=4"])
def test_a_bad_where_is_one_line(spec):
    with pytest.raises(SystemExit, match="--where"):
        bench_pipeline.variants_at(ISSUE_49, [spec], 4)


@pytest.mark.parametrize("name, choice, overlap", [
    ("default", "auto", False), ("default-serial", "off", False), ("default-overlap", "on", True),
    ("default-long", "auto", False),
])
def test_the_overlap_rows_set_decode_overlap_as_train_would_take_it(name, choice, overlap):
    """The A/B of --decode-overlap goes through the option (the trainer's config and the loader's plan), with
    auto in series."""
    from dlenv.data.plan import InputOptions, decide_overlap
    from dlenv.options import config

    opts = bench_pipeline.VARIANTS[name]
    cfg = config.build(config.TrainConfig, **opts)
    assert cfg.decode_overlap == choice == InputOptions.of(cfg).decode_overlap == InputOptions(**opts).decode_overlap
    assert decide_overlap(cfg.decode_overlap, "nvimgcodec", "cuda", False)[0] is overlap
    assert (name in bench_pipeline.OVERLAP_AB) is (choice != "auto")  # run only when named


def test_cpu_jiffies_count_busy_time_of_the_held_cpus():
    busy, total = benchhost.cpu_jiffies()
    assert 0 <= busy <= total and total > 0
    assert benchhost.cpu_jiffies([10**6]) == (0, 0)  # a CPU that is not there counts nothing


def test_epoch_watch_reads_at_each_new_epoch_and_says_what_compiled(monkeypatch):
    import types

    counts = iter([{"frames": 0, "graphs": 0, "cache_misses": 0}, {"frames": 3, "graphs": 3, "cache_misses": 2},
                   {"frames": 3, "graphs": 3, "cache_misses": 2}])
    ticks = iter([(0, 100), (80, 200), (130, 300)])
    monkeypatch.setattr(compat, "compile_counters", lambda: next(counts))
    monkeypatch.setattr(benchhost, "cpu_jiffies", lambda cpus=None: next(ticks))
    watch = bench_pipeline.EpochWatch()
    for epoch in (0, 0, 1, 1):  # steps: the reading is taken once, at epoch 1's first step
        watch(types.SimpleNamespace(epoch=epoch))
    watch.mark()  # the run's end
    assert watch.deltas() == [{"frames": 3, "graphs": 3, "cache_misses": 2, "cpu_busy": 0.8},
                              {"frames": 0, "graphs": 0, "cache_misses": 0, "cpu_busy": 0.5}]


def test_compile_counters_count_a_recompile_for_a_new_batch_size():
    before = compat.compile_counters()
    assert set(before) == {"frames", "graphs", "cache_misses"}
    if not compat.HAS_COMPILE:
        assert before == {"frames": 0, "graphs": 0, "cache_misses": 0}
        return
    def only_here(x):  # a code object no other test compiles: dynamo's cache of it starts empty
        return x * 2 + 1

    f = compat.compile_model(only_here, dynamic=False, backend="eager")
    f(torch.randn(4, 3))
    first = compat.compile_counters()
    f(torch.randn(3, 3))  # a new batch size: a graph of its own (dynamic=False, as the trainer compiles)
    again = compat.compile_counters()
    assert first["frames"] > before["frames"] and first["graphs"] > before["graphs"]
    assert again["frames"] > first["frames"] and again["graphs"] > first["graphs"]


def test_the_tables_show_target_memory_and_epochs():
    runs = [{"cores": "4", "variant": "synthetic", "decoder": "-", "overlap": "-", "loader_img_s": "",
             "train_img_s": "4700", "data_wait": "", "ratio_to_synthetic": "1.0", "epoch1_img_s": "4000",
             "epochs": "3", "reserved_e2_gib": "10.5", "reserved_last_gib": "10.5", "seconds": "20"},
            {"cores": "4", "variant": "default-long", "decoder": "nvimgcodec", "overlap": "true",
             "loader_img_s": "10500", "train_img_s": "4600", "data_wait": "0.01", "ratio_to_synthetic": "0.978",
             "epoch1_img_s": "3000", "epochs": "20", "reserved_e2_gib": "12.0", "reserved_last_gib": "12.0",
             "seconds": "80", "cache": "gpu", "top1": "77.25", "start_s": "6.14"}]
    md = bench_pipeline.table(runs, "info")
    assert ("| 4 | default-long | nvimgcodec | gpu | true | 10,500 | 4,600 | 1.0% | 0.978 | 0.97 | 77.2 | 6.1 | "
            "3,000 | 12.00 -> 12.00 (20 epochs) |") in md
    assert "| 4 | synthetic | - | - | - | - | 4,700 | - | 1.000 | - | - | - | 4,000 |" in md
    epochs = [{"cores": "4", "variant": v, "epoch": "1", "img_s": "3000", "data_wait": "0.3", "reserved_gib": "12",
               "frames": "", "graphs": "", "cache_misses": "", "cpu_busy": "0.9"}
              for v in ("synthetic", "default-long")]
    shown = bench_pipeline.shown_epochs(epochs, runs)
    assert [r["variant"] for r in shown] == ["default-long"]  # the long and compiled runs get a table
    assert "| 4 | default-long | 1 | 3,000 | 30.0% | 12.00 |" in bench_pipeline.epoch_table(shown)
