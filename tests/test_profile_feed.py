"""scripts/profile_feed.py and its pieces: the trace arithmetic of feed_trace (gaps, who launched late,
streams, waits), the candidate feed of feed_variants (every batch once, in order, as the loader's own
augmentation makes it), the trainer's wrappers put back, and a whole run on the CPU (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import feed_trace  # noqa: E402
import feed_variants  # noqa: E402


@pytest.mark.parametrize("intervals, merged", [
    ([], []),
    ([(0, 1)], [(0, 1)]),
    ([(2, 3), (0, 1)], [(0, 1), (2, 3)]),
    ([(0, 2), (1, 3)], [(0, 3)]),
    ([(0, 5), (1, 2), (3, 4)], [(0, 5)]),
    ([(0, 1), (1, 2)], [(0, 2)]),
])
def test_merge(intervals, merged):
    assert feed_trace.merge(intervals) == merged


@pytest.mark.parametrize("busy, lo, hi, idle", [
    ([], 0, 10, [(0, 10)]),
    ([(0, 10)], 0, 10, []),
    ([(2, 4), (6, 8)], 0, 10, [(0, 2), (4, 6), (8, 10)]),
    ([(-5, 3), (9, 20)], 0, 10, [(3, 9)]),
])
def test_gaps(busy, lo, hi, idle):
    assert feed_trace.gaps(busy, lo, hi) == idle


def ev(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_self_segments_give_the_innermost_event_its_own_time():
    evs = feed_trace.events({"traceEvents": [ev("P", 0, 100), ev("A", 10, 10), ev("B", 30, 20), ev("C", 35, 5)]})
    assert feed_trace.self_segments(evs) == [(0, 10, "P"), (10, 20, "A"), (20, 30, "P"), (30, 35, "B"),
                                             (35, 40, "C"), (40, 50, "B"), (50, 100, "P")]
    # over [5, 60]: uncovered time is "between ops"; an annotation's own time is Python between its ops
    t = feed_trace.time_by_name(feed_trace.self_segments(evs), 5, 60)
    assert t == {"P": 25, "A": 10, "B": 15, "C": 5}
    ann = feed_trace.events({"traceEvents": [ev("phase:x", 0, 10, cat="user_annotation"), ev("op", 2, 3)]})
    assert feed_trace.time_by_name(feed_trace.self_segments(ann), 0, 12) == {
        f"phase:x {feed_trace.BETWEEN}": 7, "op": 3, feed_trace.BETWEEN: 2}


def trace_two_steps():
    """Two 100 us steps on thread 1. Stream 7 runs kernels 0-40, 50-90 (gap 40-50: its kernel was launched
    at 45 by the main thread while it ran aten::slow: late) and 120-200 (gap 90-120: launched at 20,
    queued behind stream 13). Stream 13 copies 51 MB host to device and runs a grid_sampler kernel."""
    k = "kernel"
    return {"traceEvents": [
        ev("ProfilerStep#1", 0, 100, cat="user_annotation"), ev("ProfilerStep#2", 100, 100, cat="user_annotation"),
        ev("cudaLaunchKernel", 1, 2, cat="cuda_runtime", correlation=1),
        ev("aten::slow", 30, 14),
        ev("cudaLaunchKernel", 45, 2, cat="cuda_runtime", correlation=2),
        ev("cudaLaunchKernel", 20, 2, cat="cuda_runtime", correlation=3),
        ev("cudaMemcpyAsync", 5, 2, tid=2, cat="cuda_runtime", correlation=4),
        ev("cudaLaunchKernel", 8, 2, tid=2, cat="cuda_runtime", correlation=5),
        ev("cudaStreamSynchronize", 150, 30, cat="cuda_runtime"),
        ev("conv", 0, 40, tid=7, cat=k, stream=7, correlation=1),
        ev("conv", 50, 40, tid=7, cat=k, stream=7, correlation=2),
        ev("conv", 120, 80, tid=7, cat=k, stream=7, correlation=3),
        ev("Memcpy HtoD (Pinned -> Device)", 10, 20, tid=13, cat="gpu_memcpy", stream=13, correlation=4,
           bytes=51_000_000),
        ev("grid_sampler_2d_kernel", 30, 5, tid=13, cat=k, stream=13, correlation=5),
    ]}


def test_summarize_finds_the_idle_gaps_and_who_was_late():
    s = feed_trace.summarize(trace_two_steps(), main_tid=1, thread_names={2: "dlenv-device-loader"}, gap_us=5)
    assert s["steps"] == 2
    g = s["gpu"]
    assert g["span_ms"] == pytest.approx(0.2) and g["idle_ms"] == pytest.approx(0.04)
    assert g["idle_per_step_ms"] == pytest.approx(0.02)
    assert g["gaps"]["10-100us"]["count"] == 2
    gaps = s["gaps"]
    assert gaps["late_launch_ms"] == {"main": pytest.approx(0.01)}
    assert gaps["queued_waiting_ms"] == pytest.approx(0.03)
    # main ran aten::slow from 40 to 44, launched 45-47, and ran no op 44-45, 47-50 and 90-120
    during = dict(map(tuple, gaps["main_thread_during_gaps_ms"]))
    assert during == {"aten::slow": 0.004, "cudaLaunchKernel": 0.002, feed_trace.BETWEEN: 0.034}
    assert gaps["late_thread_top_ms"]["main"][0][0] == "aten::slow"
    streams = s["streams"]
    assert streams["7"]["role"] == "model (busiest)" and streams["7"]["kernels"] == 3
    assert "input augmentation" in streams["13"]["role"] and "H2D copies" in streams["13"]["role"]
    assert streams["13"]["copies"]["Memcpy HtoD"]["MB"] == pytest.approx(51.0)
    assert s["syncs"]["main"]["cudaStreamSynchronize"] == {"per_step": 0.5, "ms_per_step": 0.015}
    assert s["threads"]["dlenv-device-loader"]["busy_ms_per_step"] == 0.002  # its two runtime calls


@pytest.mark.parametrize("trace", [
    {"traceEvents": []},
    {"traceEvents": [ev("aten::add", 0, 5)]},  # a CPU run: no GPU events, no steps
])
def test_summarize_without_gpu_or_steps(trace):
    s = feed_trace.summarize(trace)
    assert "gpu" not in s and s["streams"] == {}


def test_feed_trace_command_line(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace_two_steps()))
    assert feed_trace.main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    assert feed_trace.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


class FakeSource:
    """Host batches of stored-form uint8 squares, like fastpath's sources."""

    def __init__(self, n, size=12, batch=3):
        g = torch.Generator().manual_seed(n)
        self.batches = [(torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=g),
                         torch.tensor([[40, 30]] * batch, dtype=torch.int32), torch.arange(batch) + 10 * i)
                        for i in range(n)]

    def __iter__(self):
        return iter(self.batches)

    def upload(self, batch, device):
        images, sizes, labels = batch
        return images.to(device), sizes, labels.to(device)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
@pytest.mark.parametrize("host_thread", [False, True])
def test_ahead_feed_hands_out_every_batch_once_in_order(n, host_thread):
    from dlenv.data.gpu_aug import GpuAugment

    source, augment = FakeSource(n), GpuAugment(8, train=True)
    seed = lambda epoch, position: epoch * 1000 + position  # noqa: E731
    got = list(feed_variants.AheadFeed(source, augment, torch.device("cpu"), None, host_thread, seed, epoch=2))
    assert len(got) == n
    for k, ((images, labels), (raw, sizes, want_labels)) in enumerate(zip(got, source.batches, strict=True)):
        assert torch.equal(labels, want_labels)
        assert torch.equal(images, augment(raw, sizes, seed(2, 3 * k)))  # the loader's seed for its position


def test_threaded_iter_raises_in_the_consumer():
    def broken():
        yield 1
        raise ValueError("bad batch")

    it = iter(feed_variants.ThreadedIter(broken()))
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(it)


def test_annotations_put_the_trainer_back():
    from dlenv.data import gpu_aug, sources
    from dlenv.engine import precision
    from dlenv.train import loop

    before = (loop.forward_backward, loop.optimizer_step, precision.Precision.backward, gpu_aug.GpuAugment.__call__,
              sources.CacheSource.__iter__, sources.WorkerSource.upload)
    with feed_variants.Annotations() as ann:
        assert loop.forward_backward is not before[0]
        assert gpu_aug.GpuAugment.__call__ is not before[3]
    after = (loop.forward_backward, loop.optimizer_step, precision.Precision.backward, gpu_aug.GpuAugment.__call__,
             sources.CacheSource.__iter__, sources.WorkerSource.upload)
    assert after == before
    assert ann.latency_ms() is None


def test_profiler_window_sees_the_main_thread_and_another(tmp_path):
    """The window's steps are the main thread's; a thread started before the window shows under its name
    where this torch records every thread (profile_all_threads, 2.x), as the loader's thread must."""
    import threading
    import time

    done = threading.Event()

    def other():
        while not done.is_set():
            torch.ones(64).add_(1)
            time.sleep(0.0005)

    helper = threading.Thread(target=other, name="helper-thread", daemon=True)
    helper.start()
    trace = tmp_path / "t.json"
    prof = feed_variants.profiler(torch.device("cpu"), False, 3, lambda p: p.export_chrome_trace(str(trace)))
    prof.start()
    for _ in range(4):
        torch.ones(256).mul_(2)
        time.sleep(0.01)  # the helper runs meanwhile
        prof.step()
    prof.stop()
    names = feed_variants.thread_names()
    done.set()
    helper.join()
    s = feed_trace.summarize(feed_trace.load(trace), threading.main_thread().native_id, names)
    assert s["steps"] == 3 and "main" in s["threads"]
    if feed_variants.experimental_config() is not None and "profile_all_threads" in str(
            type(feed_variants.experimental_config()).__init__.__doc__):
        assert s["threads"]["helper-thread"]["busy_ms_per_step"] > 0


@pytest.mark.parametrize("kwargs, passed", [
    (None, {"fullgraph": True}),
    ({"dynamic": False}, {"fullgraph": True, "dynamic": False}),
    ({"mode": "reduce-overhead"}, {"fullgraph": True, "mode": "reduce-overhead"}),
])
def test_compile_args_reach_the_trainers_compile_call_and_go(kwargs, passed, monkeypatch):
    import profile_feed

    from dlenv import compat

    seen = []
    monkeypatch.setattr(compat, "compile_model", lambda model, **given: seen.append(given) or model)
    plain = compat.compile_model
    with profile_feed.compile_args(kwargs):
        compat.compile_model("model", fullgraph=True)  # as dlenv.train.parts calls it, through the module
    assert seen == [passed] and compat.compile_model is plain


def test_device_cache_source_gathers_what_the_host_cache_does():
    from dlenv.data.sources import CacheSource

    class Cache:  # a DecodedCache's arrays: row 2 is a bad file, read as row 0's image and label
        images = torch.arange(4 * 2 * 2 * 3, dtype=torch.uint8).reshape(4, 2, 2, 3).numpy()
        sizes = torch.tensor([[5, 4], [6, 4], [5, 4], [7, 3]], dtype=torch.int32).numpy()
        labels = torch.tensor([0, 1, 0, 3]).numpy()
        source = torch.tensor([0, 1, 0, 3]).numpy()
        bad = {"b.jpg": "truncated"}

        def __len__(self):
            return 4

    host = CacheSource(Cache(), None, 3, pin=False)
    dev = feed_variants.DeviceCacheSource(host, torch.device("cpu"))
    assert len(dev) == len(host) == 2 and dev.bad_paths == host.bad_paths
    for a, b in zip(iter(host), iter(dev), strict=True):
        want, got = host.upload(a, torch.device("cpu")), dev.upload(b, torch.device("cpu"))
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)


@pytest.mark.parametrize("args, says", [
    (["--train-images", "3", "--batch-size", "4"], "is fewer than one batch"),
    (["--rows", "nope"], "unknown rows or feeds: nope"),
    (["--feeds", "synthetic,fast"], "unknown rows or feeds: fast"),
])
def test_bad_arguments_say_one_line(args, says, tmp_path, capsys):
    import profile_feed

    assert profile_feed.main(["--device", "cpu", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


@pytest.mark.slow
def test_whole_run_on_cpu(tmp_path):
    """The trainer's eager rows and the mirror's feeds at toy size: every row measured, nothing failed."""
    import profile_feed

    out = tmp_path / "out"
    rc = profile_feed.main(["--device", "cpu", "--model", "small_cnn", "--img-size", "32", "--batch-size", "8",
                            "--train-images", "64", "--val-images", "16", "--warm", "2", "--steps", "3",
                            "--profile-steps", "2", "--data", str(tmp_path / "jpegs"), "--out", str(out),
                            "--rows", "synthetic-eager,cache-eager",
                            "--feeds", "synthetic,product-cache,product-cache-ondevice,ahead-cache,ahead-workers",
                            "--keep-traces"])
    assert rc == 0
    result = json.loads((out / "profile_feed.json").read_text())
    assert [r["row"] for r in result["rows"]] == ["synthetic-eager", "cache-eager"]
    for r in result["rows"]:
        assert "error" not in r, r
        assert r["img_s"] > 0 and r["profile"]["steps"] == 2
    assert result["rows"][1]["x_synthetic"] > 0
    feeds = {r["feed"]: r for r in result["feeds"]}
    assert set(feeds) == {"synthetic", "product-cache", "product-cache-ondevice", "ahead-cache", "ahead-workers",
                          "synthetic (again)"}
    for r in feeds.values():
        assert "error" not in r, r
        assert r["img_s"] > 0 and r["loss"] == r["loss"]  # finite
    threads = feeds["product-cache"]["profile"]["threads"]
    assert feeds["product-cache"]["profile"]["steps"] == 2 and threads["main"]["busy_ms_per_step"] > 0
    md = (out / "profile_feed.md").read_text()
    assert "| cache-eager |" in md and "| eager | ahead-cache |" in md
    assert (out / "traces.tar").stat().st_size > 0
