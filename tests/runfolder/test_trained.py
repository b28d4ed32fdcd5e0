"""dlenv.runfolder.trained: the one way a trained model is opened (val, predict, prune, export): what it returns for
each kind of file, the kinds a command refuses, --classes and --img-size, the precision a run trained in,
and the saved options it checks. small_cnn at 32 px, CPU only."""

from __future__ import annotations

import pytest
import torch

from dlenv import compat
from dlenv.errors import UserError
from dlenv.files.runstate import FORMAT, save_state
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model.models import build_model
from dlenv.options import config
from dlenv.runfolder.trained import RUN_FILE, STATE_DICT, TORCHSCRIPT, open_trained, trained_precision

CLASSES = ["cat", "dog", "fox"]
SIZE = 32
TRUST = LoadPolicy(trust_pickle=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("small_cnn", len(CLASSES)).eval()


def _ckpt(path, **override):
    train_cfg = config.to_dict(config.build(config.TrainConfig, model="small_cnn", img_size=SIZE))
    state = {"format": FORMAT, "model": _model().state_dict(), "model_name": "small_cnn",
             "num_classes": len(CLASSES), "class_names": list(CLASSES), "img_size": SIZE, "config": train_cfg,
             "epoch": 1, "step": 2}
    for key, value in override.items():
        if key in train_cfg:
            state["config"] = {**state["config"], key: value}
        else:
            state[key] = value
    return save_state(state, path)


def _torchscript(path):
    traced = compat.jit_trace(_model(), torch.zeros(1, 3, SIZE, SIZE))
    compat.jit_save(traced, str(path))
    return path


@pytest.mark.parametrize("saved,precision", [
    ({"amp": True, "amp_dtype": "bf16"}, "bf16"), ({"amp": True, "amp_dtype": "fp16"}, "fp16"),
    ({"amp": True, "amp_dtype": "auto"}, "amp"), ({"amp": False, "amp_dtype": "bf16"}, "fp32"), ({}, None),
])
def test_the_saved_options_name_the_precision_trained_in(saved, precision):
    assert trained_precision(saved) == precision


def test_a_checkpoint_opens_with_everything_it_records(tmp_path):
    path = _ckpt(tmp_path / "best_model.pth", amp=True, amp_dtype="bf16")
    t = open_trained(path, SAFE)
    assert t.kind == RUN_FILE and t.class_names == tuple(CLASSES) and t.img_size == SIZE
    assert t.norm is None and t.interpolation == "bilinear" and t.precision == "bf16"
    assert t.config["model"] == "small_cnn" and t.run_file["epoch"] == 1
    assert not t.model.training and all(p.device.type == "cpu" for p in t.model.parameters())
    want = _model().state_dict()
    assert all(torch.equal(v, want[k]) for k, v in t.model.state_dict().items())
    with pytest.raises(AttributeError):  # frozen: a command cannot swap what was opened
        t.img_size = 64  # type: ignore[misc]


def test_a_bare_state_dict_needs_model_and_says_the_size_it_takes(tmp_path):
    path = tmp_path / "bare.pth"
    torch.save(_model().state_dict(), path)
    with pytest.raises(UserError, match="bare state dict with no architecture; name it with --model"):
        open_trained(path, SAFE)
    said = []
    t = open_trained(path, SAFE, "small_cnn", say=said.append)
    assert t.kind == STATE_DICT and t.class_names == ("0", "1", "2") and t.img_size == 224 and t.run_file == {}
    assert t.precision is None and len(said) == 1 and said[0].startswith("preprocessing: 224 px (assumed), "
                                                                         "normalize imagenet (assumed)")
    t = open_trained(path, SAFE, "small_cnn", img_size=48, prep={"normalize": "none"}, say=said.append)
    assert t.img_size == 48 and t.norm == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)) and t.resize == "crop"
    # what is still assumed is said, beside what was given
    assert len(said) == 2 and said[1].startswith("preprocessing: 48 px (--img-size), normalize none (--normalize), "
                                                 "resize crop (assumed): ")


@pytest.mark.parametrize("case,phrase", [
    ("bare state dict, checkpoint only", "is a bare state dict, without class names"),
    ("onnx, checkpoint only", "is an ONNX export; prune takes the run file it was exported from"),
    ("torchscript, checkpoint only", "a TorchScript model (an export)"),
    ("torchscript without consent", "a program: loading it runs the code it holds"),
    ("torchscript without classes", "stores no class names or image size"),
    ("torchscript at a size it cannot run", "does not run on 8x8 images"),
    ("classes of another count", "--classes names 2 classes but"),
    ("classes other than the file's", "--classes differs from the class names"),
    ("saved options not valid", "its saved training options are not valid"),
])
def test_what_a_command_cannot_open_is_one_line(case, phrase, tmp_path):
    ckpt, ts = _ckpt(tmp_path / "best_model.pth"), _torchscript(tmp_path / "m.torchscript.pt")
    bare = tmp_path / "bare.pth"
    torch.save(_model().state_dict(), bare)
    calls = {
        "bare state dict, checkpoint only": lambda: open_trained(bare, SAFE, kinds=(RUN_FILE,), verb="prune"),
        "onnx, checkpoint only": lambda: open_trained(tmp_path / "m.onnx", SAFE, kinds=(RUN_FILE,), verb="prune"),
        "torchscript, checkpoint only": lambda: open_trained(ts, TRUST, kinds=(RUN_FILE, STATE_DICT)),
        "torchscript without consent": lambda: open_trained(ts, SAFE, classes=("a", "b", "c"), img_size=SIZE),
        "torchscript without classes": lambda: open_trained(ts, TRUST, img_size=SIZE),
        "torchscript at a size it cannot run": lambda: open_trained(ts, TRUST, classes=("a", "b", "c"), img_size=8),
        "classes of another count": lambda: open_trained(ckpt, SAFE, classes=("a", "b")),
        "classes other than the file's": lambda: open_trained(ckpt, SAFE, classes=("a", "b", "c")),
        "saved options not valid": lambda: open_trained(_ckpt(tmp_path / "bad.pth", batch_size=-3), SAFE),
    }
    with pytest.raises(UserError) as e:
        calls[case]()
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_a_torchscript_export_opens_with_consent_classes_and_size(tmp_path):
    ts = _torchscript(tmp_path / "m.torchscript.pt")
    t = open_trained(ts, TRUST, classes=("a", "b", "c"), img_size=SIZE)
    assert t.kind == TORCHSCRIPT and t.class_names == ("a", "b", "c") and t.img_size == SIZE and t.run_file == {}
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        assert torch.allclose(t.model(x), _model()(x), atol=1e-5)


def test_classes_equal_to_the_checkpoints_are_taken(tmp_path):
    t = open_trained(_ckpt(tmp_path / "best_model.pth"), SAFE, classes=tuple(CLASSES))
    assert t.class_names == tuple(CLASSES)
