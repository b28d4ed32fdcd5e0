"""Exactness of dlenv.model.checkpointing.apply_checkpointing on every torchvision classification family.

Each test trains one step of the same model (same weights, input and seed) without and with
checkpointing and compares outputs, gradients and every buffer (BatchNorm running statistics and
num_batches_tracked). Dropout and stochastic depth are on (train mode), so the recompute must draw
the same masks. The negative controls at the end show that these comparisons do catch a recompute
that updates BatchNorm twice or draws new dropout masks.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from ckptcompare import assert_same, compare_plain_and_checkpointed
from torch import nn

from dlenv.model import checkpointing, models
from dlenv.model.checkpointing import apply_checkpointing, find_blocks, is_checkpointed
from dlenv.model.models import build_model

# name -> (builder kwargs, image size): the smallest input each family takes, randomness turned up.
FAMILIES = {
    "resnet18": ({}, 32),
    "resnext50_32x4d": ({}, 32),
    "wide_resnet50_2": ({}, 32),
    "densenet121": ({"drop_rate": 0.3}, 32),
    "mobilenet_v2": ({}, 32),
    "mobilenet_v3_small": ({}, 32),
    "efficientnet_b0": ({"stochastic_depth_prob": 0.5}, 32),
    "efficientnet_v2_s": ({"stochastic_depth_prob": 0.5}, 32),
    "convnext_tiny": ({"stochastic_depth_prob": 0.5}, 32),
    "regnet_y_400mf": ({}, 32),
    "regnet_x_400mf": ({}, 32),
    "vit_b_16": ({"image_size": 32, "dropout": 0.2, "attention_dropout": 0.2}, 32),
    "swin_t": ({}, 32),
    "swin_v2_t": ({}, 32),
    "maxvit_t": ({}, 224),
    "shufflenet_v2_x0_5": ({}, 32),
    "mnasnet0_5": ({}, 32),
    "squeezenet1_1": ({}, 32),
    "googlenet": ({"dropout": 0.5}, 32),
    "inception_v3": ({"dropout": 0.5}, 75),
}
# slow: more than ~5 s each on 2 CPU cores (`dlenv test` leaves them to --full; CI runs them)
SLOW = {"wide_resnet50_2", "vit_b_16", "maxvit_t", "densenet121", "efficientnet_v2_s", "inception_v3", "convnext_tiny",
        "swin_v2_t", "swin_t", "resnext50_32x4d", "googlenet", "regnet_y_400mf", "mnasnet0_5"}


def _data(size, batch=2, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in FAMILIES])
def test_exact_on_every_family(name):
    kwargs, size = FAMILIES[name]
    torch.manual_seed(0)
    model = build_model(name, num_classes=5, **kwargs)
    plain, ckpt, n = compare_plain_and_checkpointed(model, [_data(size)])
    assert n > 0, f"no repeated blocks found in {name}"
    assert n == len(find_blocks(model))
    assert_same(plain, ckpt)


@pytest.mark.parametrize("name", ["alexnet", "vgg11", "vgg11_bn"])
def test_models_without_repeated_blocks_report_zero(name):
    model = build_model(name, num_classes=3)
    assert apply_checkpointing(model) == 0
    assert not any(is_checkpointed(m) for m in model.modules())


def test_the_whole_classification_list_is_covered():
    """Every torchvision classification model has repeated blocks we know, except AlexNet and VGG."""
    names = models.list_model_names()
    plain_families = ("alexnet", "vgg")
    known = checkpointing._block_classes()
    from torchvision import models as tvm

    for name in names:
        if name.startswith(plain_families):
            continue
        # Building all 80 would take minutes; the builder's module must define a block class we know.
        family = tvm.get_model_builder(name).__module__
        assert any(cls.__module__ == family for cls in known), f"{name}: no known block class in {family}"


@pytest.mark.slow
def test_gradient_accumulation_is_exact():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=5)
    batches = [_data(32, seed=1), _data(32, seed=2), _data(32, seed=3)]
    plain, ckpt, _ = compare_plain_and_checkpointed(model, batches)
    assert_same(plain, ckpt)
    # three micro-batches, three BatchNorm updates, not six
    assert int(model.bn1.num_batches_tracked) == 3
    assert int(model.layer1[0].bn1.num_batches_tracked) == 3


def test_cpu_bf16_autocast_recomputes_in_bf16():
    """PyTorch 1.13's checkpoint ignores CPU autocast in the recompute; ours re-enters it."""
    from dlenv.engine.precision import Precision

    torch.manual_seed(0)
    model = build_model("efficientnet_b0", num_classes=5, stochastic_depth_prob=0.5)
    plain, ckpt, _ = compare_plain_and_checkpointed(model, [_data(32)], precision=Precision("bf16", "cpu"))
    assert plain[0][0].dtype == torch.bfloat16
    assert_same(plain, ckpt, exact_grads=False)


def test_partial_ratio_checkpoints_the_first_blocks_and_stays_exact():
    torch.manual_seed(0)
    model = build_model("mobilenet_v2", num_classes=5)
    blocks = find_blocks(model)
    plain, ckpt, n = compare_plain_and_checkpointed(model, [_data(32)], ratio=0.3)
    assert n == round(0.3 * len(blocks))
    assert [is_checkpointed(b) for b in blocks] == [True] * n + [False] * (len(blocks) - n)
    assert_same(plain, ckpt)


def test_idempotent_and_ratio_can_be_changed():
    model = build_model("resnet18", num_classes=3)
    n = apply_checkpointing(model)
    assert apply_checkpointing(model) == n == 8
    block = model.layer1[0]
    # the stand-in wraps the class's forward, never another stand-in
    assert not isinstance(block.forward.forward, checkpointing._CheckpointedForward)
    assert apply_checkpointing(model, 0.5) == 4
    assert [is_checkpointed(b) for b in find_blocks(model)] == [True] * 4 + [False] * 4
    assert apply_checkpointing(model, 0.0) == 0
    assert not any(is_checkpointed(m) for m in model.modules())
    with pytest.raises(ValueError, match="1.5"):
        apply_checkpointing(model, 1.5)


def test_state_dict_keys_unchanged_and_interchangeable():
    plain = build_model("densenet121", num_classes=3)
    wrapped = build_model("densenet121", num_classes=3)
    keys = list(wrapped.state_dict())
    apply_checkpointing(wrapped)
    assert list(wrapped.state_dict()) == keys
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    plain.load_state_dict(wrapped.state_dict())  # strict: a checkpoint loads into a plain model
    wrapped.load_state_dict(plain.state_dict())


def test_eval_and_no_grad_run_the_block_directly(monkeypatch):
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=3).eval()
    x, _ = _data(32)
    with torch.no_grad():
        expected = model(x)
    apply_checkpointing(model)

    def refuse(*args):
        raise AssertionError("checkpoint used without gradients")

    monkeypatch.setattr(checkpointing.compat, "checkpoint", refuse)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


@pytest.mark.slow
def test_eval_mode_with_gradients_is_exact():
    """Fine-tuning with frozen BatchNorm statistics: eval mode, but gradients wanted."""
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=5)
    x, y = _data(32)
    start = copy.deepcopy(model.state_dict())
    model.eval()
    results = []
    for ratio in (0.0, 1.0):
        model.load_state_dict(start)
        model.zero_grad(set_to_none=True)
        apply_checkpointing(model, ratio)
        F.cross_entropy(model(x), y).backward()
        results.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_deepcopy_for_ema_follows_the_copy():
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=3)
    apply_checkpointing(model)
    twin = copy.deepcopy(model)
    assert twin.layer1[0].forward.module is twin.layer1[0]
    x, y = _data(32, classes=3)
    F.cross_entropy(twin.train()(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.parameters())


def test_pickled_model_keeps_working():
    torch.manual_seed(0)
    model = build_model("squeezenet1_1", num_classes=3).eval()
    apply_checkpointing(model)
    x, _ = _data(32)
    buf = io.BytesIO()
    pickle.dump(model, buf)
    clone = pickle.loads(buf.getvalue())
    assert is_checkpointed(clone.features[3]) and clone.features[3].forward.module is clone.features[3]
    with torch.no_grad():
        assert torch.equal(clone(x), model(x))


# ---------------------------------------------------------------------------------------------------
# Models of users' own, and the hard cases: in-place ops, cumulative BatchNorm, keyword inputs.


class _Block(nn.Module):
    def __init__(self, width, leading_op=None, momentum=0.1):
        super().__init__()
        self.leading_op = leading_op
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width, momentum=momentum)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, scale=None):
        if self.leading_op == "relu_":
            x = x.relu_()  # writes into the block's input
        elif self.leading_op == "mul_":
            x = x.mul_(2.0)  # not idempotent: a recompute from the written input would be wrong
        out = self.drop(self.act(self.bn(self.fc(x)))) + x
        return out * scale if scale is not None else out


class _Net(nn.Module):
    def __init__(self, leading_op=None, momentum=0.1, scale=False):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([_Block(8, leading_op, momentum) for _ in range(3)])
        self.head = nn.Linear(8, 3)
        self.scale = scale

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x, scale=torch.full((1,), 0.5) if self.scale else None)
        return self.head(x)


@pytest.mark.parametrize("kw", [{}, {"leading_op": "relu_"}, {"leading_op": "mul_"},
                                {"momentum": None}, {"scale": True}],
                         ids=["plain", "inplace-relu-on-input", "inplace-mul-on-input",
                              "cumulative-bn", "keyword-tensor"])
def test_users_own_model_with_repeated_blocks(kw):
    torch.manual_seed(0)
    model = _Net(**kw)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)]
    plain, ckpt, n = compare_plain_and_checkpointed(model, batches)
    assert n == 3
    assert_same(plain, ckpt)


def test_generic_search_skips_torch_nn_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert apply_checkpointing(model) == 0


# ---------------------------------------------------------------------------------------------------
# Negative controls: the comparisons above fail for a checkpoint that is not exact.


def test_control_bn_updated_twice_is_caught(monkeypatch):
    monkeypatch.setattr(checkpointing, "_is_norm_with_stats", lambda m: False)  # no buffer protection
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=5)
    plain, ckpt, _ = compare_plain_and_checkpointed(model, [_data(32)])
    assert int(model.layer1[0].bn1.num_batches_tracked) == 2
    with pytest.raises(AssertionError, match="buffer"):
        assert_same(plain, ckpt)


@pytest.mark.slow
def test_control_new_dropout_masks_are_caught(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(checkpointing.compat, "checkpoint", lambda fn, *a: checkpoint(
        fn, *a, use_reentrant=False, preserve_rng_state=False))
    torch.manual_seed(0)
    model = build_model("convnext_tiny", num_classes=5, stochastic_depth_prob=0.5)
    plain, ckpt, _ = compare_plain_and_checkpointed(model, [_data(32)])
    with pytest.raises(AssertionError):
        assert_same(plain, ckpt)
