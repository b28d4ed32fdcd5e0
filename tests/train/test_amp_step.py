"""--amp keeps a reduced precision only where one training step of the run's own model runs in it on this torch
(dlenv.train.auto.amp_step_error, decide_precision's `model_step`); else fp32, with one line naming the error.

lucidrains' ViT (a patch embedding of LayerNorm, Linear, LayerNorm: tests/usermodels.LN_VIT) cannot train in
bf16 under PyTorch 1.13's CPU autocast and can under 2.x: `_ln_vit_fails_here` asks this torch directly, and
each lane checks that the trainer agrees with it (the image-pins lane falls back, the newest lane trains bf16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinymodels import Tiny, tiny_config
from torch import nn
from usermodels import LN_VIT, isolated_imports, write

from dlenv import train as train_mod
from dlenv.files import runstate
from dlenv.runfolder.trainstate import read_config_notes
from dlenv.train import auto, cpuprobe

CPU = torch.device("cpu")


def _ln_vit_fails_here() -> bool:
    """Whether this torch's CPU autocast refuses LayerNorm -> Linear -> LayerNorm in bf16 (1.13: yes)."""
    m = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4), nn.LayerNorm(4))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(torch.randn(2, 8)).float().sum().backward()
    except RuntimeError:
        return True
    return False


class _Refuses(nn.Module):
    """A model with an op that refuses a reduced-precision input the way a dtype check does (`message` under
    autocast; `always`: in fp32 too)."""

    def __init__(self, message: str = "expected scalar type Float but found BFloat16", always: bool = False):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.message, self.always = message, always

    def forward(self, x):
        out = self.fc(x.mean((2, 3)))
        if self.always or out.dtype != torch.float32:
            raise RuntimeError(f"{self.message}\nsecond line of the error")
        return out


@pytest.mark.parametrize("build,expected", [
    (lambda: Tiny(2), None),  # conv, BatchNorm, dropout, linear: runs in bf16 on every torch
    (lambda: _Refuses(), "expected scalar type Float but found BFloat16"),  # the error's first line only
    (lambda: _Refuses(always=True), None),  # fails in fp32 too: the model's own error, not the precision's
    (lambda: _Refuses("CUDA out of memory. Tried to allocate 2.00 GiB"), None),  # memory, not the precision
])
def test_amp_step_error_names_only_a_failure_of_the_precision(build, expected):
    assert auto.amp_step_error(build, "bf16", CPU, 16, 2) == expected


def test_amp_step_error_on_lucidrains_vit_agrees_with_this_torch(tmp_path):
    with isolated_imports(tmp_path):
        from dlenv.model import usermodel

        write(tmp_path, "vit.py", LN_VIT)
        ref = f"{tmp_path / 'vit.py'}:ViT"
        failed = auto.amp_step_error(lambda: usermodel.build(ref, 2), "bf16", CPU, 16, 2)
    if _ln_vit_fails_here():
        assert failed == "expected scalar type BFloat16 but found Float"
    else:
        assert failed is None


def test_the_model_step_leaves_the_random_streams_as_they_were():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert auto.amp_step_error(lambda: Tiny(2), "bf16", CPU, 16, 2) is None  # builds, draws a batch, dropout
    assert torch.equal(torch.rand(4), expected)


def _never(mode: str) -> float:
    raise AssertionError("the speed probe ran")


@pytest.mark.parametrize("amp,dtype,device,native,step,expected", [
    (True, "bf16", "cpu", None, None, "bf16"),           # the model's step ran: bf16 as asked
    (True, "bf16", "cpu", None, "no bf16 here", "fp32"),  # it failed: fp32
    (True, "bf16", "cpu", False, "no bf16 here", "fp32"),  # asked by name on a CPU without bf16: still tried
    (True, "fp16", "cuda", None, None, "fp16"),
    (True, "fp16", "cuda", None, "expected scalar type Half but found Float", "fp32"),  # on CUDA the same
])
def test_decide_precision_keeps_what_the_models_step_runs_in(amp, dtype, device, native, step, expected,
                                                             monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # a GPU that has both
    tried = []

    def model_step(mode):
        tried.append(mode)
        return step

    decided = auto.decide_precision(amp, dtype, device, _never, native=native, model_step=model_step)
    assert decided.value == expected and tried == [dtype]
    if step:
        assert decided.why.startswith(f"--amp: one {dtype} training step of this model failed on {device} with "
                                      f"PyTorch {torch.__version__} ({step}), so training in fp32")


@pytest.mark.parametrize("amp,native", [(False, None), (True, False)])
def test_no_model_step_where_the_machine_already_says_fp32(amp, native, tmp_path):
    """No --amp, or --amp on a CPU without bfloat16 instructions: fp32 without building the model."""
    def model_step(mode):
        raise AssertionError("the model's step ran")

    decided = auto.decide_precision(amp, "auto", "cpu", _never, cache=tmp_path / "c.json", native=native,
                                    model_step=model_step)
    assert decided.value == "fp32"


@pytest.mark.parametrize("mine,others_fp32,expected", [
    ("bf16", False, "bf16"),  # every process chose bf16
    ("bf16", True, "fp32"),   # another read a verdict of fp32 (or its model's step failed): all train in fp32
    ("fp32", False, "fp32"),  # this one chose fp32 before any model step: it still takes part in the vote
    ("fp32", True, "fp32"),
])
def test_the_processes_of_a_run_agree_on_the_precision_in_one_vote(mine, others_fp32, expected, monkeypatch):
    """Each rank decides alone, then all agree in one collective that every rank reaches whatever it
    decided: a collective only the ranks choosing bf16 reached hung two CPU processes (CI, --gpus 2)."""
    from dlenv.train import plan

    votes = []

    def agree(value, op):
        votes.append((value, op))
        return max(float(value), float(others_fp32))

    monkeypatch.setattr(plan.distributed, "agree", agree)
    monkeypatch.setattr(plan.auto, "decide_precision", lambda *a, **k: auto.Decision(mine, "as this rank measured"))
    from types import SimpleNamespace

    cfg = SimpleNamespace(amp=True, amp_dtype="auto")
    decided = plan._precision(cfg, torch.device("cpu"), SimpleNamespace())
    assert votes == [(mine == "fp32", "max")] and decided.value == expected
    if mine == "bf16" and others_fp32:
        assert "another process of this run trains in fp32" in decided.why


# ---------------------------------------------------------------------------------------------------
# The trainer.


@pytest.fixture
def ln_vit(tmp_path, monkeypatch):
    """models/vit.py (LN_VIT) in a project folder that is the working folder; returns --model's value."""
    root = tmp_path / "proj"
    write(root, "models/vit.py", LN_VIT)
    monkeypatch.chdir(root)
    with isolated_imports(tmp_path):
        yield "models/vit.py:ViT"


@pytest.fixture
def bf16_pays(monkeypatch):
    """A CPU with bfloat16 instructions on which bf16 steps were measured faster: --amp means bf16 here."""
    monkeypatch.setattr(cpuprobe, "cpu_bf16_native", lambda cpuinfo=None: True)
    monkeypatch.setattr(cpuprobe, "cpu_probe_seconds", lambda mode: {"fp32": 2.0, "bf16": 1.0}[mode])
    monkeypatch.setattr(cpuprobe, "cpu_amp_cache", lambda: None)


@pytest.mark.parametrize("dtype", ["auto", "bf16"])
def test_train_amp_on_lucidrains_vit_trains_in_what_this_torch_runs(tmp_path, data, ln_vit, bf16_pays, capsys,
                                                                     dtype):
    """`train --amp` on the ViT: on PyTorch 1.13 it finishes in fp32 and says why in one line (and config.yaml's
    precision_rule); on 2.x it trains in bf16."""
    out = train_mod.train(tiny_config(tmp_path, data, model=ln_vit, amp=True, amp_dtype=dtype, epochs=1))
    said = capsys.readouterr().out
    notes = read_config_notes(Path(out["run_dir"]) / "config.yaml")
    assert out["exit_code"] == 0
    if _ln_vit_fails_here():
        line = ("--amp: one bf16 training step of this model failed on cpu with PyTorch "
                f"{torch.__version__} (expected scalar type BFloat16 but found Float), so training in fp32")
        assert out["precision"] == "fp32" and notes["precision"] == "fp32"
        assert [ln for ln in said.splitlines() if "training step of this model failed" in ln] == [line]
        assert notes["precision_rule"] == line
        assert runstate.load_state(Path(out["last"]))["config"]["amp"] is False  # val, predict: fp32 too
    else:
        assert out["precision"] == "bf16" and notes["precision"] == "bf16"
        assert "failed" not in said


def test_a_model_that_trains_in_bf16_ends_as_without_the_models_step(tmp_path, data, tiny, monkeypatch):
    """The step of the model (a copy, from forked random streams) changes nothing of the run: --deterministic
    bf16 on a CPU ends in the same weights and BatchNorm statistics with it as without it."""
    opts = dict(amp=True, amp_dtype="bf16", epochs=2, deterministic=True)
    with_step = train_mod.train(tiny_config(tmp_path / "a", data, **opts))
    calls = []

    def no_step(*args, **kwargs):
        calls.append(args)
        return None

    monkeypatch.setattr(auto, "amp_step_error", no_step)
    without = train_mod.train(tiny_config(tmp_path / "b", data, **opts))
    assert calls and with_step["precision"] == without["precision"] == "bf16"
    a = runstate.load_state(Path(with_step["last"]))["model"]
    b = runstate.load_state(Path(without["last"]))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("running_mean" in k for k in a)
