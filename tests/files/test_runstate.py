"""dlenv.files.runstate, the run-state files: atomic writes, safe loading, exact floats on both PyTorch
lines, RNG state."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from imagedata import FillsUpAfter
from torch import nn

from dlenv.errors import UserError
from dlenv.files import runstate
from dlenv.model import statedict


def test_save_is_atomic_when_the_write_crashes(tmp_path, monkeypatch):
    path = tmp_path / "last.pth"
    runstate.save_state({"epoch": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj, fh, *a, **k):
        fh.write(b"PK\x03\x04 half a file")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        runstate.save_state({"epoch": 2, "w": torch.zeros(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert runstate.load_state(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pth"]  # no temp file left behind, no sidecar


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickles_that_run_code_are_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": Evil(marker)}, tmp_path / "evil.pth")
    with pytest.raises(UserError, match="refusing to unpickle"):
        runstate.load_state(tmp_path / "evil.pth")
    assert not marker.exists()


def test_missing_and_truncated_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        runstate.load_state(tmp_path / "nope.pth")
    good = tmp_path / "good.pth"
    runstate.save_state({"w": torch.randn(1000)}, good)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(good.read_bytes()[:-300])
    with pytest.raises(UserError, match="truncated or corrupt"):
        runstate.load_state(cut)


def test_floats_and_state_dicts_round_trip_exactly(tmp_path):
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    state = {"lr": 0.1, "vals": [1.5, -0.0, math.inf, (2.25, 3)], "model": net.state_dict(),
             "optimizer": opt.state_dict(), "none": None, "flag": True}
    path = runstate.save_state(state, tmp_path / "c.pth")
    raw = torch.load(path, weights_only=True)  # what any loader of either PyTorch line sees
    assert not isinstance(raw["lr"], float)  # floats are encoded for 1.13's weights_only loader
    back = runstate.load_state(path)
    assert back["lr"] == 0.1 and back["vals"][:3] == [1.5, 0.0, math.inf]
    assert math.copysign(1, back["vals"][1]) == -1 and back["vals"][3] == (2.25, 3)
    assert back["optimizer"]["param_groups"][0]["weight_decay"] == 1e-4
    fresh = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    fresh.load_state_dict(back["model"])  # strict
    assert isinstance(back["model"], OrderedDict) and state["lr"] == 0.1  # the input was not changed


def test_nan_survives(tmp_path):
    back = runstate.load_state(runstate.save_state({"x": math.nan}, tmp_path / "n.pth"))
    assert math.isnan(back["x"])


def test_rng_state_restores_every_generator(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    path = runstate.save_state({"rng": runstate.rng_state()}, tmp_path / "r.pth")
    first = (torch.rand(3), random.random(), np.random.rand())
    runstate.set_rng_state(runstate.load_state(path)["rng"])
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]


def test_environment_is_plain_strings():
    env = runstate.environment()
    assert type(env["torch"]) is str and type(env["dlenv"]) is str


# ---------------------------------------------------------------------------------------------------
# A full disk mid-write, wrong files, entries of the wrong type.




@pytest.mark.parametrize("limit", [0, 100, 64 * 1024], ids=["at-once", "in-the-header", "mid-tensors"])
def test_full_disk_mid_write_raises_oserror_naming_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, limit):
    from dlenv.files import atomic

    path = tmp_path / "last.pth"
    runstate.save_state({"epoch": 1, "w": torch.ones(3)}, path)
    real_open = open
    with monkeypatch.context() as m:  # the one atomic writer opens the temporary file
        m.setattr(atomic, "open", lambda f, mode="r", *a, **kw: (  # writes only: atomic also reads the umask
            FillsUpAfter(real_open(f, mode, *a, **kw), limit) if "w" in mode else real_open(f, mode, *a, **kw)),
                  raising=False)
        with pytest.raises(OSError) as e:  # not torch's RuntimeError, and the process is still alive
            runstate.save_state({"epoch": 2, "w": torch.zeros(300_000)}, path)
    assert e.value.errno == 28 and e.value.filename == str(path)
    assert runstate.load_state(path)["epoch"] == 1  # its MAC sidecar still matches it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pth"]


def _wrong_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    import zipfile

    (tmp / "results.csv").write_text("epoch,train_loss\n1,0.5\n")
    (tmp / "notes.txt").write_text("hello\n")
    (tmp / "cfg.yaml").write_text("lr: 0.1\n")
    (tmp / "empty.pth").write_bytes(b"")
    (tmp / "folder").mkdir()
    with zipfile.ZipFile(tmp / "a.zip", "w") as zf:
        zf.writestr("a.txt", "x")
    (tmp / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    return {"results.csv": (tmp / "results.csv", "is a results.csv"),
            "text": (tmp / "notes.txt", "is a text file (it starts 'hello')"),
            "yaml": (tmp / "cfg.yaml", "is a text file (it starts 'lr: 0.1')"),
            "empty": (tmp / "empty.pth", "is an empty file (0 bytes)"),
            "folder": (tmp / "folder", "is a folder, not a PyTorch weights file; pass the .pth file inside it"),
            "zip": (tmp / "a.zip", "is a zip archive of 1 file(s) (a.txt)"),
            "binary": (tmp / "image.png", "is another kind of file (it starts with bytes 89 50 4e 47)")}


@pytest.mark.parametrize("kind", ["results.csv", "text", "yaml", "empty", "folder", "zip", "binary"])
def test_a_wrong_file_is_named_for_what_it_is(tmp_path, kind):
    path, what = _wrong_files(tmp_path)[kind]
    with pytest.raises(UserError) as e:
        runstate.load_state(path)
    assert str(e.value).startswith(f"{path} {what}") and "\n" not in str(e.value)


def _dlenv(**change):
    state = {"format": runstate.FORMAT, "model": {"fc.weight": torch.zeros(2, 4), "fc.bias": torch.zeros(2)},
             "model_name": "resnet18", "num_classes": 2, "class_names": ["a", "b"], "img_size": 32,
             "epoch": 1, "step": 3, "batch_in_epoch": 0, "world_size": 1, "best_metric": 50.0,
             "config": {"lr": 0.1, "img_size": 32}, "train_state": {"micro_batch": 4, "accum_steps": 1}}
    state.update(change)
    return state


@pytest.mark.parametrize(("change", "message"), [
    ({"img_size": "abc"}, "its 'img_size' is 'abc', not an image size of 16 to 2048 pixels"),
    ({"img_size": 100000}, "its 'img_size' is 100000, not an image size of 16 to 2048 pixels"),
    ({"img_size": 8}, "its 'img_size' is 8, not an image size of 16 to 2048 pixels"),
    ({"num_classes": 10**9, "class_names": []}, "its 'num_classes' is 1000000000, not an integer from 1 to 100,000"),
    ({"class_names": ["a", "b" * 300]}, "not a list of class names of at most 256 characters"),
    ({"model_name": "m" * 300}, "not a model name of 1 to 256 characters"),
    ({"epoch": 10**13}, "its 'epoch' is 10000000000000, not a count of epochs"),
    ({"world_size": 10**6}, "not a number of GPUs from 1 to 65,536"),
    ({"train_state": {"chunks": 10**13}}, "its 'train_state' is"),
    ({"model_source": "models/net.py:build"}, "its 'model_source' is 'models/net.py:build', not a mapping"),
    ({"epoch": "x"}, "its 'epoch' is 'x', not a count of epochs"),
    ({"epoch": -1}, "its 'epoch' is -1"),
    ({"step": 2.5}, "its 'step' is 2.5"),
    ({"num_classes": "5"}, "its 'num_classes' is '5', not an integer from 1 to 100,000"),
    ({"num_classes": True}, "its 'num_classes' is True"),
    ({"class_names": "ab"}, "its 'class_names' is 'ab', not a list of class names"),
    ({"class_names": ["a", "b", "c"]}, "it lists 3 class names for num_classes 2"),
    ({"model_name": 7}, "its 'model_name' is 7"),
    ({"best_metric": "high"}, "its 'best_metric' is 'high'"),
    ({"best_metric": math.nan}, "its 'best_metric' is nan, not a finite accuracy or None"),
    ({"best_metric": {"__float__": "zzz"}}, "a number in it cannot be read (invalid hexadecimal"),
    ({"config": {"lr": {"__float__": "0x1p+99999"}}}, "a number in it cannot be read"),
    ({"config": ["lr"]}, "its 'config' is ['lr'], not a mapping of options"),
    ({"train_state": {"chunks": "x"}}, "its 'train_state' is"),
    ({"model": {"fc.weight": "not a tensor"}}, "its 'model' is 'dict', not a state dict of tensors"),
    ({"epoch_loss": [float("inf"), 3]}, "its 'epoch_loss' is [inf, 3], not [a finite sum of losses, a count]"),
    ({"epoch_loss": [1.5, -1]}, "its 'epoch_loss' is [1.5, -1]"),
    ({"epoch_loss": [1.5]}, "its 'epoch_loss' is [1.5]"),
])
def test_entries_of_the_wrong_type_are_refused_naming_them(tmp_path, change, message):
    path = runstate.save_state(_dlenv(**change), tmp_path / "c.pth")
    with pytest.raises(UserError) as e:
        runstate.load_state(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_a_good_checkpoint_and_a_bare_state_dict_pass(tmp_path):
    assert runstate.load_state(runstate.save_state(_dlenv(), tmp_path / "c.pth"))["epoch"] == 1
    bare = runstate.save_state({"w": torch.ones(2)}, tmp_path / "b.pth")
    assert list(runstate.load_state(bare)) == ["w"]


def test_metadata_that_disagrees_with_the_head_is_named(tmp_path):
    from dlenv.model.models import build_model, model_from_state

    sd = build_model("resnet18", 10).state_dict()
    ckpt = _dlenv(model=sd, num_classes=5, class_names=list("abcde"))
    with pytest.raises(UserError, match="its metadata says num_classes 5 but its weights' head fc.weight has 10"):
        model_from_state(ckpt, source="x.pth")
    with pytest.raises(UserError, match=r"does not match this model \(0 missing, 0 unexpected keys, 2 of another"):
        statedict.load_strict(build_model("resnet18", 3), sd, "x.pth")
