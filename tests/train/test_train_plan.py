"""dlenv.train.plan: the trainer's plan is decisions only. It is built on a CPU without building the model
the run trains or reading a batch of data, prints nothing, leaves the run's random streams alone, is
frozen, and its re-plan after CUDA out of memory (`halved`) keeps the images per optimizer step.

What a decision must measure is allowed and said per case: image headers for --img-size auto, the
model's structure for --checkpoint (a copy built without weights on the meta device where PyTorch has
one), real steps for --amp on a CPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dlenv import compat
from dlenv.cluster import distributed
from dlenv.train import plan

CPU = torch.device("cpu")


def _forbid(monkeypatch, target, name: str, calls: list) -> None:
    def refused(*a, **k):
        calls.append(name)
        raise AssertionError(f"the plan called {name}")

    monkeypatch.setattr(target, name, refused)


@pytest.fixture
def watched(monkeypatch):
    """Every way the trainer builds a model or reads a batch, refused and counted; the header reader and
    the model factory only counted (cases that must measure use them)."""
    import dlenv.data.decode
    import dlenv.data.imagesize
    import dlenv.data.loaders
    import dlenv.data.pipeline
    import dlenv.model.models

    calls: list = []
    _forbid(monkeypatch, dlenv.data.pipeline, "build", calls)
    _forbid(monkeypatch, dlenv.data.pipeline, "make_loaders", calls)
    _forbid(monkeypatch, dlenv.data.loaders, "build_loaders", calls)
    _forbid(monkeypatch, dlenv.data.decode, "decode_stored", calls)
    headers = dlenv.data.imagesize.typical_side
    monkeypatch.setattr(dlenv.data.imagesize, "typical_side",
                        lambda *a, **k: calls.append("headers") or headers(*a, **k))

    def build(name, num_classes, weights=None, **kw):  # the structure's copy: never with weights
        calls.append(("model", weights, torch.empty(0).device.type))  # where tensors are made: meta or cpu
        return _Blocks(num_classes)

    monkeypatch.setattr(dlenv.model.models, "build_model", build)
    return calls


class _Blocks(torch.nn.Module):
    """Two repeated blocks of the model's own class and a head: what --checkpoint counts."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.blocks = torch.nn.Sequential(_Block(), _Block())
        self.fc = torch.nn.Linear(3, num_classes)

    def forward(self, x):
        return self.fc(self.blocks(x).mean((2, 3)))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def _dist():
    return distributed.DistInfo()  # one process: rank 0 of 1


@pytest.mark.parametrize("given,measured", [
    ({}, []),                                                   # every decision from the options
    ({"synthetic": True}, []),                                  # no folder at all
    ({"img_size": None}, ["headers"]),                          # --img-size auto reads headers, no pixels
    ({"checkpoint": True}, [("model", None, "meta")]),          # blocks counted on a copy without weights
    ({"optimizer": "auto", "accum_steps": 2, "lr": 0.01}, []),
])
def test_the_plan_builds_nothing_and_prints_nothing(tmp_path, data, watched, capsys, given, measured):
    from imagedata import train_config

    cfg = train_config(tmp_path, data, model="tiny", **given)
    rng = torch.get_rng_state()
    decided = plan.decide(cfg, None, _dist(), CPU)
    # PyTorch 1.13 has no meta device: there the structure's copy is built on the CPU, still without weights
    where = "meta" if compat.TORCH_VERSION >= (2, 0) else "cpu"
    assert watched == [(m[0], m[1], where) if isinstance(m, tuple) else m for m in measured]
    assert capsys.readouterr().out == ""  # what a user should see is in the plan, printed by the trainer
    assert torch.equal(torch.get_rng_state(), rng)  # the run's stream is the seed's
    with pytest.raises(dataclasses.FrozenInstanceError):
        decided.batch = None
    assert decided.config.model == "tiny"
    assert decided.micro_batch * decided.accum_steps == cfg.batch_size * cfg.accum_steps
    if not cfg.synthetic:
        assert decided.batches_per_epoch == math.ceil(16 / cfg.batch_size)  # 16 training images
    assert decided.optimizer.total_steps == decided.epochs * decided.steps_per_epoch
    # decided again from the same options: the same plan, as config.yaml records it
    again = plan.decide(cfg, None, _dist(), CPU)
    assert again.options() == decided.options() and again.said == decided.said


def test_the_plan_fills_auto_options_and_says_so_for_the_trainer(tmp_path, data, watched, capsys):
    from imagedata import train_config

    decided = plan.decide(train_config(tmp_path, data, model="auto", epochs=None, img_size=None), None, _dist(), CPU)
    assert capsys.readouterr().out == ""
    # small images on a CPU take the demo's recipe: decided in the plan, recorded, and said by the trainer
    assert decided.config.model == "small_cnn" and decided.options()["model"] == "small_cnn"
    assert any(line.startswith("no GPU: images this small") for line in decided.said)
    assert any(line.startswith("--img-size auto: 16 px") for line in decided.said)


def test_dev_shm_holding_the_workers_back_is_said_with_the_plan_and_recorded(tmp_path, data, watched, capsys,
                                                                            monkeypatch):
    """The workers rule speaks through the plan's said lines (once, printed by the trainer), not a log line."""
    from collections import namedtuple

    from imagedata import train_config

    import dlenv.data.workers

    usage = namedtuple("Usage", "total used free")(256 << 10, 0, 256 << 10)  # 256 KiB of /dev/shm
    monkeypatch.setattr(dlenv.data.workers.shutil, "disk_usage", lambda path: usage)
    decided = plan.decide(train_config(tmp_path, data, model="tiny", workers=8), None, _dist(), CPU)
    assert capsys.readouterr().out == ""
    said = [line for line in decided.said if "/dev/shm" in line]
    assert len(said) == 1 and "too little for --workers 8" in said[0] and decided.input.workers < 8
    assert decided.notes(CPU)["workers_rule"] == said[0]
    assert decided.options()["workers"] == decided.input.workers


@pytest.mark.parametrize("micro,accum,retry,halves", [
    (8, 1, True, True), (8, 2, True, True), (4, 1, True, True),
    (6, 1, True, True), (7, 1, True, False), (2, 1, True, False),  # odd, or pieces of one: no exact halving
    (8, 1, False, False),                                         # a number given: an OOM stops the run
])
def test_halved_keeps_the_images_per_step_and_the_steps_per_epoch(tmp_path, data, watched, micro, accum, retry,
                                                                   halves):
    from imagedata import train_config

    decided = plan.decide(train_config(tmp_path, data, model="tiny", batch_size=micro, accum_steps=accum), None,
                          _dist(), CPU)
    decided = dataclasses.replace(decided, oom_retry=retry)
    assert decided.halves == halves
    if not halves:
        return
    half = decided.halved(plan.per_rank(decided.data, micro // 2))
    assert (half.micro_batch, half.accum_steps, half.input.batch_size) == (micro // 2, accum * 2, micro // 2)
    assert half.effective_batch == decided.effective_batch and half.steps_per_epoch == decided.steps_per_epoch
    assert half.options()["batch_size"] == micro // 2 and half.options()["accum_steps"] == accum * 2
    assert "CUDA ran out of memory at micro-batch" in half.notes(CPU)["batch_rule"]

