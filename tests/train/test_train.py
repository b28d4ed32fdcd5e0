"""The training loop on a CPU: outputs, accumulation, exact resume, signals, stops and bad input.

A tiny model (tests/tinymodels.py: conv, BatchNorm, dropout, linear) stands in for torchvision's
through conftest's `tiny` fixture, so each run takes a fraction of a second; one test uses a real model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tinymodels import Tiny, tiny_config

from dlenv import train as train_mod
from dlenv.errors import UserError
from dlenv.files import runstate
from dlenv.options import config
from dlenv.options.config import TrainConfig
from dlenv.runfolder import results
from dlenv.train import loop

REPO = Path(__file__).resolve().parents[2]


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_run_writes_config_first_then_rows_and_checkpoints(tmp_path, data, tiny):
    seen = []

    def on_step(state):
        run = tmp_path / "runs" / "exp"
        seen.append(((run / "config.yaml").is_file(), (run / "results.csv").exists()))

    summary = train_mod.train(tiny_config(tmp_path, data, accum_steps=2), on_step=on_step)
    run = Path(summary["run_dir"])
    assert run == tmp_path / "runs" / "exp"
    assert seen[0] == (True, False)  # config.yaml exists before any result
    df = results.read_results(run / "results.csv")
    assert list(df.columns) == list(results.COLUMNS)
    assert list(df["epoch"]) == [1, 2]
    assert (df["accum_steps"] == 2).all() and (df["batch_size"] == 4).all()
    assert df["data_wait"].between(0, 1).all() and (df["img_per_s"] > 0).all()
    # 16 images / batch 4 = 4 batches per epoch, accumulation 2 -> 2 optimizer steps per epoch
    assert summary["step"] == 4 and summary["exit_code"] == 0
    # config.yaml holds resolved values and reloads as --cfg
    again = config.build(TrainConfig, run / "config.yaml")
    assert again.batch_size == 4 and again.lr == pytest.approx(0.1 * 8 / 256) and again.weight_decay == 1e-4
    for name in ("last.pth", "best_model.pth"):
        ck = runstate.load_state(run / name)  # weights_only=True inside
        assert ck["format"] == runstate.FORMAT and ck["class_names"] == ["cat", "dog"]
        assert ck["img_size"] == 16 and ck["config"]["batch_size"] == 4
        assert isinstance(ck["config"]["lr"], float) and isinstance(ck["best_metric"], float)
    last = runstate.load_state(run / "last.pth")
    assert last["epoch"] == 2 and last["step"] == 4 and last["batch_in_epoch"] == 0
    # a second run gets the next name, and its config.yaml and checkpoints record that name
    second = Path(train_mod.train(tiny_config(tmp_path, data, epochs=1))["run_dir"])
    assert second.name == "exp2"
    assert config.build(TrainConfig, second / "config.yaml").name == "exp2"
    assert runstate.load_state(second / "last.pth")["config"]["name"] == "exp2"


def _final(run_dir: Path) -> dict:
    return runstate.load_state(run_dir / "last.pth")


def test_auto_optimizer_is_resolved_into_config_yaml(tmp_path, data, tiny):
    run = Path(train_mod.train(tiny_config(tmp_path, data, epochs=1, optimizer="auto"))["run_dir"])
    again = config.build(TrainConfig, run / "config.yaml")
    # a run of a few steps: AdamW with its default lr and weight decay, recorded as such
    assert again.optimizer == "adamw" and again.lr == pytest.approx(1e-3) and again.weight_decay == 0.05
    assert runstate.load_state(run / "last.pth")["config"]["optimizer"] == "adamw"


@pytest.mark.parametrize("stop_at,signum", [(3, signal.SIGTERM), pytest.param(4, signal.SIGINT, marks=pytest.mark.slow),
                                            pytest.param(5, signal.SIGTERM, marks=pytest.mark.slow)])
def test_resume_is_bit_exact(tmp_path, data, tiny, stop_at, signum):
    """Interrupted after `stop_at` optimizer steps (mid-epoch, epoch end, next epoch), then resumed:
    the same weights, optimizer state, EMA and BatchNorm statistics as an uninterrupted run."""
    opts = dict(epochs=3, batch_size=2, accum_steps=2, ema=True, label_smoothing=0.1)  # 4 steps per epoch
    full = train_mod.train(tiny_config(tmp_path / "a", data, **opts))

    def on_step(state):
        if state.step == stop_at:
            signal.raise_signal(signum)

    part = train_mod.train(tiny_config(tmp_path / "b", data, **opts), on_step=on_step)
    assert part["status"] == "interrupted"
    assert part["exit_code"] == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum]
    saved = _final(Path(part["run_dir"]))
    assert saved["step"] == stop_at
    assert (saved["batch_in_epoch"] > 0) == (stop_at % 4 != 0)
    resumed = train_mod.train(tiny_config(tmp_path / "c", data, resume=str(Path(part["run_dir"]) / "last.pth")))
    assert resumed["run_dir"] == part["run_dir"] and resumed["exit_code"] == 0
    a, b = _final(Path(full["run_dir"])), _final(Path(resumed["run_dir"]))
    assert a["step"] == b["step"] == 12
    assert state_equal(a["model"], b["model"])
    assert state_equal(a["ema"]["module"], b["ema"]["module"])
    ma, mb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(ma[k]["momentum_buffer"], mb[k]["momentum_buffer"]) for k in ma)
    rows = results.read_results(Path(resumed["run_dir"]) / "results.csv")
    assert list(rows["epoch"]) == [1, 2, 3]
    # the stopped epoch's train_loss is the mean over all its steps, the ones before the stop too
    straight = results.read_results(Path(full["run_dir"]) / "results.csv")
    assert list(rows["train_loss"]) == list(straight["train_loss"])


def test_signal_mid_accumulation_finishes_the_window_then_saves(tmp_path, data, tiny, monkeypatch):
    """A stop is taken at the next optimizer step: the window in progress ends first, and the state of
    that step boundary is saved as it is (nothing to roll back); the resume is exact."""
    opts = dict(epochs=1, batch_size=2, accum_steps=4)  # 8 batches: 2 windows of 4
    full = train_mod.train(tiny_config(tmp_path / "a", data, **opts))
    calls = {"n": 0}
    real = loop.forward_backward

    def fb(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # second micro-batch of the first window
            signal.raise_signal(signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    part = train_mod.train(tiny_config(tmp_path / "b", data, **opts))
    saved = _final(Path(part["run_dir"]))
    assert part["exit_code"] == 143 and calls["n"] == 4
    assert saved["step"] == 1 and saved["batch_in_epoch"] == 4 and saved["epoch"] == 0
    monkeypatch.setattr(loop, "forward_backward", real)
    resumed = train_mod.train(tiny_config(tmp_path / "c", data, resume=str(Path(part["run_dir"]) / "last.pth")))
    assert resumed["step"] == 2
    assert state_equal(_final(Path(full["run_dir"]))["model"], _final(Path(resumed["run_dir"]))["model"])


def test_accumulation_equals_one_big_batch_including_the_short_last_window(tmp_path, data, tiny):
    # 16 images: batches of 4 with accumulation 3 make windows of 3 and 1 batches, which must equal
    # batches of 12 and 4 (the sampler's order does not depend on the batch size)
    opts = dict(model="tiny-nonorm", epochs=1, label_smoothing=0.0, warmup_epochs=0.0)
    acc = train_mod.train(tiny_config(tmp_path / "a", data, batch_size=4, accum_steps=3, **opts))
    big = train_mod.train(tiny_config(tmp_path / "b", data, batch_size=12, accum_steps=1, **opts))
    wa, wb = _final(Path(acc["run_dir"]))["model"], _final(Path(big["run_dir"]))["model"]
    assert acc["step"] == big["step"] == 2
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    changed = _final(Path(acc["run_dir"]))
    assert not torch.equal(changed["model"]["fc.weight"], Tiny(2, norm=False).fc.weight)


def test_oom_under_batch_size_auto_replans_exactly_from_the_last_step(tmp_path, data, tiny, monkeypatch):
    """CUDA out of memory (simulated) in a window's second micro-batch of 8: the run goes back to the last
    optimizer step and on at 4 x 4, and its weights equal a run planned at 4 x 4 from the start."""
    from dlenv.train import plan

    opts = dict(model="tiny-nonorm", epochs=2, label_smoothing=0.0, warmup_epochs=0.0, augment="none", hflip="off")
    small = train_mod.train(tiny_config(tmp_path / "a", data, batch_size=4, accum_steps=4, **opts))
    decide = plan.decide  # the retry rule of --batch-size auto, on a CPU (auto itself measures a GPU)
    monkeypatch.setattr(plan, "decide", lambda *a: dataclasses.replace(decide(*a), oom_retry=True))
    real, calls = loop.forward_backward, []

    def fb(parts, images, *a, **k):
        calls.append(images.shape[0])
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(parts, images, *a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    big = train_mod.train(tiny_config(tmp_path / "b", data, batch_size=8, accum_steps=2, **opts))
    assert calls == [8, 8] + [4] * 8  # the window's first batch trained again, in halves
    wa, wb = _final(Path(small["run_dir"])), _final(Path(big["run_dir"]))
    assert small["step"] == big["step"] == 2
    for k in wa["model"]:
        torch.testing.assert_close(wa["model"][k], wb["model"][k], rtol=1e-5, atol=1e-6)
    rows = results.read_results(Path(big["run_dir"]) / "results.csv")
    assert list(rows["batch_size"]) == [4, 4] and list(rows["accum_steps"]) == [4, 4]
    assert list(rows["oom_retries"]) == [1, 1]
    # config.yaml and last.pth record the new split: a --resume or --cfg continues with it
    again = config.build(TrainConfig, Path(big["run_dir"]) / "config.yaml")
    assert (again.batch_size, again.accum_steps) == (4, 4)
    assert (wb["config"]["batch_size"], wb["config"]["accum_steps"]) == (4, 4)


def test_effective_batch_sets_accumulation_or_refuses(tmp_path, data, tiny):
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, batch_size=2, effective_batch=8))
    assert out["accum_steps"] == 4 and out["step"] == 2
    with pytest.raises(UserError, match="--effective-batch 10 is not a multiple"):
        train_mod.train(tiny_config(tmp_path, data, batch_size=4, effective_batch=10))


def test_nonfinite_losses_stop_with_exit_4_and_keep_the_last_good_checkpoint(tmp_path, data, tiny,
                                                                            monkeypatch):
    monkeypatch.setattr(loop, "NONFINITE_LIMIT", 2)
    monkeypatch.setattr(loop, "CHECK_EVERY", 1)

    def on_step(state):
        if state.epoch == 1:
            tiny[-1].poison = True

    with pytest.raises(UserError, match="not finite|non-finite") as err:
        train_mod.train(tiny_config(tmp_path, data, epochs=3), on_step=on_step)
    assert err.value.exit_code == train_mod.EXIT_NONFINITE
    assert "last good run file" in str(err.value)
    last = runstate.load_state(tmp_path / "runs" / "exp" / "last.pth")
    assert last["epoch"] == 1 and all(torch.isfinite(v).all() for v in last["model"].values())


@pytest.mark.parametrize("error", [UserError("the first step went wrong"), TypeError("forward() got 2 arguments")])
def test_a_run_that_fails_before_its_first_epoch_says_where_its_folder_is(tmp_path, data, tiny, monkeypatch, capsys,
                                                                         error):
    """A new run's folder holds only config.yaml when its first step fails: the failing line (a UserError's own,
    else a line before the traceback) names the folder; a resumed run's folder is never named so."""
    real = loop.forward_backward

    def broken(*a, **k):
        raise type(error)(*error.args)  # a new one each time: the note is added to the error raised

    monkeypatch.setattr(loop, "forward_backward", broken)
    with pytest.raises(type(error)) as err:
        train_mod.train(tiny_config(tmp_path, data, epochs=1))
    run = tmp_path / "runs" / "exp"
    said = str(err.value) if isinstance(error, UserError) else capsys.readouterr().err
    assert f"nothing was trained: the run folder {run} holds no results, only this attempt's config.yaml" in said, said
    assert (run / "config.yaml").is_file() and len(said.strip().splitlines()) == 1
    monkeypatch.setattr(loop, "forward_backward", real)
    first = train_mod.train(tiny_config(tmp_path / "b", data, epochs=1))
    monkeypatch.setattr(loop, "forward_backward", broken)
    with pytest.raises(type(error)) as err:
        train_mod.train(tiny_config(tmp_path / "b", data, epochs=2, resume=str(Path(first["run_dir"]) / "last.pth")))
    assert "nothing was trained" not in str(err.value) + capsys.readouterr().err


def test_cuda_oom_stops_with_advice_and_exit_3(tmp_path, data, tiny, monkeypatch):
    real = loop.forward_backward

    def fb(parts, *a, **k):
        if parts.scheduler.last_epoch >= 4:  # after the first epoch's checkpoint
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(parts, *a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    with pytest.raises(UserError) as err:
        train_mod.train(tiny_config(tmp_path, data, epochs=2))
    msg = str(err.value)
    assert err.value.exit_code == train_mod.EXIT_OOM
    assert msg.index("--amp") < msg.index("--checkpoint") < msg.index("--batch-size 2 --accum-steps 2")
    assert runstate.load_state(tmp_path / "runs" / "exp" / "last.pth")["epoch"] == 1


def test_an_out_of_memory_kept_by_the_caller_holds_no_model_and_no_batch(tmp_path, data, tiny, monkeypatch):
    """A notebook keeps the last exception (sys.last_value), a test keeps what pytest.raises caught. The
    trainer's one line for an out-of-memory must not keep the run alive: its traceback's frames (fit's and
    _train's locals: the model, the loaders, the batch on the GPU) held 2.5 GB of an H100 after the line
    (issue 54). Counted by weakrefs, freed by reference counts alone: no garbage collection in between."""
    import gc
    import weakref

    real, seen = loop.forward_backward, []

    def fb(parts, images, *a, **k):
        seen.append((weakref.ref(parts.model), weakref.ref(images)))
        if len(seen) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(parts, images, *a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    gc.disable()  # what frees the run must be the trainer's own doing, not a collection that happens to run
    try:
        try:
            train_mod.train(tiny_config(tmp_path, data, epochs=2))
        except UserError as e:
            kept = e
        tiny.clear()  # the fixture's own list of the models it built
        alive = [name for name, ref in zip(("model", "batch"), seen[-1], strict=True) if ref() is not None]
    finally:
        gc.enable()
    assert kept.exit_code == train_mod.EXIT_OOM and "out of memory" in str(kept).lower()
    assert not alive, f"the kept exception still holds the run's {' and '.join(alive)}"


def test_a_finished_run_gives_back_what_it_cached_once_its_model_is_gone(tmp_path, data, tiny, monkeypatch):
    """After a run that fits, the caller's next cell starts with the card as the run found it: the trainer
    releases the BLAS workspaces and cached blocks once the run's model, optimizer and loaders are gone (on an
    H100 the workspaces were 65 MiB still allocated after `--batch-size auto`'s run, issue 54)."""
    import gc
    import weakref

    from dlenv.engine import memory

    real, seen, released = loop.forward_backward, [], []

    def fb(parts, images, *a, **k):
        seen.append(weakref.ref(parts.model))
        return real(parts, images, *a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    def release():  # as memory.release_cached: the garbage first, then what is cached
        tiny.clear()  # the fixture's own list of the models it built
        gc.collect()
        released.append(sum(ref() is not None for ref in seen[-1:]))

    monkeypatch.setattr(memory, "release_cached", release)
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1))
    assert out["exit_code"] == 0
    assert released == [0], released  # once, at the end, when no model of the run is alive


@pytest.mark.parametrize("bad,match", [
    (dict(model="no_such_net"), "no_such_net"),
    (dict(data="/nonexistent/folder"), "/nonexistent/folder"),
    (dict(resume="/nonexistent/last.pth"), "/nonexistent/last.pth"),
    (dict(device="cuda:7") if not torch.cuda.is_available() else dict(device="tpu"), "--device"),
])
def test_bad_input_is_one_user_error_and_leaves_no_run(tmp_path, data, bad, match):
    with pytest.raises(UserError, match=match):
        train_mod.train(tiny_config(tmp_path, data, **bad))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_corrupt_or_foreign_resume_file_is_refused(tmp_path, data):
    bad = tmp_path / "last.pth"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserError, match="corrupt"):
        train_mod.train(tiny_config(tmp_path, data, resume=str(bad)))
    torch.save({"fc.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(UserError, match="not a dlenv run file to resume"):
        train_mod.train(tiny_config(tmp_path, data, resume=str(bad)))


def test_resume_with_an_optimizer_state_that_does_not_fit_is_refused(tmp_path, data, tiny):
    first = train_mod.train(tiny_config(tmp_path, data, epochs=2, max_steps=1))
    last = Path(first["last"])
    ck = torch.load(last, weights_only=False)
    ck["optimizer"]["param_groups"] = ck["optimizer"]["param_groups"][:1]  # a group lost
    torch.save(ck, last)
    before = last.read_bytes()
    with pytest.raises(UserError, match="optimizer state does not fit.*--weights"):
        train_mod.train(tiny_config(tmp_path, data, resume=str(last)))
    assert last.read_bytes() == before


def test_tensorboard_and_resume_auto(tmp_path, data, tiny):
    first = train_mod.train(tiny_config(tmp_path, data, epochs=1, tensorboard=True))
    assert list(Path(first["run_dir"]).glob("events.out.tfevents.*"))
    # auto picks the newest run's last.pth; a finished run has nothing left to do
    again = train_mod.train(tiny_config(tmp_path, data, resume="auto"))
    assert again["run_dir"] == first["run_dir"] and again["step"] == first["step"]


@pytest.mark.slow
def test_real_model_with_checkpointing_and_bf16_autocast(tmp_path, data):
    # 64 px, not the suite's 16: at 16 px ResNet-18's last stage is 1x1, and oneDNN's bf16 kernels on
    # the CI machines' CPUs (AVX-512/AMX, torch 1.13 and 2.14 alike) then return garbage gradients
    # nondeterministically (21 of 30 identical backward passes with |grad| > 1e4 or non-finite; 0 of
    # 30 at 64 and 224 px; 0 of 60 with ONEDNN_MAX_CPU_ISA=AVX2), which the trainer rightly stops on.
    out = train_mod.train(tiny_config(tmp_path, data, model="resnet18", img_size=64, epochs=1, max_steps=1, amp=True,
                              amp_dtype="bf16", checkpoint=True, deterministic=False))  # bf16 even where it is slower
    ck = runstate.load_state(Path(out["run_dir"]) / "last.pth")
    assert out["precision"] == "bf16" and "layer1.0.conv1.weight" in ck["model"]


def test_synthetic_data_needs_no_folder(tmp_path, tiny):
    out = train_mod.train(config.build(TrainConfig, synthetic=True, img_size=16, batch_size=2, epochs=1,
                                       max_steps=2, device="cpu", project=str(tmp_path / "runs"),
                                       model="tiny"))
    assert out["step"] == 2 and len(runstate.load_state(Path(out["last"]))["class_names"]) == 1000


_SCRIPT = """
import sys, torch
from torch import nn
sys.path.insert(0, {tests!r})
import dlenv.model.models
from tinymodels import build_tiny
dlenv.model.models.build_model = build_tiny
from dlenv.cli import main
raise SystemExit(main(["train", *sys.argv[1:]]))
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    t = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t < timeout, "no checkpoint appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_and_kill_9_leave_a_loadable_checkpoint(tmp_path, data):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_SCRIPT.format(tests=str(REPO / "tests"))))
    args = [sys.executable, str(script), "--data", str(data), "--project", str(tmp_path / "runs"),
            "--img-size", "16", "--batch-size", "2", "--workers", "0", "--epochs", "100000",
            "--max-steps", "1", "--device", "cpu"]
    last = tmp_path / "runs" / "exp" / "last.pth"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _wait_for(last, proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert f"Resume with: python {script} --resume {last}" in out  # the command that was run
    epoch = runstate.load_state(last)["epoch"]
    # resume, then kill -9 while it saves a checkpoint every few milliseconds
    proc = subprocess.Popen(args + ["--resume", str(last)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    before = last.stat().st_mtime_ns
    t = time.time()
    while last.stat().st_mtime_ns == before and time.time() - t < 120:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    time.sleep(0.37)
    proc.kill()
    proc.communicate()
    ck = runstate.load_state(last)
    assert ck["epoch"] > epoch


def test_resume_says_which_given_options_it_cannot_change(tmp_path, data, tiny, capsys):
    first = train_mod.train(tiny_config(tmp_path, data, epochs=1))
    last = Path(first["run_dir"]) / "last.pth"
    capsys.readouterr()
    again = train_mod.train(tiny_config(tmp_path, data, resume=str(last), lr=0.5, weight_decay=0.1, device="cpu"))
    out = capsys.readouterr().out
    assert "ignoring --lr, --weight-decay" in out and f"--weights {last}" in out
    # the saved run's options win: it was complete after its one epoch
    assert again["exit_code"] == 0 and runstate.load_state(last)["epoch"] == 1


def test_progress_in_a_log_is_a_timed_line_with_eta(tmp_path, data, tiny, capsys):
    # captured output is not a terminal: plain lines, one right after the first step (a log shows at once
    # that the run moves), then by the clock (none within 30 s here) and one at the epoch's end, each with
    # the epoch's time left and the whole run's, as a log file read later shows it
    train_mod.train(tiny_config(tmp_path, data, epochs=1))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch 1/1 ")]
    assert len(lines) == 2 and lines[0].startswith("epoch 1/1 1/4 (25%)  elapsed ")
    assert lines[1].startswith("epoch 1/1 4/4 (100%)  elapsed ") and lines[1].endswith("run ETA 0:00")
    assert ", ETA 0:00  loss " in lines[1] and " img/s " in lines[1]


def test_workers_streaming_across_epochs_train_the_same_run(tmp_path, data, tiny):
    """The device path's workers run on into the next epoch (fastpath.EpochStream): three epochs with
    two workers train exactly the weights that in-process loading (no stream) gives. (Without dropout:
    a DataLoader without workers draws its seed from the global RNG every epoch, which moves the masks.)"""
    runs = {}
    for workers in (0, 2):
        out = train_mod.train(tiny_config(tmp_path / f"w{workers}", data, epochs=3, workers=workers, gpu_augment="on",
                                          cache="off", decoder="pil", model="tiny-nonorm"))
        assert out["status"] == "done" and out["epochs"] == 3
        runs[workers] = runstate.load_state(Path(out["last"]))["model"]
    assert state_equal(runs[0], runs[2])


def test_config_yaml_records_each_setup_decision_and_why(tmp_path, data, tiny):
    """The plan (dlenv.train.plan) writes every decision's reason beside the options it resolved."""
    from dlenv.runfolder.trainstate import read_config_notes

    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, accum_steps=2))
    notes = read_config_notes(Path(out["run_dir"]) / "config.yaml")
    assert notes["precision"] == "fp32" and notes["precision_rule"] == "no --amp"
    assert notes["img_size_rule"] == "--img-size 16" and notes["batch_rule"] == "--batch-size 4, --accum-steps 2"
    assert notes["channels_last_rule"].startswith("off on cpu") and notes["compile_rule"].startswith(("auto", "off"))


def test_the_train_package_runs_nothing_of_the_trainer_for_its_loop():
    """`from dlenv.train.loop import ...` (and dlenv.engine.step, which the batch probe and bench train with) loads the
    loop alone: the package's face hands train/main on only when they are asked for."""
    code = ("import sys, dlenv.train.loop, dlenv.engine.step; "
            "print(sorted(m for m in sys.modules if m.startswith('dlenv.train')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["['dlenv.train',", "'dlenv.train.loop']"]


@pytest.mark.parametrize("resume_workers", ["auto", 0, 2], ids=["as printed (no --workers)", "--workers as the run",
                                                                  "--workers 2"])
def test_a_resume_is_exact_with_any_worker_count(tmp_path, data, tiny, capsys, resume_workers):
    """The printed resume (no --workers, so 'auto') continues with the run's count (issue 33); another count is
    exact too: each sample's augmentation is drawn from (seed, epoch, index), not from a worker's stream
    (dlenv.data.sampler.SeededDraws, issue 47)."""
    opts = dict(epochs=2, batch_size=2, workers=0, augment="standard")
    full = train_mod.train(tiny_config(tmp_path / "a", data, **opts))

    def on_step(state):
        if state.step == 3:
            signal.raise_signal(signal.SIGTERM)

    part = train_mod.train(tiny_config(tmp_path / "b", data, **opts), on_step=on_step)
    assert part["exit_code"] == 143
    capsys.readouterr()
    last = Path(part["run_dir"]) / "last.pth"
    resumed = train_mod.train(tiny_config(tmp_path / "c", data, resume=str(last), workers=resume_workers))
    out = capsys.readouterr().out
    assert resumed["exit_code"] == 0
    said = [ln for ln in out.splitlines() if "not exact" in ln]
    a, b = _final(Path(full["run_dir"])), _final(Path(resumed["run_dir"]))
    assert not said and state_equal(a["model"], b["model"])
    assert b["config"]["workers"] == (0 if resume_workers == "auto" else resume_workers)


def test_the_decided_precision_is_what_the_run_file_keeps_and_val_uses(tmp_path, data, tiny, monkeypatch):
    """A CPU --amp run that the plan decided to train in fp32 (bf16 was slower on that CPU) is saved as
    fp32, not as `amp: true, amp_dtype: auto`, which val on that CPU would have read as bf16."""
    import dlenv.train.auto
    from dlenv.runfolder.trained import trained_precision

    monkeypatch.setattr(dlenv.train.auto, "decide_precision",
                        lambda *a, **k: dlenv.train.auto.Decision("fp32", "auto: fp32, bf16 was slower for this model "
                                                                  "on this CPU"))
    out = train_mod.train(tiny_config(tmp_path, data, amp=True, epochs=1))
    assert out["precision"] == "fp32"
    saved = runstate.load_state(Path(out["last"]))["config"]
    assert saved["amp"] is False and trained_precision(saved) == "fp32"
    assert config.build(TrainConfig, Path(out["run_dir"]) / "config.yaml").amp is False


def test_a_stop_a_library_swallowed_during_start_up_is_honoured_before_the_epochs(tmp_path, data, tiny, monkeypatch):
    """SIGTERM while the run starts, inside a library's `except Exception` (torch's import, a decoder): the
    signal was noted (errors.stop) and the exception dropped. The run must stop before its first step."""
    from dlenv import errors
    from dlenv.train import plan

    real = plan.decide

    def decide(*a):
        with contextlib.suppress(BaseException):  # what a library that swallows everything does
            errors.stop(signal.SIGTERM)
        return real(*a)

    monkeypatch.setattr(plan, "decide", decide)
    steps = []
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1), on_step=steps.append)
    assert out["status"] == "interrupted" and out["exit_code"] == 143 and steps == []
