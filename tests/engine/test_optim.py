"""Optimizer groups, the warmup-cosine schedule, default learning rates and the weight EMA."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from dlenv.engine import optim


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.pos_embedding = nn.Parameter(torch.zeros(1, 3, 4))


def test_no_weight_decay_on_norms_biases_and_embeddings():
    net = Net()
    groups = optim.param_groups(net, 0.05)
    names = {id(p): n for n, p in net.named_parameters()}
    decayed = {names[id(p)] for g in groups if g["weight_decay"] for p in g["params"]}
    plain = {names[id(p)] for g in groups if not g["weight_decay"] for p in g["params"]}
    assert decayed == {"conv.weight", "fc.weight"}
    assert plain == {"conv.bias", "bn.weight", "bn.bias", "fc.bias", "pos_embedding"}


def test_build_optimizer_kinds():
    sgd = optim.build_optimizer(Net(), "sgd", 0.1, 1e-4, momentum=0.9, nesterov=True)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["nesterov"]
    assert isinstance(optim.build_optimizer(Net(), "adamw", 1e-3, 0.05), torch.optim.AdamW)
    with pytest.raises(ValueError, match="lion"):
        optim.build_optimizer(Net(), "lion", 1e-3, 0.0)


def test_default_lr_sgd_linear_scaling_adamw_fixed():
    assert optim.default_lr("sgd", 256) == pytest.approx(0.1)
    assert optim.default_lr("sgd", 64) == pytest.approx(0.025)
    assert optim.default_lr("adamw", 1024) == optim.default_lr("adamw", 32) == pytest.approx(1e-3)
    assert optim.default_weight_decay("adamw") == 0.05


def _lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cpu_optimizers_keep_torchs_default_kernels():
    for name in ("sgd", "adamw"):
        group = optim.build_optimizer(Net(), name, 1e-3, 0.0).param_groups[0]
        assert not group.get("fused") and not group.get("foreach")


def test_kernel_choice_for_cuda_params_is_one_this_torch_accepts():
    from dlenv import compat

    for cls in (torch.optim.SGD, torch.optim.AdamW):
        kw = compat.optimizer_kernels(cls, on_cuda=True)
        assert len(kw) == 1 and set(kw) <= {"fused", "foreach"} and all(kw.values())
        assert set(kw) <= set(inspect.signature(cls).parameters)
    assert compat.optimizer_kernels(torch.optim.AdamW, on_cuda=False) == {}
    fused = compat.optimizer_kernels(torch.optim.AdamW, on_cuda=True) == {"fused": True}
    assert fused == (compat.TORCH_VERSION >= (2, 0))


def test_resume_keeps_this_runs_kernels_and_restores_the_state():
    """A checkpoint from a GPU run (fused AdamW) resumes on the CPU with the CPU's kernels, and the
    moments and step count come back."""
    torch.manual_seed(0)
    saved_net = Net()
    saved = optim.build_optimizer(saved_net, "adamw", 1e-3, 0.05)
    for p in saved_net.parameters():
        p.grad = torch.randn_like(p)
    saved.step()
    state = saved.state_dict()
    for g in state["param_groups"]:
        g["fused"] = True  # as a CUDA run on PyTorch 2.x saves it
    net = Net()
    opt = optim.build_optimizer(net, "adamw", 1e-3, 0.05)
    optim.load_optimizer_state(opt, state)
    assert all(not g.get("fused") for g in opt.param_groups)
    first = next(iter(saved_net.parameters()))
    loaded = opt.state[next(iter(net.parameters()))]
    assert torch.equal(loaded["exp_avg"], saved.state[first]["exp_avg"])
    assert float(loaded["step"]) == 1.0
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # runs with the CPU's kernels
    assert float(opt.state[next(iter(net.parameters()))]["step"]) == 2.0


def test_every_optimizer_of_the_one_list_is_an_option_with_defaults_and_builds():
    from dlenv.options.config import OPTIMIZERS, TrainConfig, build

    assert build(TrainConfig, optimizer=OPTIMIZERS[-1]).optimizer == OPTIMIZERS[-1]
    for name in OPTIMIZERS:  # a name added to the list fails here until engine/optim.py gives it all of these
        assert optim.default_lr(name, 256) > 0 and optim.default_weight_decay(name) >= 0
        assert optim.resolve_optimizer(name, 10) == name
        built, probed = optim.build_optimizer(Net(), name, 0.1, 1e-4), optim.probe_optimizer(Net().parameters(), name)
        assert type(built) is type(probed) and type(built).__name__.lower() == name
    assert {optim.resolve_optimizer("auto", n) for n in (1, 10**6)} <= set(OPTIMIZERS)
    with pytest.raises(ValueError, match="'lion' is not sgd or adamw"):
        optim.probe_optimizer(Net().parameters(), "lion")


def test_auto_optimizer_is_adamw_for_short_runs_sgd_for_long():
    assert optim.resolve_optimizer("auto", optim.AUTO_SGD_FROM_STEPS - 1) == "adamw"
    assert optim.resolve_optimizer("auto", optim.AUTO_SGD_FROM_STEPS) == "sgd"
    assert optim.resolve_optimizer("sgd", 10) == "sgd"
    assert optim.resolve_optimizer("adamw", 10**6) == "adamw"


def test_warmup_then_cosine_by_optimizer_step():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = optim.warmup_cosine(opt, warmup_steps=4, total_steps=14)
    lrs = _lrs(sched, opt, 15)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[4:13], lrs[5:14], strict=True))  # strictly decreasing after warmup
    assert lrs[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert lrs[14] == pytest.approx(0.0, abs=1e-12)


def test_schedule_state_dict_resumes_the_same_sequence():
    def make():
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.4)
        return opt, optim.warmup_cosine(opt, 3, 20)

    opt, sched = make()
    first = _lrs(sched, opt, 7)
    rest = _lrs(sched, opt, 5)
    opt2, sched2 = make()
    _lrs(sched2, opt2, 7)
    state = sched2.state_dict()
    opt3, sched3 = make()
    sched3.load_state_dict(state)
    opt3.param_groups[0]["lr"] = opt2.param_groups[0]["lr"]
    assert _lrs(sched3, opt3, 5) == pytest.approx(rest)
    assert len(first) == 7


def test_ema_averages_floats_copies_ints_and_round_trips():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = optim.ModelEma(net, decay=0.5)
    assert not any(p.requires_grad for p in ema.module.parameters())
    w0 = net[0].weight.detach().clone()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    net[1].num_batches_tracked.fill_(7)
    ema.update(net)  # decay min(0.5, 2/11)
    d = 2 / 11
    torch.testing.assert_close(ema.module[0].weight, d * w0 + (1 - d) * (w0 + 1))
    assert int(ema.module[1].num_batches_tracked) == 7
    other = optim.ModelEma(net, decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and torch.equal(other.module[0].weight, ema.module[0].weight)
    for _ in range(50):
        ema.update(net)
    torch.testing.assert_close(ema.module[0].weight, net[0].weight, atol=1e-6, rtol=0)
