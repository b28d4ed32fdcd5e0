"""dlenv.bench.memory (and its worker process): configurations, tables/CSV/chart from results, workers,
and a real run on the CPU."""

from __future__ import annotations

import csv
import json
import os
from types import SimpleNamespace

import pytest

from dlenv.bench import memory as bench
from dlenv.bench import memory_worker, workers
from dlenv.errors import UserError
from dlenv.options import config


def _row(key, label, alloc, reserved, speed, loss, status="ok", **kw):
    return dict(key=key, configuration=label, status=status, precision="fp32", peak_alloc_gib=alloc,
                peak_reserved_gib=reserved, img_per_s=speed, loss_last=loss, **kw)


GPU_ROWS = [
    _row("fp32", "FP32", 10.0, 12.0, 100.0, 6.5),
    dict(_row("amp", "AMP", 6.5, 8.0, 250.0, 6.5001), precision="bf16"),
    _row("ckpt", "Checkpointing", 4.0, 5.0, 75.0, 6.5),
    _row("amp_ckpt", "AMP + checkpointing", None, None, None, None, status="oom"),
]


def test_configurations_add_channels_last_only_for_conv_nets():
    plain = bench.configurations(convolutional=False, channels_last=True)
    assert [c["key"] for c in plain] == ["fp32", "amp", "ckpt", "amp_ckpt", "amp_ckpt_auto"]
    assert plain[0]["amp"] is False and plain[3]["amp"] and plain[3]["checkpoint"] is True
    conv = bench.configurations(convolutional=True, channels_last=True)
    assert len(conv) == 9 and all(c["channels_last"] for c in conv[5:])
    assert [c["key"] for c in conv[5:]] == ["fp32_cl", "amp_cl", "ckpt_cl", "amp_ckpt_cl"]
    assert len(bench.configurations(convolutional=True, channels_last=False)) == 5


def test_auto_ratio_configuration_and_its_checkpoint_label():
    auto = bench.configurations(convolutional=True, channels_last=True)[4]
    assert auto == dict(key="amp_ckpt_auto", label="AMP + checkpointing (auto ratio)", amp=True,
                        checkpoint="auto", channels_last=False)
    assert bench.checkpoint_label(dict(ckpt_blocks=3, ckpt_n_blocks=16, ckpt_fits_all=True)) == "auto: 3/16"
    assert bench.checkpoint_label(dict(ckpt_blocks=0, ckpt_n_blocks=8, ckpt_fits_all=True)) == "auto: 0/8"
    assert bench.checkpoint_label(dict(ckpt_blocks=16, ckpt_n_blocks=16, ckpt_fits_all=False)) == \
        "auto: 16/16 (none fit with the margin)"
    assert bench.checkpoint_label(dict(status="skipped")) == "auto"


def test_allocator_settings_follow_pytorch_features():
    assert "expandable_segments:True" not in bench.allocator_settings(False)
    with_es = bench.allocator_settings(True)
    assert with_es[0] == "" and "expandable_segments:True" in with_es
    assert {"max_split_size_mb:128", "garbage_collection_threshold:0.8"} <= set(with_es)


def test_fragmentation_schedule_varies_and_is_seeded():
    a = bench.fragmentation_schedule(64, 224, 30)
    assert a == bench.fragmentation_schedule(64, 224, 30)
    assert len({b for b, _ in a}) > 2 and len({s for _, s in a}) > 2
    assert all(1 <= b <= 64 and 168 <= s <= 280 and s % 8 == 0 for b, s in a)


def test_ratios_and_markdown_table():
    rows = bench.add_ratios([dict(r) for r in GPU_ROWS])
    assert rows[1]["mem_vs_fp32"] == pytest.approx(0.65)
    assert rows[1]["speed_vs_fp32"] == pytest.approx(2.5)
    assert rows[3]["mem_vs_fp32"] is None
    rows[0]["max_batch"], rows[1]["max_batch"] = 300, 512
    md = bench.markdown_table(rows, steps=13, with_max_batch=True).splitlines()
    assert md[0].startswith("| Configuration | Peak alloc GiB | Peak reserved GiB | vs FP32 | img/s")
    assert "loss after 13 steps" in md[0] and md[0].endswith("max batch |")
    assert all(line.count("|") == md[0].count("|") for line in md)
    assert md[3] == "| AMP (bf16) | 6.50 | 8.00 | -35% | 250.0 | 2.50x | 6.5001 | 512 |"
    assert "| FP32 | 10.00 | 12.00 | +0% | 100.0 | 1.00x | 6.5000 | 300 |" in md
    assert "| AMP + checkpointing | out of memory |" in md[5]


def test_markdown_table_shows_the_auto_ratio_rows_blocks_or_why_not():
    found = dict(_row("amp_ckpt_auto", "AMP + checkpointing (auto ratio)", 5.0, 6.0, 200.0, 6.5),
                 precision="bf16", ckpt_blocks=3, ckpt_n_blocks=16)
    skipped = dict(key="amp_ckpt_auto", configuration="AMP + checkpointing (auto ratio)", status="skipped",
                   error=bench.NO_SEARCH_ON_CPU)
    md = bench.markdown_table(bench.add_ratios([dict(GPU_ROWS[0]), found]), steps=3, with_max_batch=False)
    assert "| AMP + checkpointing (auto ratio) (bf16), 3/16 blocks checkpointed | 5.00 | 6.00 | -50% |" in md
    md = bench.markdown_table([skipped], steps=3, with_max_batch=False)
    assert "| AMP + checkpointing (auto ratio) | not measured: the checkpoint search needs a CUDA GPU" in md


def _fake_gpu_workers(monkeypatch, search: dict) -> list[dict]:
    """Replace run_worker as if on a GPU: the search answers `search`, every measurement "ok"."""
    specs = []

    def run(spec, alloc_conf=None, timeout=None, log=None):
        specs.append(spec)
        if spec["mode"] == "ckpt_search":
            return dict(search, device="cuda")
        return dict(status="ok", device="cuda", precision="bf16" if spec["amp"] else "fp32", peak_alloc_gib=1.0,
                    peak_reserved_gib=1.5, img_per_s=10.0, loss_last=6.5, max_batch=64)

    monkeypatch.setattr(bench, "run_worker", run)
    return specs


def _bench_cfg(tmp_path, **kw):
    return config.build(config.BenchMemoryConfig, **dict(dict(model="resnet18", batch_size=32, img_size=32,
                                                              channels_last=False, allocator=False,
                                                              device="cuda", out=str(tmp_path)), **kw))


def test_auto_ratio_row_measures_amp_with_the_blocks_the_search_found(monkeypatch, tmp_path):
    specs = _fake_gpu_workers(monkeypatch, dict(status="ok", ckpt_blocks=3, ckpt_n_blocks=8, ckpt_ratio=3 / 8,
                                                ckpt_fits_all=True, ckpt_tries=[[0, False], [8, True]]))
    rows, _, _ = bench.run_bench(_bench_cfg(tmp_path, max_batch=True), progress=lambda m: None)
    auto = rows[-1]
    assert (auto["key"], auto["status"], auto["checkpoint"]) == ("amp_ckpt_auto", "ok", "auto: 3/8")
    search = [s for s in specs if s["mode"] == "ckpt_search"]
    assert len(search) == 1 and search[0]["amp"] is True and search[0]["batch_size"] == 32
    # after the search: the measurement and the largest batch at the ratio found, with AMP
    assert [(s["mode"], s["checkpoint"], s["amp"]) for s in specs[-2:]] == [("measure", 3 / 8, True),
                                                                           ("max_batch", 3 / 8, True)]
    assert [r["checkpoint"] for r in rows[:4]] == [False, False, True, True]  # the other rows as they were
    path = bench.write_csv(rows, tmp_path / "memory.csv", bench.CSV_COLUMNS)
    with path.open() as fh:
        assert list(csv.DictReader(fh))[-1]["checkpoint"] == "auto: 3/8"


def test_auto_ratio_row_when_the_search_fails(monkeypatch, tmp_path):
    specs = _fake_gpu_workers(monkeypatch, dict(status="error", error="CUDA error: an illegal memory access"))
    rows, _, _ = bench.run_bench(_bench_cfg(tmp_path), progress=lambda m: None)
    auto = rows[-1]
    assert auto["status"] == "error" and auto["error"] == "checkpoint search: CUDA error: an illegal memory access"
    assert auto["checkpoint"] == "auto" and specs[-1]["mode"] == "ckpt_search"  # nothing measured after it


def test_checkpoint_search_worker_on_cpu_says_it_cannot_search():
    spec = dict(mode="ckpt_search", model="squeezenet1_1", batch_size=2, img_size=32, warmup=0, steps=2,
                amp_dtype="auto", device="cpu", amp=True)
    got = memory_worker.measure_checkpoint_search(spec)
    assert got["status"] == "skipped" and got["error"] == bench.NO_SEARCH_ON_CPU
    assert got["device"] == "cpu" and "ckpt_blocks" not in got


def test_markdown_table_on_cpu_says_na():
    rows = bench.add_ratios([_row("fp32", "FP32", None, None, 50.0, 2.0),
                             _row("ckpt", "Checkpointing", None, None, 40.0, 2.0)])
    md = bench.markdown_table(rows, steps=3, with_max_batch=False)
    assert "| Checkpointing | NA | NA | — | 40.0 | 0.80x | 2.0000 |" in md
    assert "max batch" not in md


def test_allocator_table_reports_measured_fragmentation():
    md = bench.allocator_table([
        dict(setting="", status="ok", peak_alloc_gib=6.0, peak_reserved_gib=8.0, fragmentation=0.25,
             img_per_s=100.0),
        dict(setting="expandable_segments:True", status="oom")])
    assert "| (unset) | 6.00 | 8.00 | 25.0% | 100.0 |" in md
    assert "| expandable_segments:True | out of memory |" in md


def test_csv_and_chart_written(tmp_path):
    rows = bench.add_ratios([dict(r) for r in GPU_ROWS])
    path = bench.write_csv(rows, tmp_path / "memory.csv", bench.CSV_COLUMNS)
    with path.open() as fh:
        got = list(csv.DictReader(fh))
    assert [r["key"] for r in got] == ["fp32", "amp", "ckpt", "amp_ckpt"]
    assert float(got[1]["mem_vs_fp32"]) == pytest.approx(0.65)
    assert got[3]["status"] == "oom" and got[3]["peak_alloc_gib"] == ""
    png = bench.bar_chart(rows, tmp_path / "memory.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not list(tmp_path.glob(".*tmp"))  # temporary files renamed into place


def test_worker_main_reports_a_user_error(tmp_path):
    result = tmp_path / "r.json"
    spec = dict(mode="measure", model="resnet_does_not_exist", batch_size=2, img_size=32, warmup=0, steps=2,
                amp_dtype="auto", device="cpu")
    assert memory_worker._worker_main(["--worker", json.dumps(spec), "--result", str(result)]) == 0
    got = json.loads(result.read_text())
    assert got["status"] == "user_error" and "resnet_does_not_exist" in got["error"]


def _fake_worker(monkeypatch, result: dict) -> list[dict]:
    """Replace the worker process: record each call's environment, answer `result`."""
    envs = []

    class Popen:
        def __init__(self, cmd, env, **kw):
            envs.append(env)
            assert kw["start_new_session"] is True  # Ctrl-C in the terminal reaches the parent alone
            with open(cmd[cmd.index("--result") + 1], "w") as fh:
                json.dump(result, fh)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(workers.subprocess, "Popen", Popen)
    return envs


def test_run_worker_sets_or_unsets_the_allocator_setting(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    envs = _fake_worker(monkeypatch, {"status": "ok"})
    bench.run_worker({}, alloc_conf="garbage_collection_threshold:0.8")
    bench.run_worker({}, alloc_conf="")
    bench.run_worker({})
    assert envs[0]["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in envs[1]  # "unset" really is unset
    assert envs[2]["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"  # the user's own, kept
    assert workers._src_dir() in envs[0]["PYTHONPATH"].split(os.pathsep)  # workers find dlenv uninstalled


def test_run_worker_raises_the_workers_user_error(monkeypatch):
    _fake_worker(monkeypatch, {"status": "user_error", "error": "--model 'x' is not a model"})
    with pytest.raises(UserError, match="--model 'x'"):
        bench.run_worker({})


def test_worker_crash_becomes_error_row(tmp_path):
    res = bench.run_worker(dict(mode="no_such_mode"), log=tmp_path / "w.log")
    assert res["status"] == "error" and res["error"] == "KeyError: 'no_such_mode'"  # one line for the table
    assert "Traceback" in (tmp_path / "w.log").read_text()  # the whole story is in the log


@pytest.mark.parametrize("code, says", [(-9, "killed by SIGKILL (out of host memory?"), (-15, "killed by SIGTERM"),
                                        (3, "exited 3 without a result")])
def test_a_worker_that_dies_is_one_line(code, says):
    assert says in workers._exit_line(code)


# ---------------------------------------------------------------------------------------------------
# One real run on the CPU: four configurations, each in its own worker process.


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cfg = config.build(config.BenchMemoryConfig, model="squeezenet1_1", batch_size=2, img_size=32,
                       steps=2, warmup=1, channels_last=False, device="cpu", out=str(out))
    code = bench.main(cfg)
    return SimpleNamespace(cfg=cfg, out=out, code=code)


@pytest.mark.slow  # the cpu_run fixture: a whole bench-memory run
def test_cpu_run_writes_outputs(cpu_run):
    assert cpu_run.code == 0
    md = (cpu_run.out / "memory.md").read_text()
    assert "Memory numbers need a CUDA GPU" in md and "on CPU" in md
    assert "| AMP + checkpointing" in md and "loss after 3 steps" in md
    assert "Allocator settings: not compared" in md
    with (cpu_run.out / "memory.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["skipped"]
    assert all(r["peak_alloc_gib"] == "" and float(r["img_per_s"]) > 0 for r in rows[:4])


@pytest.mark.slow  # the cpu_run fixture: a whole bench-memory run
def test_cpu_run_says_why_the_auto_ratio_row_was_not_measured(cpu_run):
    md = (cpu_run.out / "memory.md").read_text()
    assert f"| AMP + checkpointing (auto ratio) | {bench.NO_SEARCH_ON_CPU} |" in md
    with (cpu_run.out / "memory.csv").open() as fh:
        auto = list(csv.DictReader(fh))[-1]
    assert (auto["key"], auto["configuration"], auto["checkpoint"]) == \
        ("amp_ckpt_auto", "AMP + checkpointing (auto ratio)", "auto")
    assert (cpu_run.out / "memory.png").stat().st_size > 5000


@pytest.mark.slow  # the cpu_run fixture: a whole bench-memory run
def test_cpu_run_checkpointing_leaves_the_loss_unchanged(cpu_run):
    with (cpu_run.out / "memory.csv").open() as fh:
        rows = {r["key"]: r for r in csv.DictReader(fh)}
    fp32, ckpt = float(rows["fp32"]["loss_last"]), float(rows["ckpt"]["loss_last"])
    # the same start and the same batch: training went somewhere (loss moved) and got to the same place
    assert float(rows["fp32"]["loss_first"]) != fp32
    assert ckpt == pytest.approx(fp32, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# The user's own model as it is: kuangliu's ResNet18 (10 classes fixed by its factory), a configuration that
# fails, and Ctrl-C in the middle.


def _fake_cpu_workers(monkeypatch, stop_at: int | None = None, fail: str | None = None) -> list[dict]:
    """run_worker as on a CPU; the `stop_at`-th call raises KeyboardInterrupt (Ctrl-C), AMP rows fail with
    `fail`."""
    specs = []

    def run(spec, alloc_conf=None, timeout=None, log=None):
        specs.append(spec)
        if stop_at is not None and len(specs) == stop_at:
            raise KeyboardInterrupt
        if fail and spec.get("amp"):
            return dict(status="error", error=fail, device="cpu")
        return dict(status="ok", device="cpu", precision="fp32", img_per_s=5.0, loss_last=1.0, num_classes=10)

    monkeypatch.setattr(bench, "run_worker", run)
    return specs


def test_ctrl_c_writes_what_was_measured_and_exits_130(monkeypatch, tmp_path, capsys):
    _fake_cpu_workers(monkeypatch, stop_at=3)
    code = bench.main(_bench_cfg(tmp_path, device="cpu"))
    assert code == 130
    md = (tmp_path / "memory.md").read_text()
    assert "Stopped by SIGINT (Ctrl-C)** after 2 configuration(s)" in md
    with (tmp_path / "memory.csv").open() as fh:
        assert [r["key"] for r in csv.DictReader(fh)] == ["fp32", "amp"]
    assert "10 classes of the model's own head" in md


def test_a_failing_configuration_is_one_line_and_the_rest_is_measured(monkeypatch, tmp_path, capsys):
    _fake_cpu_workers(monkeypatch, fail="ValueError: boom at line 3 of bad.py")
    assert bench.main(_bench_cfg(tmp_path, device="cpu")) == 1
    err = capsys.readouterr().err
    assert "[bench-memory] AMP: failed: ValueError: boom at line 3 of bad.py" in err
    assert "[bench-memory] FP32: 5.0 img/s" in err and "Traceback" not in err
    md = (tmp_path / "memory.md").read_text()
    assert "| FP32 | NA | NA | — | 5.0 |" in md and "| AMP | failed: ValueError: boom at line 3 of bad.py |" in md


BAD_LATER = '''
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 4)

    def forward(self, x):
        if x.shape[0] != 2:
            raise ValueError("only pairs here")
        return self.fc(x.flatten(1))


def build():
    return Net()
'''


def _cpu_cfg(tmp_path, model, **kw):
    return config.build(config.BenchMemoryConfig, **dict(dict(model=model, batch_size=2, img_size=32, steps=2,
                                                              warmup=1, channels_last=False, device="cpu",
                                                              out=str(tmp_path / "out")), **kw))


@pytest.mark.slow  # four worker processes on the CPU
def test_kuangliu_resnet18_is_measured_with_its_own_10_class_head(tmp_path, monkeypatch, capsys):
    from thirdparty import KUANGLIU_RESNET, write

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "models/resnet.py", KUANGLIU_RESNET)
    code = bench.main(_cpu_cfg(tmp_path, "models/resnet.py:ResNet18"))
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err and "1000 classes" not in err
    with (tmp_path / "out" / "memory.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["skipped"]
    assert all(float(r["img_per_s"]) > 0 and float(r["loss_last"]) > 0 for r in rows[:4])
    assert "10 classes of the model's own head" in (tmp_path / "out" / "memory.md").read_text()
    log = (tmp_path / "out" / bench.WORKER_LOG).read_text()
    assert log.count("step 3/3: loss") == 4  # each worker's steps, as they came


@pytest.mark.slow  # worker processes on the CPU
def test_a_class_count_the_model_does_not_give_is_one_line(tmp_path, monkeypatch):
    from thirdparty import KUANGLIU_RESNET, write

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "models/resnet.py", KUANGLIU_RESNET)
    with pytest.raises(UserError, match="gives 10 classes, not --num-classes 1000; leave --num-classes out"):
        bench.run_bench(_cpu_cfg(tmp_path, "models/resnet.py:ResNet18", num_classes=1000),
                        progress=lambda m: None)


@pytest.mark.slow  # worker processes on the CPU
def test_a_model_failing_in_training_steps_fills_its_rows_with_one_line_each(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.py").write_text(BAD_LATER)  # the class-count probe (2 images) passes; batches of 3 fail
    monkeypatch.chdir(tmp_path)
    code = bench.main(_cpu_cfg(tmp_path, "bad.py:build", batch_size=3, img_size=16))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.count("failed: ValueError: only pairs here at line 12 of bad.py") == 4
    assert "Traceback" in (tmp_path / "out" / bench.WORKER_LOG).read_text()


SLOW_MODEL = '''
import os
import time
from torch import nn

open(os.environ["PID_FILE"], "a").write(f"{os.getpid()}\\n")


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 2:  # the class-count probe and the first step are quick; then it hangs
            time.sleep(600)
        return self.fc(x.flatten(1))


def build():
    return Slow()
'''


@pytest.mark.slow  # a worker process on the CPU
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_stop_signal_ends_the_worker_group_at_once_and_writes_the_table(tmp_path, sig, code):
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    env = dict(os.environ, PID_FILE=str(tmp_path / "pids"))
    proc = subprocess.Popen([sys.executable, "-m", "dlenv", "bench-memory", "--model", "slow.py:build",
                             "--batch-size", "2", "--img-size", "16", "--steps", "2", "--warmup", "0", "--device",
                             "cpu", "--no-channels-last", "--out", "out"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "out" / bench.WORKER_LOG
    deadline = time.monotonic() + 300  # a safety net: the worker's first step comes in seconds
    while not (log.exists() and "step 1/2" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "step 1/2" in log.read_text()  # the worker's progress reached the log while it ran
    proc.send_signal(getattr(signal, sig))  # to the parent alone, as Ctrl-C in a terminal would not
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    md = (tmp_path / "out" / "memory.md").read_text()
    assert f"Stopped by {sig}" in md and "Traceback" not in err
    worker = int((tmp_path / "pids").read_text().split()[-1])
    with pytest.raises(ProcessLookupError):  # the worker went with its group
        os.kill(worker, 0)


@pytest.mark.slow  # four worker processes on the CPU
def test_mnists_one_channel_net_is_measured_with_channels_1(tmp_path, monkeypatch):
    from thirdparty import MNIST_NET, write

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "net.py", MNIST_NET)
    assert bench.main(_cpu_cfg(tmp_path, "net.py:Net", img_size=28, channels=1)) == 0
    with (tmp_path / "out" / "memory.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["skipped"]
    md = (tmp_path / "out" / "memory.md").read_text()
    assert "28 px, 1 channel(s)" in md and "10 classes of the model's own head" in md


_DEFAULTS = '''
from torch import nn


class MobileNetV2(nn.Module):  # kuangliu's signature: its own default of 10 classes
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.linear = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.linear(self.conv(x).mean((2, 3)))


def fixed():  # builds its head itself
    return MobileNetV2(7)


def required(num_classes):  # no default: the count must come from somewhere
    return MobileNetV2(num_classes)


def guessed(n_out=5):  # no class-count name: the first int parameter takes it, and its default stands
    return MobileNetV2(n_out)
'''


@pytest.mark.parametrize("factory,asked,classes", [
    ("MobileNetV2", None, 10),  # was built with 1000 (3.57 M parameters for kuangliu's, not 2.30 M)
    ("MobileNetV2", 4, 4),      # --num-classes 4
    ("fixed", None, 7),
    ("required", None, bench.NUM_CLASSES),
    ("guessed", None, 5),
])
def test_a_factory_is_measured_with_its_own_default_class_count(tmp_path, monkeypatch, factory, asked, classes):
    """bench-memory without --num-classes builds a model of your own as its factory builds it by default
    (issue 53 item 9); --num-classes N asks for N."""
    from usermodels import isolated_imports, write

    write(tmp_path, "models/nets.py", _DEFAULTS)
    monkeypatch.chdir(tmp_path)
    spec = {"model": f"models/nets.py:{factory}", "img_size": 16, "num_classes": asked}
    with isolated_imports(tmp_path):
        model = memory_worker._build(spec)
    assert spec["num_classes"] == classes and model.linear.out_features == classes
