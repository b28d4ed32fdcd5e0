"""dlenv.runfolder.preprocess and --normalize / --resize (dlenv.options.values): weights dlenv did not write are
judged with the preprocessing their script used, said in one line with where each value came from (flags, then
preprocess.yaml beside the weights, then what dlenv assumes); the sidecar is bounded like every options file."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dlenv.cli import main as cli_main
from dlenv.options.values import normalization, normalize_value
from dlenv.runfolder import preprocess

SIZE, CLASSES = 48, ("a_dark", "b_mid", "c_light")  # sorted, as ImageFolder and val number them

MODEL = textwrap.dedent("""
    from torch import nn


    class MyNet(nn.Module):
        # a plain script's model: it sees pixels in [0, 1], as ToTensor gives them
        def __init__(self, num_classes=3):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.head = nn.Linear(8, num_classes)

        def forward(self, x):
            return self.head(self.features(x).flatten(1))
""")


def _images(root: Path, per_class: int, seed: int) -> None:
    """PNGs of 48 px whose class is their brightness (0.2, 0.5, 0.8, with noise): a shift by ImageNet's mean
    and std moves them across the classes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for level, name in zip((0.2, 0.5, 0.8), CLASSES, strict=True):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            arr = np.clip(rng.normal(level, 0.12, (SIZE, SIZE, 3)), 0, 1)
            Image.fromarray((arr * 255).astype(np.uint8)).save(root / name / f"{i}.png")


def _script_tensors(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """What the user's script feeds its model: Resize((48, 48)), ToTensor(), no normalisation."""
    from PIL import Image
    from torchvision import transforms as T

    tf = T.Compose([T.Resize((SIZE, SIZE)), T.ToTensor()])
    xs, ys = [], []
    for ci, name in enumerate(CLASSES):
        for p in sorted((folder / name).iterdir()):
            xs.append(tf(Image.open(p).convert("RGB")))
            ys.append(ci)
    return torch.stack(xs), torch.tensor(ys)


@pytest.fixture(scope="module")
def script_project(tmp_path_factory):
    """A project trained by a plain script: data/shades/{train,val}, models/mynet.py, best_model.pth (a bare
    state dict), and the script's own top-1 on val/."""
    import importlib.util

    root = tmp_path_factory.mktemp("own")
    _images(root / "data" / "shades" / "train", 20, 0)
    _images(root / "data" / "shades" / "val", 10, 1)
    (root / "models").mkdir()
    (root / "models" / "mynet.py").write_text(MODEL)
    spec = importlib.util.spec_from_file_location("mynet_for_test", root / "models" / "mynet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = mod.MyNet(3)
    x, y = _script_tensors(root / "data" / "shades" / "train")
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    torch.save(net.state_dict(), root / "best_model.pth")
    vx, vy = _script_tensors(root / "data" / "shades" / "val")
    with torch.no_grad():
        acc = float((net(vx).argmax(1) == vy).float().mean() * 100)
    assert acc > 60, f"the script's model learned nothing ({acc}%): the test would prove nothing"
    return root, acc


def _val(root: Path, capsys, *flags: str, out: str) -> tuple[int, str, dict]:
    old = os.getcwd()
    os.chdir(root)
    try:
        code = cli_main(["val", "--weights", "best_model.pth", "--model", "models/mynet.py:MyNet", "--data",
                         "data/shades/val", "--workers", "0", "--device", "cpu", "--out", out, *flags])
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    metrics = json.loads((root / out / "metrics.json").read_text()) if code == 0 else {}
    return code, captured.out + captured.err, metrics


def _line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("preprocessing: ")]
    assert len(lines) == 1, text
    return lines[0]


def test_a_bare_state_dict_is_validated_with_what_val_says_it_assumes(script_project, capsys):
    root, _ = script_project
    code, text, m = _val(root, capsys, out="val-default")
    assert code == 0, text
    assert _line(text).startswith("preprocessing: 224 px (assumed), normalize imagenet (assumed), resize crop "
                                  "(assumed): best_model.pth is a bare state dict, which does not say how its "
                                  "images were prepared; match your training script with --img-size, --normalize "
                                  "and --resize, or preprocess.yaml beside it")
    assert m["img_size"] == 224 and m["normalize"] == "imagenet" and m["resize"] == "crop"


def test_the_flags_of_the_script_give_the_scripts_own_accuracy(script_project, capsys):
    root, acc = script_project
    code, text, m = _val(root, capsys, "--img-size", "48", "--normalize", "none", "--resize", "full", out="val-flags")
    assert code == 0, text
    assert _line(text) == ("preprocessing: 48 px (--img-size), normalize none (--normalize), resize full "
                           "(--resize) for best_model.pth (a bare state dict)")
    assert m["top1"] == pytest.approx(acc, abs=1e-6), (m["top1"], acc)
    assert m["img_size"] == 48 and m["normalize"] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] and m["resize"] == "full"


def test_preprocess_yaml_beside_the_weights_is_read_and_flags_override_it(script_project, capsys):
    root, acc = script_project
    side = root / preprocess.SIDECAR
    side.write_text("img_size: 48\nnormalize: none\nresize: full\n")
    try:
        code, text, m = _val(root, capsys, out="val-sidecar")
        assert code == 0, text
        assert _line(text) == ("preprocessing: 48 px (preprocess.yaml), normalize none (preprocess.yaml), "
                               "resize full (preprocess.yaml) for best_model.pth (a bare state dict)")
        assert m["top1"] == pytest.approx(acc, abs=1e-6)
        code, text, m = _val(root, capsys, "--normalize", "imagenet", out="val-override")
        assert code == 0 and "normalize imagenet (--normalize)" in _line(text) and "48 px (preprocess.yaml)" in text
    finally:
        side.unlink()


def test_predict_says_the_same(script_project, capsys):
    root, _ = script_project
    old = os.getcwd()
    os.chdir(root)
    try:
        code = cli_main(["predict", "--weights", "best_model.pth", "--model", "models/mynet.py:MyNet", "--source",
                         "data/shades/val/a_dark", "--workers", "0", "--device", "cpu", "--img-size", "48",
                         "--normalize", "none", "--resize", "full", "--project", str(root / "pred")])
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "preprocessing: 48 px (--img-size), normalize none (--normalize), resize full (--resize)" in \
        captured.out + captured.err


@pytest.mark.parametrize("text, says", [
    ("img_size: 100000\n", "img_size 100000 is above its maximum 2,048"),
    ("img_size: 8\n", "img_size 8 is below its minimum 16"),
    ("normalize: 123.7,116.3,103.5,58.4,57.1,57.4\n", "the 0-255 scale? divide by 255"),
    ("normalize: 0.5,0.5\n", None),
    ("normalize: [0.5, 0.5, 0.5, 0.2, 0.2, 0.2]\n", None),
    ("normalize: 0.5,0.5,0.5\n", "three means and three stds"),
    ("resize: stretch\n", "is not one of: auto, crop, full"),
    ("mean: 0.5\n", "unknown key 'mean'; it may hold img_size, normalize, resize"),
    ("- img_size\n", "must hold a mapping"),
    ("a: &x [1]\nb: *x\n", "alias"),
    ("img_size: [", "not valid YAML"),
])
def test_a_bad_preprocess_yaml_is_one_line_naming_it(tmp_path, text, says):
    (tmp_path / preprocess.SIDECAR).write_text(text)
    if says is None:
        assert preprocess.sidecar(tmp_path / "best_model.pth")
        return
    with pytest.raises(Exception) as e:
        preprocess.sidecar(tmp_path / "best_model.pth")
    assert type(e.value).__name__ == "UserError" and says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("make", ["folder", "fifo", "big"])
def test_a_preprocess_yaml_that_is_no_small_file_is_refused(tmp_path, make):
    from dlenv.errors import UserError

    path = tmp_path / preprocess.SIDECAR
    if make == "folder":
        path.mkdir()
    elif make == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("# x\n" * 400_000)
    with pytest.raises(UserError):
        preprocess.sidecar(tmp_path / "best_model.pth")


@pytest.mark.parametrize("value, canonical", [
    ("none", "none"), ("ImageNet", "imagenet"), ("auto", "auto"), ("0.5,0.25", "0.5,0.5,0.5,0.25,0.25,0.25"),
    ("0.485, 0.456, 0.406, 0.229, 0.224, 0.225", "0.485,0.456,0.406,0.229,0.224,0.225"),
    ([0.1307, 0.3081], "0.1307,0.1307,0.1307,0.3081,0.3081,0.3081"),
])
def test_normalize_values(value, canonical):
    assert normalize_value(value) == canonical


@pytest.mark.parametrize("value", ["", "0.5", "0.5,0.5,0.5", "a,b", "0.5,0", "nan,1", "0.5,inf", "3,0.5",
                                   "0.5,0.5,0.5,0.2,0.2,0.2,0.2", "128,64", None, {"mean": 1}])
def test_bad_normalize_values(value):
    with pytest.raises(ValueError):
        normalize_value(value)


def test_normalization_of_each_form():
    assert normalization("imagenet") is None and normalization("auto") is None
    assert normalization("none") == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert normalization("0.5,0.5,0.5,0.25,0.25,0.25") == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def test_a_bad_normalize_flag_is_one_line_before_pytorch_work(capsys):
    code = cli_main(["val", "--weights", "x.pth", "--normalize", "255,255"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--normalize" in err and "divide by 255" in err


def test_flags_put_in_place_of_a_run_files_own():
    own = preprocess.Preprocessing(64, None, "crop", "")
    assert preprocess.overridden(own, {"img_size": None, "normalize": "auto", "resize": "auto"}) == own
    o = preprocess.overridden(own, {"normalize": "none", "resize": "full"})
    assert (o.img_size, o.norm, o.resize) == (64, ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)), "full")
    assert o.said == "preprocessing: normalize none (--normalize), resize full (--resize), in place of the " \
                     "weights file's own"
