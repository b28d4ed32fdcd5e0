"""dlenv.bench.data: loader speed, the verdict on a fake fast/slow case, the trainer's advice."""

from __future__ import annotations

import time

import pytest
import torch

from dlenv.bench import data as bench
from dlenv.bench.data import measure_loader, prefetched, verdict
from dlenv.options import config
from dlenv.train.console import data_wait_advice


class SlowLoader:
    """Batches of 10 images, each taking `delay` seconds to make."""

    def __init__(self, delay: float, n: int = 3):
        self.delay, self.n = delay, n

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.delay)
            yield torch.zeros(10, 3, 2, 2), torch.zeros(10, dtype=torch.long)


def test_measure_loader_counts_images_per_second_across_passes():
    rate = measure_loader(SlowLoader(0.02, n=3), batches=6, device=torch.device("cpu"), warmup=1)
    assert 200 < rate <= 10 / 0.02 * 1.05  # 6 timed batches span two passes of the 3-batch loader


class Prefetching:
    """A loader whose workers had filled their buffers (2 workers x 2) before the first request: those
    batches come at once, every later one takes `delay`."""

    num_workers, prefetch_factor = 2, 2

    def __init__(self, delay: float):
        self.delay = delay

    def __iter__(self):
        for k in range(100):
            if k >= self.num_workers * self.prefetch_factor:
                time.sleep(self.delay)
            yield torch.zeros(10, 3, 2, 2), torch.zeros(10, dtype=torch.long)


def test_measure_loader_times_the_steady_rate_not_the_prefetched_buffer():
    assert prefetched(Prefetching(0.02)) == 4
    rate = measure_loader(Prefetching(0.02), batches=4, device=torch.device("cpu"), warmup=0)
    assert rate <= 10 / 0.02 * 1.05  # counting the 4 ready batches would give about twice that


def test_measure_loader_times_at_least_a_few_waves_of_workers():
    class Counting(Prefetching):
        served = 0

        def __iter__(self):
            for batch in super().__iter__():
                Counting.served += 1
                yield batch

    measure_loader(Counting(0.001), batches=1, device=torch.device("cpu"), warmup=0)
    assert Counting.served == 4 + 4  # the prefetched ones drained, then 4 timed (not 1)


def test_verdict_names_the_input_pipeline_when_the_loader_is_slower():
    kind, msg = verdict({"classic, 4 workers": 900.0, "classic, 8 workers": 1500.0}, model_rate=3000.0)
    assert kind == "input"
    assert "input pipeline is the bottleneck" in msg and "classic, 8 workers" in msg and "--cache" in msg
    assert "50%" in msg  # the GPU would be busy half the time
    kind, msg = verdict({"cache": 2000.0}, model_rate=3000.0, cache_measured=True, on_gpu=False)
    assert kind == "input" and "--cache" not in msg and "nvjpeg" not in msg


def test_verdict_names_the_model_when_the_loader_keeps_up():
    kind, msg = verdict({"2 workers": 1000.0, "8 workers": 5000.0}, model_rate=3000.0)
    assert kind == "model" and "8 workers" in msg and "2 workers" not in msg
    # a loader only just as fast as the model is not enough: batches arrive unevenly
    assert verdict({"8 workers": 3050.0}, model_rate=3000.0)[0] == "input"


def test_data_wait_advice():
    assert data_wait_advice(0.15, cache=False, gpu_augment=False, workers=4) is None
    msg = data_wait_advice(0.4, cache=False, gpu_augment=False, workers=4)
    assert "40%" in msg and "--cache" in msg and "--gpu-augment on" in msg and "bench-data" in msg
    msg = data_wait_advice(0.4, cache=True, gpu_augment=True, workers=4)
    assert "--cache (" not in msg and "--gpu-augment" not in msg and "4" in msg


def test_main_names_the_bottleneck_on_a_fake_fast_model(image_folder, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_model", lambda *a, **k: 1e9)  # a model no loader can feed
    cfg = config.build(config.BenchDataConfig, data=str(image_folder), model="resnet18", batch_size=4,
                       img_size=16, workers="0", batches=2, device="cpu", amp=False)
    assert bench.main(cfg) == 0
    out = capsys.readouterr().out
    assert "input pipeline is the bottleneck" in out and "classic, 0 workers" in out
    assert "gpu-augment, 0 workers" in out  # the other path, measured for comparison


def test_main_names_the_model_on_a_fake_slow_model(image_folder, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_model", lambda *a, **k: 1e-3)
    cfg = config.build(config.BenchDataConfig, data=str(image_folder), model="resnet18", batch_size=4,
                       img_size=16, workers="0", batches=2, device="cpu", amp=False, gpu_augment="on")
    assert bench.main(cfg) == 0
    assert "model (CPU) is the bottleneck" in capsys.readouterr().out


def test_main_sweeps_workers_with_a_cpu_decoder_when_auto_picks_nvjpeg(image_folder, monkeypatch, capsys):
    """nvJPEG ignores the worker count: it is measured once, and the sweep and the classic path use the
    best CPU decoder (the classic path cannot use nvJPEG at all)."""
    from dlenv.data import pipeline, plan

    built = []
    monkeypatch.setattr(plan, "resolve_decoder", lambda *a, **k: "nvjpeg")
    monkeypatch.setattr(plan, "gpu_unavailable", lambda decoder, device: None)  # as on a GPU
    monkeypatch.setattr(pipeline, "make_loaders", lambda layout, plan, *a, **k: (
        built.append(("fast" if plan.on_device else "classic", plan.workers, plan.decoder)) or [["batch"]], None))
    monkeypatch.setattr(bench, "measure_loader", lambda loader, *a, **k: 100.0)
    monkeypatch.setattr(bench, "measure_model", lambda *a, **k: 1e9)
    cfg = config.build(config.BenchDataConfig, data=str(image_folder), model="resnet18", batch_size=4,
                       img_size=16, workers="1,2", batches=2, device="cpu", amp=False, gpu_augment="on")
    assert bench.main(cfg) == 0
    cpu = plan.AUTO_DECODER  # the fixture's PNGs: pick_decoder keeps the default
    assert ("fast", 1, cpu) in built and ("fast", 2, cpu) in built and ("classic", 2, cpu) in built
    assert [b for b in built if b[2] == "nvjpeg"] == [("fast", 2, "nvjpeg")]
    assert "gpu-augment, nvjpeg" in capsys.readouterr().out


def test_main_measures_nvjpeg_where_it_could_run_though_auto_took_a_cpu_decoder(image_folder, monkeypatch,
                                                                               capsys):
    """With many workers auto keeps a CPU decoder, but users still see what nvJPEG would give."""
    from dlenv.data import pipeline, plan

    built = []
    monkeypatch.setattr(plan, "resolve_decoder", lambda *a, **k: "pil")
    monkeypatch.setattr(plan, "prefer_nvjpeg", lambda paths, device, batch, workers=None: workers is None)
    monkeypatch.setattr(pipeline, "make_loaders",
                        lambda layout, plan, *a, **k: (built.append(plan.decoder) or [["batch"]], None))
    monkeypatch.setattr(bench, "measure_loader", lambda loader, *a, **k: 100.0)
    monkeypatch.setattr(bench, "measure_model", lambda *a, **k: 1e9)
    cfg = config.build(config.BenchDataConfig, data=str(image_folder), model="resnet18", batch_size=4,
                       img_size=16, workers="1,2", batches=2, device="cpu", amp=False, gpu_augment="on")
    assert bench.main(cfg) == 0
    assert built.count("nvjpeg") == 1 and built.count("pil") == 3  # the sweep of 2 and the classic path
    out = capsys.readouterr().out
    assert "decoder pil" in out and "gpu-augment, nvjpeg" in out


def _demo_folder(tmp_path):
    from dlenv.data.demo import ensure_demo_data

    return ensure_demo_data(tmp_path / "demo", train_per_class=2, val_per_class=1, size=24)


@pytest.mark.parametrize("which,img_size,px", [
    ("demo", None, 24),      # --img-size auto, as training: the data's typical size (a small demo set's 24 px)
    ("demo", 32, 32),        # --img-size wins
    ("folder", None, 20),    # any other folder too (24x20 images), never a fixed 224
])
def test_main_measures_the_size_training_would_use(image_folder, tmp_path, monkeypatch, capsys, which, img_size,
                                                    px):
    seen = {}

    def fake_model(model, n, batch, size, *a, **k):
        seen["size"] = size
        return 1e9

    monkeypatch.setattr(bench, "measure_model", fake_model)
    monkeypatch.setattr(bench, "measure_loader", lambda *a, **k: 100.0)  # the loader's speed is not the point
    data = _demo_folder(tmp_path) if which == "demo" else image_folder
    given = {"img_size": img_size} if img_size else {}
    cfg = config.build(config.BenchDataConfig, data=str(data), model="resnet18", batch_size=2, workers="0",
                       batches=2, device="cpu", amp=False, **given)
    assert bench.main(cfg) == 0
    assert seen["size"] == px and f"{px} px" in capsys.readouterr().out


def test_measure_loader_asks_for_the_next_epoch_between_passes():
    """As a trainer does: a loader whose workers run ahead into the next epoch is not restarted."""
    from dlenv.data.sampler import ResumableSampler

    class Epochs:
        def __init__(self):
            self.sampler, self.seen = ResumableSampler(4), []

        def __iter__(self):
            self.seen.append(self.sampler.epoch)
            return iter([torch.zeros(2, 3)] * 2)

    loader = Epochs()
    measure_loader(loader, batches=5, device=torch.device("cpu"), warmup=0)
    assert loader.seen == [0, 1, 2]
