"""MemoryMonitor statistics, the OOM message and the allocator diagnosis (GPU parts in test_train_gpu)."""

from __future__ import annotations

import pytest
import torch

from dlenv.engine import memory


def test_cpu_readings_are_zero_and_still_reported():
    mon = memory.MemoryMonitor("cpu")
    assert mon.record_memory("forward") == (0.0, 0.0)
    assert mon.peak() == (0.0, 0.0)
    report = mon.generate_report()
    assert list(report.index) == ["forward"] and report.loc["forward", "samples"] == 1


def test_report_statistics_per_phase(monkeypatch):
    readings = iter([(1, 4), (3, 4), (2, 8), (5, 8)])  # (allocated, reserved) in GiB
    current = {}

    def nxt(kind):
        def f(device=None):
            if kind == "a":
                current["r"] = next(readings)
                return current["r"][0] * memory.GIB
            return current["r"][1] * memory.GIB
        return f

    monkeypatch.setattr(torch.cuda, "memory_allocated", nxt("a"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", nxt("r"))
    mon = memory.MemoryMonitor("cpu")
    mon.enabled = True  # pretend to be on a GPU; the counters above stand in for the allocator's
    for phase in ("forward", "backward", "forward", "backward"):
        mon.record_memory(phase)
    df = mon.generate_report()
    assert df.loc["forward", "alloc_mean_gib"] == pytest.approx(1.5)
    assert df.loc["forward", "alloc_max_gib"] == 2 and df.loc["forward", "alloc_min_gib"] == 1
    assert df.loc["backward", "reserved_mean_gib"] == pytest.approx(6)
    assert df.loc["backward", "samples"] == 2
    assert list(df.columns) == ["samples", "alloc_mean_gib", "alloc_max_gib", "alloc_min_gib",
                                "reserved_mean_gib", "reserved_max_gib", "reserved_min_gib"]
    # the run's memory.md: one table row per phase, then the allocator in words
    monkeypatch.setattr(memory, "diagnose", lambda device=None: "Fragmentation: 5% ...")
    text = memory.run_report(mon)
    assert "| forward | 2 | 1.50 | 2.00 | 6.00 | 8.00 |" in text
    assert "| backward | 2 | 4.00 | 5.00 | 6.00 | 8.00 |" in text
    assert text.index("| backward |") < text.index("Fragmentation: 5%")


def test_oom_message_lists_next_steps_in_order():
    msg = memory.oom_message(batch_size=64, accum_steps=2, peak_gib=23.5, total_gib=24.0, amp=False,
                             checkpoint=False)
    assert "micro-batch 64" in msg and "23.50 GiB" in msg and "24.0 GiB" in msg
    assert msg.index("--amp") < msg.index("--checkpoint") < msg.index("--batch-size 32 --accum-steps 4")
    assert "\n" not in msg
    done = memory.oom_message(64, 1, 10, 12, amp=True, checkpoint=True)
    assert "1) --batch-size 32 --accum-steps 2" in done and "--amp (" not in done
    assert "--img-size" in memory.oom_message(1, 1, 10, 12, amp=True, checkpoint=True)


def test_diagnose_without_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in memory.diagnose()


def test_a_failed_steps_exception_no_longer_holds_its_tensors():
    """The trainer turns an out-of-memory into one line; the exception the user keeps (a notebook keeps
    the last) must not keep the failed step's activations alive (they were 134 GiB of an H200)."""
    import weakref

    held = []

    def step():
        activation = torch.ones(1000)
        held.append(weakref.ref(activation))
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        try:
            step()
        except RuntimeError:
            raise ValueError("the user's one line") from None
    except ValueError as e:
        kept = e
    assert held[0]() is not None  # kept alive through kept.__context__'s traceback
    memory.release_failed_step(kept)
    assert held[0]() is None
    assert str(kept) == "the user's one line"


def test_releasing_gives_back_the_blas_workspaces_before_the_cached_blocks(monkeypatch):
    """cuBLAS's workspaces live in the caching allocator on PyTorch 2.x: 65 MiB of an H200 still allocated
    after a released out-of-memory, until they are cleared (and before empty_cache, which frees their blocks)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    memory.release_failed_step(RuntimeError("CUDA out of memory"))
    assert calls == ["workspaces", "empty_cache"]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")  # PyTorch 1.13: no such call, the rest still runs
    calls.clear()
    memory.release_cached()
    assert calls == ["empty_cache"]


def test_start_clean_collects_garbage_cycles():
    import weakref

    class Cycle:
        pass

    a = Cycle()
    a.me = a
    a.tensor = torch.ones(10)
    ref = weakref.ref(a.tensor)
    del a
    assert ref() is not None  # only the cycle collector frees it
    assert memory.start_clean(torch.device("cpu")) == 0
    assert ref() is None
