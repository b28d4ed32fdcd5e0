"""--channels 1: pytorch/examples' MNIST `Net` (1 channel in, log_softmax out, its 10 classes fixed by a
factory without arguments) trains, validates and predicts on dlenv's RGB input paths; without the option
the refusal names it; the luma arithmetic of dlenv.model.grayscale."""

from __future__ import annotations

import csv

import pytest
import torch

from dlenv import cli
from dlenv.data.loaders import IMAGENET_MEAN, IMAGENET_STD
from dlenv.model import grayscale


def test_the_luma_of_normalised_rgb_is_the_normalised_luma():
    pixels = torch.rand(2, 3, 5, 5)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    luma_w = torch.tensor(grayscale.LUMA).view(1, 3, 1, 1)
    luma = (pixels * luma_w).sum(1, keepdim=True)
    expected = (luma - (luma_w * mean).sum()) / (luma_w * std).sum()  # the luma, normalised with one mean/std
    got = grayscale.to_gray((pixels - mean) / std)
    assert got.shape == (2, 1, 5, 5) and torch.allclose(got, expected, atol=1e-6)


def test_the_hook_is_put_on_once_and_leaves_other_shapes_alone():
    seen = []
    model = torch.nn.Identity()
    model.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    grayscale.apply(grayscale.apply(model, 1), 1)
    model(torch.zeros(2, 3, 4, 4))
    model(torch.zeros(2, 1, 4, 4))
    assert seen == [(2, 1, 4, 4), (2, 1, 4, 4)] and len(model._forward_pre_hooks) == 1
    assert grayscale.apply(torch.nn.Identity(), 3)._forward_pre_hooks == {}


@pytest.fixture
def digits(tmp_path, monkeypatch):
    """A project folder: MNIST's net.py and 10 classes of small grayscale PNGs (train/ and val/)."""
    from PIL import Image
    from thirdparty import MNIST_NET, write

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "net.py", MNIST_NET)
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 4), ("val", 1)):
        for c in range(10):
            folder = tmp_path / "digits" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                level = 20 + 23 * c  # each class its own brightness: something to learn
                noise = torch.randint(-10, 10, (28, 28), generator=gen)
                Image.fromarray((noise + level).clamp(0, 255).to(torch.uint8).numpy()).save(folder / f"{i}.png")
    return tmp_path


TRAIN = ["train", "--model", "net.py:Net", "--img-size", "28", "--data", "digits", "--epochs", "1", "--batch-size",
         "8", "--device", "cpu", "--workers", "0", "--lr", "0.01"]


@pytest.mark.slow  # a training run, val, predict and an ONNX export on the CPU
def test_mnists_net_trains_validates_predicts_and_exports_with_channels_1(digits, capsys):
    assert cli.main([*TRAIN, "--channels", "1"]) == 0
    run = digits / "runs" / "exp"
    with (run / "results.csv").open() as fh:
        row = next(csv.DictReader(fh))
    assert float(row["train_loss"]) > 0 and 0 <= float(row["top1"]) <= 100
    assert "channels: 1" in (run / "config.yaml").read_text()
    # log_softmax output: cross-entropy of log-probabilities is their NLL, so the loss is a real one
    assert float(row["train_loss"]) < 10
    capsys.readouterr()
    assert cli.main(["val", "--weights", str(run / "best_model.pth"), "--device", "cpu", "--workers", "0"]) == 0
    assert cli.main(["predict", "--weights", str(run / "best_model.pth"), "--source", "digits/val/class3",
                     "--device", "cpu"]) == 0
    # an export takes RGB like every dlenv model: the hook is traced into the graph, which onnxruntime runs
    assert cli.main(["export", "--weights", str(run / "best_model.pth"), "--format", "onnx", "--workers", "0"]) == 0
    assert "TracerWarning" not in capsys.readouterr().err


@pytest.mark.slow  # the model's import and one forward
def test_without_channels_1_the_refusal_says_how(digits, capsys):
    assert cli.main(TRAIN) == 2
    err = capsys.readouterr().err
    assert "takes 1 channel(s) and dlenv fed 3: add --channels 1" in err and "Traceback" not in err
