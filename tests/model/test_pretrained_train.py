"""`dlenv train --pretrained` end to end against a weights server on 127.0.0.1, and fine-tuning's recipe:
the head and the backbone's learning rates, --freeze-epochs with frozen BatchNorm statistics, config.yaml,
and --resume exact through the unfreeze.

Real torchvision and timm models at 32 px on a few images (mobilenet_v3_small for the recipe, resnet18 and
resnet50 for the command users type), so each run takes seconds on a CPU.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import torchvision
import yaml
from imagedata import make_train_val, train_config
from weightserver import hub_file, isolated_cache, serve, torchvision_file

from dlenv import cli
from dlenv import train as train_mod
from dlenv.files import runstate
from dlenv.model import pretrained


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    return isolated_cache(monkeypatch, tmp_path)


@pytest.fixture
def data(cwd):
    return make_train_val(cwd / "data" / "pets", per_class=4, val_per_class=2, size=(40, 36))


def _serve_torchvision(root: Path, arch: str, monkeypatch) -> dict:
    """`arch`'s DEFAULT weights enum pointed at a state dict saved under torchvision's file naming."""
    state = torchvision.models.get_model(arch).state_dict()
    path = torchvision_file(root, arch, state)
    enum = torchvision.models.get_model_weights(arch).DEFAULT
    monkeypatch.setattr(enum.value, "url", f"https://download.pytorch.org/models/{path.name}")
    return state


@pytest.fixture
def server(cwd, monkeypatch):
    with serve(cwd / "srv") as (url, requests):
        monkeypatch.setenv(pretrained.MIRROR_ENV, url + "/models")
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield cwd / "srv", requests


def _cli(*args: str) -> int:
    return cli.main(["train", *args, "--img-size", "32", "--batch-size", "4", "--workers", "0", "--device", "cpu",
                     "--epochs", "1"])


@pytest.mark.slow  # 14 s on 2 cores; timm's end to end below stays in the quick set
def test_dlenv_train_pretrained_torchvision_end_to_end(server, data, cwd, monkeypatch):
    root, requests = server
    state = _serve_torchvision(root, "resnet18", monkeypatch)
    assert _cli("--model", "resnet18", "--pretrained", "--data", str(data)) == 0
    run = cwd / "runs" / "exp"
    options = yaml.safe_load((run / "config.yaml").read_text())
    assert options["pretrained"] == "DEFAULT" and options["backbone_lr"] == 0.1
    assert "ResNet18_Weights.IMAGENET1K_V1" in (run / "config.yaml").read_text()
    assert len(requests) == 1  # downloaded once ...
    assert _cli("--model", "resnet18", "--pretrained", "--data", str(data), "--max-steps", "1") == 0
    assert len(requests) == 1  # ... and the second run hit the cache
    # the trained model started from the served weights: its stem moved only a little from them
    ck = runstate.load_state(run / "last.pth")
    moved = (ck["model"]["conv1.weight"] - state["conv1.weight"]).abs().max().item()
    assert 0 < moved < 0.05 and ck["model"]["fc.weight"].shape[0] == 2


@pytest.mark.slow
def test_dlenv_train_pretrained_resnet50(server, data, cwd, monkeypatch):
    _serve_torchvision(server[0], "resnet50", monkeypatch)
    assert _cli("--model", "resnet50", "--pretrained", "--data", str(data), "--max-steps", "1") == 0
    assert "ResNet50_Weights.IMAGENET1K_V2" in (cwd / "runs" / "exp" / "config.yaml").read_text()


def test_dlenv_train_pretrained_timm_end_to_end(server, data, cwd):
    timm = pytest.importorskip("timm")
    root, requests = server
    model = timm.create_model("mobilenetv3_small_050")
    hub_file(root, "timm/mobilenetv3_small_050.lamb_in1k", model.state_dict())
    arch = "timm/mobilenetv3_small_050"
    assert _cli("--model", arch, "--pretrained", "--model-args", "drop_rate=0.1", "--data", str(data)) == 0
    text = (cwd / "runs" / "exp" / "config.yaml").read_text()
    assert "timm/mobilenetv3_small_050.lamb_in1k" in text and "drop_rate=0.1" in text
    # its pretrained_cfg says bicubic: recorded with the weights, and applied (the input plan's line)
    from dlenv.runfolder.trainstate import read_config_notes

    notes = read_config_notes(cwd / "runs" / "exp" / "config.yaml")
    assert "'interpolation': 'bicubic'" in notes["pretrained"] and "flips, bicubic)" in notes["input"]
    ck = runstate.load_state(cwd / "runs" / "exp" / "last.pth")
    moved = (ck["model"]["conv_stem.weight"] - model.conv_stem.weight).abs().max().item()
    assert moved < 0.05 and ck["model"]["classifier.weight"].shape[0] == 2
    n = len(requests)
    assert _cli("--model", arch, "--pretrained", "--data", str(data), "--max-steps", "1") == 0
    assert len(requests) == n


def test_offline_without_the_file_is_one_line_and_exit_1(data, cwd, monkeypatch, capsys):
    monkeypatch.setenv(pretrained.OFFLINE_ENV, "1")
    assert _cli("--model", "resnet18", "--pretrained", "--data", str(data)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resnet18-" in err[0] and "curl -L -o" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("args, match", [
    (["--pretrained", "--weights", "x.pth"], "both give the starting weights"),
    (["--freeze-epochs", "1"], "add --pretrained"),
    (["--pretrained", "IMAGENET9K"], "resnet18 has no such weights"),
    (["--pretrained", "--model", "small_cnn"], "small_cnn (dlenv's own CPU model"),
    (["--pretrained", "--model", "models/net.py:build"], "is your own: load its weights with --weights FILE"),
])
def test_bad_combinations_are_one_line(data, cwd, capsys, args, match):
    # the files they name are there: paths are checked first (dlenv.pathcheck), the combination is what is wrong
    (cwd / "x.pth").write_bytes(b"")
    (cwd / "models").mkdir(exist_ok=True)
    (cwd / "models" / "net.py").write_text("")
    assert _cli("--model", "resnet18", *args, "--data", str(data)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


# ---------------------------------------------------------------------------------------------------
# The recipe


def _cfg(cwd, data, **kw):
    base = dict(model="mobilenet_v3_small", pretrained="DEFAULT", img_size=32, batch_size=4, optimizer="sgd", lr=0.05,
                warmup_epochs=0.5)
    return train_config(cwd, data, **{**base, **kw})


def test_head_learns_at_lr_and_the_backbone_at_a_tenth(server, data, cwd, monkeypatch):
    _serve_torchvision(server[0], "mobilenet_v3_small", monkeypatch)
    summary = train_mod.train(_cfg(cwd, data, epochs=1))
    ck = runstate.load_state(Path(summary["run_dir"]) / "last.pth")
    groups = ck["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == pytest.approx([0.05, 0.05, 0.005, 0.005])
    # the head: classifier.3 (its hidden Linear, classifier.0, is pretrained and learns with the backbone)
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == 2
    notes = (Path(summary["run_dir"]) / "config.yaml").read_text()
    assert "backbone_lr: 0.1" in notes and "img_size_rule: --img-size 32" in notes


def test_pretrained_size_wins_over_the_default(server, data, cwd, monkeypatch):
    _serve_torchvision(server[0], "mobilenet_v3_small", monkeypatch)
    cfg = _cfg(cwd, data, epochs=1, img_size=None, max_steps=1, batch_size=2)
    summary = train_mod.train(cfg)
    ck = runstate.load_state(Path(summary["run_dir"]) / "last.pth")
    assert ck["img_size"] == 224
    assert "was trained at 224 px" in (Path(summary["run_dir"]) / "config.yaml").read_text()


def test_freeze_epochs_train_the_head_alone_with_batchnorm_statistics_frozen(server, data, cwd, monkeypatch):
    state = _serve_torchvision(server[0], "mobilenet_v3_small", monkeypatch)
    summary = train_mod.train(_cfg(cwd, data, epochs=1, freeze_epochs=1))
    ck = runstate.load_state(Path(summary["run_dir"]) / "last.pth")
    sd = ck["model"]
    for k, v in state.items():
        if not k.startswith("classifier.3."):  # the backbone: weights and BatchNorm statistics untouched
            assert torch.equal(sd[k], v), k
    # the optimizer stepped the head alone (a frozen parameter has no gradient, so no step and no state)
    moments = ck["optimizer"]["state"]
    assert len(moments) == 2 and any(m["momentum_buffer"].abs().sum() > 0 for m in moments.values())


@pytest.mark.slow
def test_resume_is_exact_through_the_unfreeze(server, data, cwd, monkeypatch):
    """Stopped at step 3: 2 steps per epoch, the head alone in epoch 1, so mid-way through epoch 2,
    after the unfreeze; resumed, it ends where an uninterrupted run does, bit for bit."""
    _serve_torchvision(server[0], "mobilenet_v3_small", monkeypatch)
    stop_at = 3
    opts = dict(epochs=3, freeze_epochs=1, batch_size=4, ema=True)
    full = train_mod.train(_cfg(cwd / "a", data, **opts))

    def on_step(st):
        if st.step == stop_at:
            signal.raise_signal(signal.SIGTERM)

    part = train_mod.train(_cfg(cwd / "b", data, **opts), on_step=on_step)
    assert part["status"] == "interrupted"
    resumed = train_mod.train(_cfg(cwd / "c", data, resume=str(Path(part["run_dir"]) / "last.pth")))
    a = runstate.load_state(Path(full["run_dir"]) / "last.pth")
    b = runstate.load_state(Path(resumed["run_dir"]) / "last.pth")
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"]["module"][k], b["ema"]["module"][k]) for k in a["ema"]["module"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 2  # the backbone learned after the unfreeze
    assert all(torch.equal(sa[k]["momentum_buffer"], sb[k]["momentum_buffer"]) for k in sa)


def test_the_weights_normalization_reaches_the_input_pipeline(server, data, cwd, monkeypatch):
    """A timm ViT's weights want mean = std = 0.5 and bicubic: the plan's input normalizes and resizes as
    they say, train and val."""
    import dataclasses

    from dlenv.data import loaders
    from dlenv.data.plan import InputOptions

    _serve_torchvision(server[0], "mobilenet_v3_small", monkeypatch)
    real_resolve, real_decide, plans = pretrained.resolve, InputOptions.decide, []
    half = (0.5, 0.5, 0.5)
    monkeypatch.setattr(pretrained, "resolve", lambda *a: dataclasses.replace(real_resolve(*a), mean=half, std=half,
                                                                              interpolation="bicubic"))
    monkeypatch.setattr(InputOptions, "decide", lambda *a, **k: plans.append(real_decide(*a, **k)) or plans[-1])
    summary = train_mod.train(_cfg(cwd, data, epochs=1, max_steps=1))
    assert plans[-1].norm == (half, half) and plans[-1].interpolation == "bicubic"
    from dlenv.runfolder.trainstate import read_config_notes

    note = read_config_notes(Path(summary["run_dir"]) / "config.yaml")["pretrained"]
    assert "'mean': [0.5, 0.5, 0.5]" in note and "MobileNet_V3_Small_Weights.IMAGENET1K_V1" in note
    # the transforms the CPU path builds from such a plan: (x - 0.5) / 0.5, so white is 1.0 and black -1.0
    from PIL import Image

    tf = loaders.build_transforms(8, False, norm=plans[-1].norm)
    assert tf(Image.new("RGB", (8, 8), (255, 255, 255))).max().item() == pytest.approx(1.0)
    assert loaders.build_transforms(8, False)(Image.new("RGB", (8, 8), (255, 255, 255))).max().item() > 2.0


def test_gpu_augment_normalizes_by_the_weights_statistics():
    from dlenv.data.gpu_aug import GpuAugment

    half = ((0.5,) * 3, (0.5,) * 3)
    images = torch.full((2, 8, 8, 3), 255, dtype=torch.uint8)
    sizes = torch.tensor([[8, 8], [8, 8]])
    out = GpuAugment(8, False, norm=half)(images, sizes)
    assert torch.allclose(out, torch.ones_like(out), atol=1e-4)


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu-transforms", "device-grid-sample"])
@pytest.mark.parametrize("mode", pretrained.INTERPOLATIONS)
def test_the_plans_interpolation_reaches_every_resize(data, on_device, mode):
    """The plan's interpolation is what train and val resize with, on either path: torchvision's
    RandomResizedCrop and Resize in the workers, grid_sample's mode on the device."""
    from torchvision.transforms import InterpolationMode

    from dlenv.data import pipeline
    from dlenv.data.plan import InputOptions

    located = pipeline.locate(str(data))
    opts = InputOptions(workers=0, gpu_augment="on" if on_device else "off", cache="off")
    plan = opts.decide(located, "cpu", 2, 16, interpolation=mode)
    assert plan.interpolation == mode and plan.augmentation().endswith(mode)
    train, val = pipeline.make_loaders(located.layout, plan, "cpu")
    if on_device:
        assert train.augment.interpolation == val.augment.interpolation == mode
    else:
        crop, resize = train.dataset.transform.transforms[0], val.dataset.transform.transforms[0]
        assert (type(crop).__name__, type(resize).__name__) == ("RandomResizedCrop", "Resize")
        assert crop.interpolation == resize.interpolation == InterpolationMode(mode)
    images, _ = next(iter(val))
    assert images.shape[-2:] == (16, 16)


def test_gpu_augment_samples_with_its_mode_and_keeps_bicubic_in_range():
    import torch.nn.functional as F

    from dlenv.data.gpu_aug import GpuAugment, boxes_to_theta, center_boxes

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 24, 24, 3), dtype=torch.uint8, generator=g)
    sizes = torch.tensor([[24, 24], [24, 24]])
    no_norm = ((0.0,) * 3, (1 / 255,) * 3)  # out = pixel value
    outs = {m: GpuAugment(10, False, norm=no_norm, interpolation=m)(images, sizes) for m in pretrained.INTERPOLATIONS}
    theta = boxes_to_theta(center_boxes(sizes)).float()
    grid = F.affine_grid(theta, [2, 3, 10, 10], align_corners=False)
    x = images.permute(0, 3, 1, 2).float()
    for m, out in outs.items():
        want = F.grid_sample(x, grid, mode=m, padding_mode="border", align_corners=False).clamp(0, 255)
        assert torch.allclose(out, want, atol=1e-3), m
    assert not torch.allclose(outs["bilinear"], outs["bicubic"]) and not torch.allclose(outs["bilinear"],
                                                                                          outs["nearest"])
    assert outs["bicubic"].min() >= 0 and outs["bicubic"].max() <= 255
    with pytest.raises(ValueError, match="not one of: bilinear, bicubic, nearest"):
        GpuAugment(10, False, interpolation="lanczos")
