"""No batch of one image reaches a model in train mode (BatchNorm cannot normalise one sample).

A share that would end in a one-sample batch (80 images, batch 79) is one index shorter in
dlenv.data.sampler; an OOM re-plan never halves a micro-batch into ones either (TrainPlan.halves,
tests/train/test_train_plan.py). The epoch arithmetic, the resume position and the DDP shares follow.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from imagedata import make_train_val, train_config
from torch import nn

from dlenv import train as train_mod
from dlenv.data.sampler import ResumableSampler
from dlenv.files import runstate


class Recorder(nn.Module):
    """A tiny model whose BatchNorm1d raises on one sample in train mode (as torchvision's heads do)."""

    sizes: list[int] = []

    def __init__(self, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        if self.training:
            Recorder.sizes.append(x.shape[0])
        return self.fc(self.bn(torch.relu(self.conv(x)).mean((2, 3))))


@pytest.fixture
def recorder(monkeypatch):
    import dlenv.model.models

    Recorder.sizes = []
    monkeypatch.setattr(dlenv.model.models, "build_model", lambda name, num_classes, **kw: Recorder(num_classes))
    return Recorder.sizes


@pytest.fixture(scope="module")
def ds80(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds80")
    make_train_val(root, per_class=40)
    return root


@pytest.fixture(scope="module")
def ds81(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds81")
    make_train_val(root, per_class=27, classes=("a", "b", "c"))
    return root


def cfg(tmp_path, ds, **kw):
    return train_config(tmp_path, ds, **{"batch_size": 79, "model": "tiny", "optimizer": "sgd", **kw})


@pytest.mark.parametrize("opts,batches", [
    (dict(), [79, 79]),                                   # classic DataLoader path
    (dict(gpu_augment="on", cache="off"), [79, 79]),                # fast path (DeviceLoader) on the CPU
    (dict(batch_size=13, accum_steps=2), ([13] * 6 + [2]) * 2),  # 80 = 6 x 13 + 2: all kept
    (dict(accum_steps=2, epochs=1), [79]),                # a window of one batch, the 80th left out
])
def test_no_one_image_batch_and_the_epoch_arithmetic_follows(tmp_path, ds80, recorder, opts, batches):
    summary = train_mod.train(cfg(tmp_path, ds80, **opts))
    assert summary["exit_code"] == 0
    assert recorder == batches and min(recorder) > 1
    per_epoch = len(batches) // summary["epochs"]
    assert summary["step"] == summary["epochs"] * -(-per_epoch // opts.get("accum_steps", 1))
    last = runstate.load_state(Path(summary["run_dir"]) / "last.pth")
    assert last["batch_in_epoch"] == 0 and last["sampler"]["position"] == 0


@pytest.mark.parametrize("gpu_augment", ["off", "on"])
def test_resume_mid_epoch_with_a_left_out_sample_is_exact(tmp_path, ds81, recorder, gpu_augment):
    """81 images in batches of 4: 20 per epoch (one left out); stopped after 10, resumed: the same weights."""
    opts = dict(batch_size=4, epochs=1, gpu_augment=gpu_augment)
    full = train_mod.train(cfg(tmp_path / "a", ds81, **opts))

    def on_step(state):
        if state.step == 10:
            signal.raise_signal(signal.SIGTERM)

    part = train_mod.train(cfg(tmp_path / "b", ds81, **opts), on_step=on_step)
    assert part["exit_code"] == 143
    saved = runstate.load_state(Path(part["run_dir"]) / "last.pth")
    assert saved["sampler"]["position"] == 40
    recorder.clear()
    resumed = train_mod.train(cfg(tmp_path / "c", ds81, resume=str(Path(part["run_dir"]) / "last.pth")))
    assert recorder == [4] * 10 and resumed["step"] == 20
    a = runstate.load_state(Path(full["run_dir"]) / "last.pth")["model"]
    b = runstate.load_state(Path(resumed["run_dir"]) / "last.pth")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n,world,batch,per_rank", [
    (80, 1, 79, 79),    # the lone 80th is left out
    (80, 1, 80, 80),
    (80, 1, 40, 80),
    (80, 1, 1, 80),     # batch 1 is every batch: nothing to fix here
    (1, 1, 4, 1),       # a single image stays (nothing to train on otherwise)
    (161, 2, 80, 80),   # ranks get ceil(161/2) = 81 -> 80 each, the same number on every rank
    (9, 3, 2, 2),       # 3 each: 2 + 1 -> 2 each
    (10, 3, 2, 4),      # 4 each: 2 + 2
    (11, 2, 5, 5),      # 6 each: 5 + 1 -> 5 each
])
def test_rank_shares_never_end_in_a_batch_of_one(n, world, batch, per_rank):
    ranks = [ResumableSampler(n, seed=2, rank=r, world_size=world, batch_size=batch) for r in range(world)]
    for s in ranks:
        s.set_epoch(3)
    assert [s.per_rank for s in ranks] == [per_rank] * world
    assert all(len(list(s)) == per_rank for s in ranks)
    if per_rank * world <= n:  # no padding: the ranks' indices are distinct
        seen = [i for s in ranks for i in s]
        assert len(set(seen)) == len(seen)
