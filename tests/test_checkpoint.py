"""Checkpoints: atomic writes, safe loading, exact floats on both PyTorch lines, RNG state."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dlenv import checkpoint
from dlenv.errors import UserError


def test_save_is_atomic_when_the_write_crashes(tmp_path, monkeypatch):
    path = tmp_path / "last.pth"
    checkpoint.save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj, fh, *a, **k):
        fh.write(b"PK\x03\x04 half a file")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint({"epoch": 2, "w": torch.zeros(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert checkpoint.load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]  # no temp file left behind


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickles_that_run_code_are_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": Evil(marker)}, tmp_path / "evil.pth")
    with pytest.raises(UserError, match="refusing to load"):
        checkpoint.load_checkpoint(tmp_path / "evil.pth")
    assert not marker.exists()


def test_missing_and_truncated_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        checkpoint.load_checkpoint(tmp_path / "nope.pth")
    good = tmp_path / "good.pth"
    checkpoint.save_checkpoint({"w": torch.randn(1000)}, good)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(good.read_bytes()[:-300])
    with pytest.raises(UserError, match="truncated or corrupt"):
        checkpoint.load_checkpoint(cut)


def test_floats_and_state_dicts_round_trip_exactly(tmp_path):
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    state = {"lr": 0.1, "vals": [1.5, -0.0, math.inf, (2.25, 3)], "model": net.state_dict(),
             "optimizer": opt.state_dict(), "none": None, "flag": True}
    path = checkpoint.save_checkpoint(state, tmp_path / "c.pth")
    raw = torch.load(path, weights_only=True)  # what any loader of either PyTorch line sees
    assert not isinstance(raw["lr"], float)  # floats are encoded for 1.13's weights_only loader
    back = checkpoint.load_checkpoint(path)
    assert back["lr"] == 0.1 and back["vals"][:3] == [1.5, 0.0, math.inf]
    assert math.copysign(1, back["vals"][1]) == -1 and back["vals"][3] == (2.25, 3)
    assert back["optimizer"]["param_groups"][0]["weight_decay"] == 1e-4
    fresh = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    fresh.load_state_dict(back["model"])  # strict
    assert isinstance(back["model"], OrderedDict) and state["lr"] == 0.1  # the input was not changed


def test_nan_survives(tmp_path):
    back = checkpoint.load_checkpoint(checkpoint.save_checkpoint({"x": math.nan}, tmp_path / "n.pth"))
    assert math.isnan(back["x"])


def test_rng_state_restores_every_generator(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    path = checkpoint.save_checkpoint({"rng": checkpoint.rng_state()}, tmp_path / "r.pth")
    first = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(checkpoint.load_checkpoint(path)["rng"])
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


def test_environment_is_plain_strings():
    env = checkpoint.environment()
    assert type(env["torch"]) is str and type(env["dlenv"]) is str


def test_bare_googlenet_state_dict_with_aux_heads_loads(tmp_path):
    # torchvision saves googlenet with its auxiliary heads; dlenv builds it without them
    import torchvision

    from dlenv.checkpoint import model_from_checkpoint

    theirs = torchvision.models.googlenet(weights=None, num_classes=3, aux_logits=True, init_weights=False)
    sd = {f"module.{k}": v for k, v in theirs.state_dict().items()}  # as saved from DDP
    model, classes, _ = model_from_checkpoint(sd, "googlenet")
    assert classes == ["0", "1", "2"]
    assert torch.equal(model.state_dict()["fc.weight"], theirs.state_dict()["fc.weight"])
