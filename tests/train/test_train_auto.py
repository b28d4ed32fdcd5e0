"""dlenv.train.auto and what the trainer does with it: --compile auto/on/off (the rule, the line it
says, config.yaml, compile time kept out of img/s, the fall back to eager when compiling fails) and
--checkpoint-ratio auto off the GPU. The probe behind the ratio on a GPU is tested in
tests/engine/test_checkpointsearch.py (against a fake memory limit) and test_train_gpu.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml
from tinymodels import Tiny, tiny_config

from dlenv import compat
from dlenv import train as train_mod
from dlenv.options import config
from dlenv.options.config import TrainConfig
from dlenv.options.values import on_off_auto, ratio_or_auto
from dlenv.runfolder import results
from dlenv.runfolder.trainstate import read_config_notes
from dlenv.train import auto

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _probe(precision: str = "bf16", channels_last: bool = True) -> auto.Probe:
    """What --checkpoint-ratio auto probes with: resnet18 of 4 classes at 32 px on a (fake) GPU."""
    from dlenv.model.models import build_model

    return auto.Probe("resnet18", lambda: build_model("resnet18", 4), 4, 32, precision, CUDA, channels_last)
MIN = auto.COMPILE_MIN_BATCHES
needs_compile = pytest.mark.skipif(not compat.HAS_COMPILE, reason="PyTorch 1.13 has no torch.compile")


# ---------------------------------------------------------------------------------------------------
# The values and the rule.


@pytest.mark.parametrize("given,want", [
    ("auto", "auto"), ("AUTO", "auto"), ("on", "on"), ("off", "off"), (True, "on"), (False, "off"),
    ("true", "on"), ("no", "off"), ("1", "on"), ("0", "off"), (" Auto ", "auto"),
])
def test_on_off_auto_reads_every_spelling(given, want):
    assert on_off_auto(given) == want


@pytest.mark.parametrize("bad", ["maybe", "", "2", None, [1], 0.5])
def test_on_off_auto_refuses_the_rest(bad):
    with pytest.raises(ValueError, match="auto, on or off"):
        on_off_auto(bad)


@pytest.mark.parametrize("given,want", [("auto", "auto"), ("0", 0.0), (1, 1.0), ("0.25", 0.25), (0.5, 0.5)])
def test_ratio_or_auto(given, want):
    assert ratio_or_auto(given) == want


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "nan", "inf", "half", True, None])
def test_ratio_or_auto_refuses(bad):
    with pytest.raises(ValueError):
        ratio_or_auto(bad)


@pytest.mark.parametrize("flag,value,want", [
    ("--compile", "sometimes", "expected auto, on or off"),
    ("--checkpoint-ratio", "2", "expected 'auto' or a fraction"),
])
def test_bad_values_are_one_line_naming_the_flag(flag, value, want):
    from dlenv.errors import UserError

    with pytest.raises(UserError, match=want) as e:
        config.build(TrainConfig, **{flag[2:].replace("-", "_"): value})
    assert flag in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv,want", [
    (["train"], "auto"), (["train", "--compile"], "on"), (["train", "--no-compile"], "off"),
    (["train", "--compile", "off"], "off"), (["train", "--compile", "auto", "--amp"], "auto"),
    (["train", "--compile", "--amp"], "on"), (["train", "--amp", "--compile"], "on"),
])
def test_cli_compile_alone_means_on(argv, want):
    from dlenv.cli import build_parser

    ns = vars(build_parser().parse_args(argv))
    given = {k: v for k, v in ns.items() if k not in ("verb", "command", "cfg", "func")}
    assert config.build(TrainConfig, **{k: v for k, v in given.items() if k in {"compile", "amp"}}).compile == want


@pytest.mark.parametrize("argv,want", [
    (["invoke", "train", "--compile"], "on"), (["invoke", "train", "--compile", "off"], "off"),
    (["invoke", "train", "--compile", "--amp"], "on"), (["invoke", "train", "--amp"], None),
])
def test_invoke_compile_alone_means_on(argv, want, monkeypatch):
    from invoke import Program

    from dlenv import tasks

    calls = []
    monkeypatch.setattr(tasks, "run_command", lambda name, given, yaml_file: calls.append(given) or 0)
    Program(namespace=tasks.ns).run(argv, exit=False)
    assert calls and calls[0].get("compile") == want


@pytest.mark.parametrize("choice,has,device,planned,on,says", [
    ("off", True, CUDA, 10**6, False, "--compile off"),
    ("on", True, CPU, 1, True, "--compile on"),
    ("on", False, CUDA, 10**6, False, "has no torch.compile"),
    ("auto", False, CUDA, 10**6, False, "auto means off here"),
    ("auto", True, CPU, 10**6, False, "compiling pays on a GPU"),
    ("auto", True, CUDA, MIN - 1, False, f"{MIN - 1:,} planned micro-batches"),
    ("auto", True, CUDA, MIN, True, f"{MIN:,} planned micro-batches per GPU repay"),
    ("auto", True, CUDA, 50 * MIN, True, "--compile off to run eagerly"),
])
def test_decide_compile(choice, has, device, planned, on, says, monkeypatch):
    monkeypatch.setattr(compat, "HAS_COMPILE", has)
    got, why = auto.decide_compile(choice, device, planned)
    assert got is on and says in why


# ---------------------------------------------------------------------------------------------------
# The trainer.


def _yaml(run: str | Path) -> dict:
    """config.yaml's options, and the notes in its comments (`# key: value`) under the same keys."""
    path = Path(run) / "config.yaml"
    return {**read_config_notes(path), **yaml.safe_load(path.read_text(encoding="utf-8"))}


def test_auto_compile_on_a_cpu_is_off_and_recorded(tmp_path, data, tiny, capsys):
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1))
    saved = _yaml(out["run_dir"])
    assert saved["compile"] == "off"
    assert "auto" in saved["compile_rule"] and ("cpu" in saved["compile_rule"] or "no torch.compile" in
                                                saved["compile_rule"])
    # config.yaml runs again as it ran: the recorded choice, not auto
    assert config.build(TrainConfig, Path(out["run_dir"]) / "config.yaml").compile == "off"
    said = capsys.readouterr().out
    # on PyTorch 1.13 auto says once that it cannot compile; on 2.x a CPU run says nothing of it
    assert said.count("no torch.compile") == (0 if compat.HAS_COMPILE else 1)


@pytest.mark.skipif(compat.HAS_COMPILE, reason="PyTorch 2.x has torch.compile")
def test_compile_on_without_torch_compile_says_so_and_trains(tmp_path, data, tiny, capsys):
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, compile="on"))
    assert out["exit_code"] == 0 and _yaml(out["run_dir"])["compile"] == "off"
    assert capsys.readouterr().out.count(f"PyTorch {torch.__version__} has no torch.compile") == 1


def _backend(calls: list, sleep: float = 0.0, fail: bool = False):
    """A torch.compile backend that runs the captured graph as it is (no code generation: seconds on
    this CPU, not minutes), after `sleep` seconds of "compiling", or that fails like a broken compiler."""
    def backend(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        if fail:
            raise RuntimeError("the compiler crashed (a test's broken backend)")
        time.sleep(sleep)
        return gm.forward
    return backend


@needs_compile
def test_compile_time_is_its_own_phase_and_not_in_img_per_s(tmp_path, data, tiny, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(compat, "compile_model", lambda m, **kw: torch.compile(m, backend=_backend(calls, 1.5)))
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, compile="on"))
    assert calls, "the model was not compiled"
    row = results.read_results(Path(out["run_dir"]) / "results.csv").iloc[-1]
    assert out["compile_s"] >= 1.5 * len(calls)
    # 16 images: counted at full epoch time the speed would be under 16 / epoch_s; the compile is left out
    assert row["img_per_s"] > 2 * 16 / row["epoch_s"]
    assert f"(compile {out['compile_s']:.1f} s)" in capsys.readouterr().out
    assert _yaml(out["run_dir"])["compile"] == "on"


@needs_compile
def test_a_failing_compile_falls_back_to_eager_in_one_line(tmp_path, data, tiny, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(compat, "compile_model",
                        lambda m, **kw: torch.compile(m, backend=_backend(calls, fail=True)))
    out = train_mod.train(tiny_config(tmp_path, data, epochs=2, compile="on", accum_steps=2))
    said = capsys.readouterr().out
    assert out["exit_code"] == 0 and out["epochs"] == 2 and calls
    lines = [ln for ln in said.splitlines() if "torch.compile failed" in ln]
    assert len(lines) == 1 and "the compiler crashed" in lines[0] and "training eagerly" in lines[0]
    assert "Traceback" not in said
    rows = results.read_results(Path(out["run_dir"]) / "results.csv")
    assert len(rows) == 2 and rows["train_loss"].notna().all()
    # every step after the fall back ran: 16 images in batches of 4, 2 per step, 2 epochs
    assert out["step"] == 4


@needs_compile
def test_a_short_last_batch_gets_a_static_graph_not_a_dynamic_one(tmp_path, data, tiny, monkeypatch):
    """The trainer compiles with dynamic=False: an epoch's short last batch gets a static graph of its own.
    With torch.compile's automatic dynamic shapes (2.1+) the second batch size recompiled the model with a
    symbolic batch size, and that slower graph then served every full batch after it (issue 36's profile)."""
    shapes: list = []

    def backend(gm, example_inputs):
        shapes.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        shapes.extend(t for t in example_inputs if not isinstance(t, (torch.Tensor, int)))  # a SymInt input
        return gm.forward

    monkeypatch.setattr(compat, "compile_model", lambda m, **kw: torch.compile(m, backend=backend, **kw))
    out = train_mod.train(tiny_config(tmp_path, data, epochs=2, compile="on", batch_size=6))  # 16 = 2 x 6 + 4
    assert out["exit_code"] == 0 and shapes, "the model was not compiled"
    batch_sizes = {s[0] for s in shapes if isinstance(s, tuple) and len(s) == 4}
    symbolic = [s for s in shapes if not isinstance(s, tuple) or not all(isinstance(d, int) for d in s)]
    assert not symbolic, f"a graph with a symbolic shape: {symbolic[:3]}"
    assert {6, 4} <= batch_sizes, batch_sizes  # both the full and the short batch ran compiled, each static


@needs_compile
def test_a_model_error_under_compile_is_not_swallowed(tmp_path, data, tiny, monkeypatch):
    """Only torch.compile's own failures fall back; the model's errors stay errors."""
    monkeypatch.setattr(compat, "compile_model", lambda m, **kw: torch.compile(m, backend=_backend([])))
    monkeypatch.setattr(Tiny, "forward", lambda self, x: x.view(-1, 7))  # a shape bug of the model
    with pytest.raises(Exception) as e:
        train_mod.train(tiny_config(tmp_path, data, epochs=1, compile="on"))
    assert any(w in str(e.value) for w in ("view", "shape", "size"))


def test_is_compile_error_follows_the_cause_chain():
    class DynamoError(Exception):
        pass

    DynamoError.__module__ = "torch._dynamo.exc"
    inner = DynamoError("backend failed")
    outer = RuntimeError("wrapped")
    outer.__cause__ = inner
    assert compat.is_compile_error(inner) and compat.is_compile_error(outer)
    assert not compat.is_compile_error(RuntimeError("CUDA out of memory"))
    assert not compat.is_compile_error(ValueError("a model's own bug"))


def test_cause_chain_follows_inner_exception_and_cause_and_stops_on_a_cycle():
    root, middle, outer = ValueError("root"), RuntimeError("middle"), RuntimeError("outer")
    middle.__cause__ = root
    outer.inner_exception = middle  # dynamo's BackendCompilerFailed keeps the backend's error here
    assert compat.cause_chain(outer) == [outer, middle, root]
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert len(compat.cause_chain(a, limit=5)) == 5


@pytest.mark.parametrize("given,want_ratio,says", [
    ({}, 0.0, "auto: none of"),  # auto on a CPU: no block (recomputing costs time; memory is rarely short)
    pytest.param({"checkpoint_ratio": 0.5}, 0.5, "--checkpoint-ratio 0.5", marks=pytest.mark.slow),
    pytest.param({"checkpoint_ratio": "0"}, 0.0, "--checkpoint-ratio 0", marks=pytest.mark.slow),
])
def test_checkpoint_ratio_off_the_gpu(tmp_path, data, given, want_ratio, says, capsys):
    import dlenv.model.models

    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, max_steps=1, model="resnet18", checkpoint=True,
                              deterministic=False, **given))
    saved = _yaml(out["run_dir"])
    assert saved["checkpoint_ratio"] == want_ratio and says in saved["checkpoint_rule"]
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("training resnet18")]
    # the header names checkpointing only where blocks are recomputed: none on a CPU's auto
    assert len(start) == 1 and ("checkpointing" in start[0]) == (want_ratio > 0)
    if want_ratio:
        assert f" checkpointing {round(want_ratio * 8)} of 8 blocks |" in start[0]
    blocks = dlenv.model.checkpointing.find_blocks(dlenv.model.models.build_model("resnet18", 2))
    assert len(blocks) == 8  # resnet18's BasicBlocks: the ratio's denominator


def test_cpu_checkpoint_auto_recomputes_nothing_and_says_what_it_would_cost():
    ratio, why = auto.cpu_checkpoint_ratio(4)
    assert ratio == 0.0 and "forward again" in why and "--checkpoint-ratio 1" in why


def _plan(ratio: float | None, blocks: int):
    """A CPU plan whose --checkpoint recomputes `ratio` of `blocks` (None: no --checkpoint)."""
    from types import SimpleNamespace

    from dlenv.train.plan import OptimizerChoice, Split, StepChoice, TrainPlan

    d = auto.Decision
    return TrainPlan(config.build(TrainConfig, epochs=1), SimpleNamespace(source="data/x", classes=["a", "b"]),
                     d("fp32", ""), SimpleNamespace(name="resnet18"), d(False, ""), d(Split(32, 1), ""), 1,
                     SimpleNamespace(img_size=32), 10, None if ratio is None else d(ratio, "why"), d(False, ""),
                     OptimizerChoice("adamw", 1e-3, 0.05, 0.9, False, 0, 10), StepChoice(0.1, None, None, False),
                     False, blocks=blocks)


def _start_line(ratio: float | None, blocks: int) -> str:
    """The start line of a plan whose --checkpoint recomputes `ratio` of `blocks` (None: no --checkpoint)."""
    return _plan(ratio, blocks).start_line(CPU, False, "runs/exp")


@pytest.mark.parametrize("ratio,blocks,says", [
    (None, 0, None),                  # no --checkpoint
    (0.0, 8, None),                   # a CPU's auto, or --checkpoint-ratio 0: nothing recomputed
    (1.0, 0, None),                   # a model without repeated blocks trains without it
    (3 / 8, 8, " checkpointing 3 of 8 blocks |"),
    (0.5, 16, " checkpointing 8 of 16 blocks |"),
    (1.0, 16, " checkpointing 16 of 16 blocks |"),
    (0.01, 16, None),                 # round(0.16) = 0 blocks wrapped, as apply_checkpointing rounds
])
def test_the_start_line_says_checkpointing_only_for_blocks_recomputed(ratio, blocks, says):
    line = _start_line(ratio, blocks)
    assert ("checkpointing" in line) == (says is not None) and line.startswith("training resnet18 on data/x")
    if says:
        assert says in line


@pytest.mark.parametrize("ratio,blocks", [
    (None, 0),   # no --checkpoint
    (0.0, 8),    # --checkpoint with --checkpoint-ratio auto on a CPU: decided off, nothing recomputed
    (1.0, 0),    # a model without repeated blocks
    (3 / 8, 8),  # blocks recomputed
    (1.0, 16),
])
def test_the_oom_advice_and_the_start_line_agree_on_checkpointing(ratio, blocks):
    """Both read the blocks the plan recomputes: where the start line names no checkpointing, the out-of-memory
    advice offers --checkpoint; where it names it, the advice does not (it once read the option instead)."""
    from types import SimpleNamespace

    from dlenv.runfolder.trainstate import TrainState
    from dlenv.train.fit import _Epochs

    plan = _plan(ratio, blocks)
    epochs = SimpleNamespace(parts=SimpleNamespace(device=CPU, precision=SimpleNamespace(mode="fp32")), plan=plan,
                             write_memory_report=lambda: None)
    advice = _Epochs.oom_advice(epochs, TrainState(micro_batch=32, accum_steps=1))
    on = "checkpointing" in plan.start_line(CPU, False, "runs/exp")
    assert on == (plan.recomputed_blocks > 0)
    assert ("--checkpoint (recompute" in advice) == (not on), advice


def test_checkpoint_ratio_help_says_what_auto_does_on_each_device():
    helps = {f.name: f.metadata["help"] for f in config.options(TrainConfig)}
    text = helps["checkpoint_ratio"]
    assert "on a GPU the fewest" in text and "on a CPU none" in text and "every block elsewhere" not in text


def test_hflip_auto_on_digits_is_said_once_and_recorded(tmp_path, tiny, capsys):
    from imagedata import make_train_val

    digits = make_train_val(tmp_path / "digits", per_class=2, val_per_class=1, classes=tuple("0123"))
    out = train_mod.train(tiny_config(tmp_path, digits, epochs=1, max_steps=1))
    said = capsys.readouterr().out
    assert said.count("--hflip auto: off, the classes look like characters (0, 1, 2, 3)") == 1
    assert "no flips" in said
    saved = _yaml(out["run_dir"])
    assert saved["hflip"] == "off" and saved["hflip_rule"].startswith("auto: off")
    # config.yaml reruns the run as it ran: flips off, now as given
    assert config.build(TrainConfig, Path(out["run_dir"]) / "config.yaml").hflip == "off"


def test_hflip_auto_on_photos_flips_and_says_nothing_more(tmp_path, data, tiny, capsys):
    saved = _yaml(train_mod.train(tiny_config(tmp_path, data, epochs=1, max_steps=1))["run_dir"])
    assert saved["hflip"] == "on" and saved["hflip_rule"].startswith("auto: on")
    assert "--hflip" not in capsys.readouterr().out


def test_no_checkpoint_leaves_no_checkpoint_rule(tmp_path, data, tiny):
    saved = _yaml(train_mod.train(tiny_config(tmp_path, data, epochs=1))["run_dir"])
    assert "checkpoint_rule" not in saved and saved["checkpoint_ratio"] == "auto"


# ---------------------------------------------------------------------------------------------------
# --checkpoint-ratio auto on a GPU, with the probe's answer faked (the search itself:
# tests/engine/test_checkpointsearch.py).


def _search(blocks, n, fits_all=True):
    from dlenv.engine.checkpointsearch import CheckpointSearch

    return lambda *a, **k: CheckpointSearch(blocks, n, fits_all)


def _oom(*a, **k):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _broken(*a, **k):
    raise RuntimeError("a model's own bug")


@pytest.mark.parametrize("probe,ratio,says", [
    (_search(0, 8), 0.0, "auto: 0 of 8 blocks, batch 64 fits on Fake GPU without recompute"),
    (_search(3, 8), 3 / 8, "auto: 3 of 8 blocks let batch 64 fit on Fake GPU"),
    (_search(8, 8), 1.0, "auto: 8 of 8 blocks let batch 64 fit"),
    (_search(8, 8, fits_all=False), 1.0, "auto: all 8 blocks, and batch 64 may still not fit"),
    (_oom, 1.0, "may still not fit"),
])
def test_checkpoint_ratio_auto_takes_the_probes_answer(probe, ratio, says, monkeypatch):
    import dlenv.engine.checkpointsearch

    monkeypatch.setattr(dlenv.engine.checkpointsearch, "fewest_checkpoint_blocks", probe)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    said: list = []
    c = config.build(TrainConfig, checkpoint=True, batch_size=64, model="resnet18")
    got, why = auto.checkpoint_ratio(c, 8, _probe(), 64, said.append)
    assert got == ratio and says in why and said == [f"--checkpoint-ratio {why}"]


@pytest.mark.parametrize("ratio", [0.0, 3 / 8, 0.5, 1.0])
def test_the_model_is_built_checkpointed_at_the_planned_ratio(ratio):
    """dlenv.train.parts wraps the first round(ratio x blocks) blocks, exactly as the plan counts them."""
    from types import SimpleNamespace

    from dlenv.model.checkpointing import find_blocks, is_checkpointed
    from dlenv.model.models import build_model
    from dlenv.train import parts

    plan = SimpleNamespace(model=SimpleNamespace(build=lambda: build_model("resnet18", 4), check=lambda m: None),
                           memory_format=torch.contiguous_format, checkpoint_ratio=auto.Decision(ratio, ""),
                           recomputed_blocks=round(ratio * 8))
    model = parts.build_model(plan, CPU)
    assert [is_checkpointed(b) for b in find_blocks(model)] == [i < round(ratio * 8) for i in range(8)]


@pytest.mark.parametrize("given,ratio,says", [
    ({"batch_size": "auto"}, 1.0, "--batch-size auto measures the batch with every block checkpointed"),
    ({"batch_size": "max"}, 1.0, "--batch-size max measures the batch with every block checkpointed"),
    ({"checkpoint_ratio": 0.25}, 0.25, "--checkpoint-ratio 0.25"),
])
def test_checkpoint_ratio_auto_does_not_probe_when_nothing_to_decide(given, ratio, says, monkeypatch):
    import dlenv.engine.checkpointsearch

    monkeypatch.setattr(dlenv.engine.checkpointsearch, "fewest_checkpoint_blocks", _broken)  # never called
    c = config.build(TrainConfig, checkpoint=True, model="resnet18", **given)
    got, why = auto.checkpoint_ratio(c, 8, _probe(), 64, print)
    assert got == ratio and says in why


def test_checkpoint_ratio_auto_lets_a_real_error_through(monkeypatch):
    import dlenv.engine.checkpointsearch

    monkeypatch.setattr(dlenv.engine.checkpointsearch, "fewest_checkpoint_blocks", _broken)
    c = config.build(TrainConfig, checkpoint=True, batch_size=64, model="resnet18")
    with pytest.raises(RuntimeError, match="own bug"):
        auto.checkpoint_ratio(c, 8, _probe(), 64, print)


def test_no_checkpoint_no_ratio():
    c = config.build(TrainConfig, batch_size=64)
    assert auto.checkpoint_ratio(c, 0, _probe("fp32", False), 64, print) is None


def test_a_model_without_blocks_is_told_once(tmp_path, data, tiny, capsys):
    out = train_mod.train(tiny_config(tmp_path, data, epochs=1, checkpoint=True))
    said = capsys.readouterr().out
    assert said.count("no repeated blocks") == 1 and "--checkpoint-ratio" not in said
    assert "checkpointing" not in next(line for line in said.splitlines() if line.startswith("training tiny"))
    assert _yaml(out["run_dir"])["checkpoint_rule"] == "auto: the model has no repeated blocks"
