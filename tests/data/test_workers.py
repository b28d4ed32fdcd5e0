"""dlenv.data.workers: how many DataLoader workers (a number given or auto, held to what /dev/shm holds), and
how the sentence of a reduction reaches the user: through the input plan's `workers_why` and the trainer's
said lines, or the eval loader's log line (val, predict and prune have no plan to say it). The /dev/shm
cases in a table, and a real 64 MiB /dev/shm: test_shm.py."""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest
from imagedata import make_image_folder

from dlenv.data import pipeline, workers
from dlenv.data.plan import InputOptions, InputPlan
from dlenv.data.workers import decide_workers
from dlenv.errors import UserError
from dlenv.options import cpus

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def small_shm(monkeypatch):
    """16 usable CPUs and a /dev/shm of 64 MiB, all free (Docker's default)."""
    monkeypatch.setattr(workers, "usable_cpus", lambda: 16)
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda p: Usage(64 << 20, 0, 64 << 20))


@pytest.mark.parametrize("given,kept", [(0, 0), (3, 3), ("2", 2), (" 4 ", 4)])
def test_a_number_given_is_kept_where_it_fits(given, kept, monkeypatch):
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda p: Usage(64 << 30, 0, 64 << 30))
    assert decide_workers(given) == (kept, "")


@pytest.mark.parametrize("given,says", [(-1, "workers -1 must be 0 or more"), ("many", "'many' must be a number"),
                                        ("-2", "'-2' must be a number"), (2.5, "2.5 must be a number")])
def test_bad_worker_counts_are_one_line(given, says):
    with pytest.raises(UserError, match=says):
        decide_workers(given)


def test_auto_caps_the_cpu_count(monkeypatch):
    monkeypatch.setattr(workers, "usable_cpus", lambda: 96)
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda p: Usage(64 << 30, 0, 64 << 30))
    assert decide_workers("auto", 32) == (cpus.MAX_AUTO_WORKERS, "")
    monkeypatch.setattr(workers, "usable_cpus", lambda: 3)
    assert decide_workers("auto", 32) == (3, "")


def test_shm_is_sized_by_what_the_workers_ship(monkeypatch):
    """8 GiB of /dev/shm: float32 224 px batches of 256 (882 MiB in flight per worker) allow 9 workers;
    the device path's uint8 258 px squares (a third of that) allow all 14 of 16 cores."""
    monkeypatch.setattr(workers, "usable_cpus", lambda: 16)
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda p: Usage(8 << 30, 0, 8 << 30))
    assert decide_workers("auto", 256, 224)[0] == 9
    assert decide_workers("auto", 256, 224, sample_bytes=3 * 258 * 258)[0] == 14


def test_a_small_shm_reduces_and_the_rule_logs_nothing(small_shm, caplog):
    caplog.set_level(logging.DEBUG)
    n, why = decide_workers("auto", batch_size=32, img_size=224)
    assert n <= 1  # 4 batches of 32 x 3x224x224 float32 in flight per worker do not fit in 64 MiB
    assert why.startswith("/dev/shm has 64 MiB free of 64 MiB") and "--shm-size=8g" in why
    assert caplog.records == []  # the plan says it, with the other decisions
    # tiny batches fit, but a small /dev/shm still keeps the count low
    assert decide_workers("auto", batch_size=2, img_size=32)[0] == 2


def test_no_dev_shm_means_nothing_to_size_against(monkeypatch):
    def missing(path):
        raise OSError("no /dev/shm")

    monkeypatch.setattr(workers.shutil, "disk_usage", missing)
    assert decide_workers(6, 512, 224) == (6, "")


def test_the_input_plan_keeps_the_reduction_and_its_sentence(small_shm, tmp_path):
    make_image_folder(tmp_path / "train", classes=("a", "b"), per_class=2, size=(16, 16))
    located = pipeline.locate(str(tmp_path))
    plan = InputOptions(workers=8, gpu_augment="off").decide(located, "cpu", 64, 224)
    assert plan.workers < 8 and "too little for --workers 8" in plan.workers_why
    fits = InputOptions(workers=0, gpu_augment="off").decide(located, "cpu", 64, 224)
    assert fits.workers == 0 and fits.workers_why == ""
    classic = InputPlan.classic(224, 64, 8)
    assert classic.workers < 8 and "too little for --workers 8" in classic.workers_why


def test_the_eval_loader_logs_the_reduction_it_has_no_plan_to_say(small_shm, tmp_path, caplog):
    from dlenv.data.loaders import build_eval_loader

    make_image_folder(tmp_path / "val", classes=("a",), per_class=2, size=(16, 16))
    samples = [(str(p), 0) for p in sorted((tmp_path / "val" / "a").iterdir())]
    with caplog.at_level(logging.WARNING, "dlenv.data"):
        loader = build_eval_loader(samples, 224, batch_size=64, workers=8)
    assert loader.num_workers < 8
    said = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
    assert len(said) == 1 and "too little for --workers 8" in said[0]
