"""bench-memory and the batch-size probe on a real GPU: the measurements mean what they say."""

from __future__ import annotations

import csv
import re

import gpushare
import pytest

from dlenv.bench import memory as bench
from dlenv.options import config

# Not whole_gpu: peaks are each worker process's own, and the largest-batch search caps its worker far below
# the card (gpushare.py). One xdist worker, so that the table is measured once.
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("bench_memory_gpu")]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    from dlenv.compat import HAS_EXPANDABLE_SEGMENTS

    out = tmp_path_factory.mktemp("bench_gpu")
    every = bench.allocator_settings(HAS_EXPANDABLE_SEGMENTS)
    # the default and the newest setting: each row is a worker of its own (about 11 s on an H200), and the
    # list itself is checked on the CPU (test_bench_memory.py); issue 54 asks this table to measure less
    mp = pytest.MonkeyPatch()
    mp.setattr(bench, "allocator_settings", lambda has_expandable_segments: [every[0], every[-1]])
    cfg = config.build(config.BenchMemoryConfig, model="resnet18", batch_size=64, img_size=96, steps=3,
                       warmup=2, channels_last=False, allocator=True, alloc_steps=3, device="cuda",
                       out=str(out))
    try:
        with gpushare.share(alone=False, name="test_bench_memory_gpu: the table"):  # set up before the test's lock
            assert bench.main(cfg) == 0
    finally:
        mp.undo()
    with (out / "memory.csv").open() as fh:
        rows = {r["key"]: r for r in csv.DictReader(fh)}
    alloc = []
    if (out / "allocator.csv").exists():
        with (out / "allocator.csv").open() as fh:
            alloc = list(csv.DictReader(fh))
    return out, rows, alloc


def test_gpu_table_has_memory_and_the_expected_order(gpu_run):
    out, rows, _ = gpu_run
    assert set(rows) == {"fp32", "amp", "ckpt", "amp_ckpt", "amp_ckpt_auto"}
    # the auto-ratio row searched this GPU: some number of resnet18's 8 blocks, then measured with them
    assert re.fullmatch(r"auto: \d/8", rows["amp_ckpt_auto"]["checkpoint"])
    mem = {k: float(r["peak_alloc_gib"]) for k, r in rows.items()}
    assert all(r["status"] == "ok" for r in rows.values())
    assert all(float(r["peak_reserved_gib"]) >= float(r["peak_alloc_gib"]) > 0 for r in rows.values())
    # activations dominate at this batch: AMP and checkpointing must each lower the peak, both more
    assert mem["amp"] < mem["fp32"] and mem["ckpt"] < mem["fp32"]
    assert mem["amp_ckpt"] < min(mem["amp"], mem["ckpt"])
    assert float(rows["fp32"]["mem_vs_fp32"]) == pytest.approx(1.0)
    assert "Memory numbers need a CUDA GPU" not in (out / "memory.md").read_text()


def test_gpu_checkpointing_keeps_the_loss(gpu_run):
    _, rows, _ = gpu_run
    fp32, ckpt = float(rows["fp32"]["loss_last"]), float(rows["ckpt"]["loss_last"])
    assert float(rows["fp32"]["loss_first"]) != fp32
    # TF32 convolutions and autotuned kernels differ in the last bits, and SGD carries that over the
    # steps; a wrong gradient would be off by a large part of the loss's drop, not a few percent of it
    drop = float(rows["fp32"]["loss_first"]) - fp32
    assert drop > 0.5
    assert abs(ckpt - fp32) < 0.03 * drop
    assert abs(float(rows["amp_ckpt"]["loss_last"]) - float(rows["amp"]["loss_last"])) < 0.03 * drop
    assert abs(float(rows["amp"]["loss_last"]) - fp32) < 0.03 * drop


def test_gpu_allocator_rows_measure_fragmentation(gpu_run):
    from dlenv.compat import HAS_EXPANDABLE_SEGMENTS

    _, _, alloc = gpu_run
    settings = [r["setting"] for r in alloc]
    every = bench.allocator_settings(HAS_EXPANDABLE_SEGMENTS)
    assert settings == [every[0], every[-1]]
    for r in alloc:
        assert r["status"] == "ok"
        frag = float(r["fragmentation"])
        assert 0.0 <= frag < 1.0
        assert frag == pytest.approx(1 - float(r["peak_alloc_gib"]) / float(r["peak_reserved_gib"]), abs=1e-4)


def test_gpu_max_batch_grows_with_memory_and_with_amp():
    def largest(gib, amp):
        spec = dict(mode="max_batch", model="resnet18", batch_size=16, img_size=96, warmup=0, steps=2,
                    amp_dtype="auto", device="cuda", amp=amp, checkpoint=False, channels_last=False,
                    tolerance=0.05, gpu_memory_gib=gib)
        res = bench.run_worker(spec)
        assert res["status"] == "ok" and res["gpu_capped_gib"] == gib
        # the search's out-of-memory tries leave nothing allocated once it is done (issue 54)
        assert abs(res["held_after_mib"]) <= 64, res["held_after_mib"]
        return res["max_batch"]

    small, big = largest(1.5, amp=False), largest(3.0, amp=False)
    assert 1 <= small < big
    assert largest(1.5, amp=True) > small  # half-size activations: a bigger batch fits the same card
