"""dlenv.engine.precision: the mode for --amp / --amp-dtype, and the one AMP path's behaviour (CPU here, CUDA
under gpu). What --amp becomes on a CPU is the trainer's decision: tests/train/test_cpuprobe.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlenv import compat
from dlenv.engine.precision import Precision, resolve_precision
from dlenv.errors import UserError

# ---------------------------------------------------------------------------------------------------
# resolve_precision


@pytest.mark.parametrize("dtype", ["auto", "fp16", "bf16"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_amp_is_fp32_everywhere(dtype, device):
    assert resolve_precision(False, dtype, device) == "fp32"


def test_cpu_amp_is_bf16():
    assert resolve_precision(True, "auto", "cpu") == "bf16"
    assert resolve_precision(True, "bf16", torch.device("cpu")) == "bf16"


def test_cpu_fp16_is_refused_with_the_way_out():
    with pytest.raises(UserError, match="CPU autocast computes in bfloat16.*--amp-dtype bf16"):
        resolve_precision(True, "fp16", "cpu")


def test_unknown_amp_dtype_is_named():
    with pytest.raises(UserError, match="'fp8'"):
        resolve_precision(True, "fp8", "cpu")


@pytest.mark.parametrize("bf16_ok, expected", [(True, "bf16"), (False, "fp16")])
def test_cuda_auto_follows_bf16_support(monkeypatch, bf16_ok, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert resolve_precision(True, "auto", "cuda") == expected
    assert resolve_precision(True, "fp16", "cuda:0") == "fp16"


def test_cuda_bf16_without_support_names_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    with pytest.raises(UserError, match="Tesla T4.*--amp-dtype fp16"):
        resolve_precision(True, "bf16", "cuda")


# ---------------------------------------------------------------------------------------------------
# Precision on the CPU


def test_bad_mode_and_misplaced_scaler_are_value_errors():
    with pytest.raises(ValueError, match="'fp64'"):
        Precision("fp64", "cpu")
    with pytest.raises(ValueError, match="no GradScaler"):
        Precision("bf16", "cpu", scaler=compat.grad_scaler(enabled=False))
    with pytest.raises(ValueError, match="no GradScaler"):
        Precision("fp32", "cpu", scaler=object())
    with pytest.raises(ValueError, match="CUDA"):
        Precision("fp16", "cpu")


def test_cpu_bf16_autocast_computes_in_bf16():
    p = Precision("bf16", "cpu")
    assert p.dtype == torch.bfloat16 and p.mode == "bf16"
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with p.autocast():
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32


def test_fp32_autocast_is_a_no_op():
    p = Precision("fp32", "cpu")
    a = torch.randn(4, 4)
    with p.autocast():
        assert (a @ a).dtype == torch.float32
        assert compat.autocast_state()["cpu"][0] is False


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_no_loss_scaling_outside_fp16(mode):
    p = Precision(mode, "cpu")
    assert not p.scaler.is_enabled()
    assert p.state_dict() == {}
    p.load_state_dict({})  # an fp32 run's state loads into any mode


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_one_code_path_trains_on_cpu(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(32, 8), (torch.arange(32) % 2)
    p = Precision(mode, "cpu")
    losses = []
    for _ in range(20):
        with p.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        p.backward(loss)
        assert p.step(opt, clip=1.0) is True
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(w.dtype == torch.float32 for w in model.parameters())
    assert losses[-1] < losses[0] * 0.8


def test_step_clips_the_total_norm_then_steps():
    w = nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    assert Precision("fp32", "cpu").step(opt, clip=1.0)
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8, 0.0, 0.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.detach(), torch.tensor([-0.6, -0.8, 0.0, 0.0]), rtol=1e-5, atol=1e-6)


def test_step_clips_only_the_parameters_given():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([a, b], lr=1.0)
    a.grad, b.grad = torch.tensor([30.0, 40.0]), torch.tensor([3.0, 4.0])
    Precision("fp32", "cpu").step(opt, clip=1.0, parameters=[b])
    torch.testing.assert_close(a.grad, torch.tensor([30.0, 40.0]))
    torch.testing.assert_close(b.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# CUDA


def _fp16_setup(init_scale=2.0**10):
    torch.manual_seed(0)
    model = nn.Linear(16, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, Precision("fp16", "cuda", scaler=compat.grad_scaler(True, init_scale=init_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("mode, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cuda_autocast_dtype(mode, dtype):
    p = Precision(mode, "cuda")
    a = torch.randn(8, 8, device="cuda")
    with p.autocast():
        assert (a @ a).dtype == dtype
    assert p.scaler.is_enabled() == (mode == "fp16")


@pytest.mark.gpu
def test_fp16_step_is_skipped_on_inf_gradients_and_the_scale_backs_off():
    model, opt, p = _fp16_setup()
    x = torch.randn(8, 16, device="cuda")
    before = [w.detach().clone() for w in model.parameters()]
    with p.autocast():
        loss = model(x).float().sum()
    p.backward(loss)
    model.weight.grad[0, 0] = float("inf")
    scale = p.scaler.get_scale()
    assert p.step(opt) is False
    assert all(torch.equal(a, w) for a, w in zip(before, model.parameters(), strict=False))
    assert p.scaler.get_scale() == scale / 2
    opt.zero_grad(set_to_none=True)
    with p.autocast():
        loss = model(x).float().sum()
    p.backward(loss)
    assert p.step(opt) is True
    assert not torch.equal(before[0], model.weight.detach())


@pytest.mark.gpu
def test_fp16_clips_the_unscaled_gradients():
    """clip applies to true gradients: after step the grads' norm is the clip value, not clip/scale."""
    model, opt, p = _fp16_setup(init_scale=2.0**4)
    x = torch.randn(8, 16, device="cuda") * 10
    with p.autocast():
        loss = model(x).float().pow(2).mean()
    p.backward(loss)
    scaled_norm = torch.cat([w.grad.flatten() for w in model.parameters()]).norm().item()
    before = [w.detach().clone() for w in model.parameters()]
    assert p.step(opt, clip=0.5) is True
    grads = torch.cat([w.grad.flatten() for w in model.parameters()])
    assert scaled_norm / 2.0**4 > 0.5  # the true norm was above the clip value
    assert grads.norm().item() == pytest.approx(0.5, rel=1e-3)
    for b, w in zip(before, model.parameters(), strict=False):  # SGD used exactly those clipped grads
        torch.testing.assert_close(w.detach(), b - 0.1 * w.grad)


@pytest.mark.gpu
def test_fp16_scaler_state_round_trips():
    model, opt, p = _fp16_setup(init_scale=2.0**8)
    with p.autocast():
        loss = model(torch.randn(4, 16, device="cuda")).float().sum()
    p.backward(loss)
    p.step(opt)
    state = p.state_dict()
    assert state["scale"] == p.scaler.get_scale()
    fresh = Precision("fp16", "cuda")
    fresh.load_state_dict(state)
    assert fresh.scaler.get_scale() == p.scaler.get_scale()
