"""Factories called the way their authors wrote them (dlenv.model.usermodel._class_call): the class count by
keyword where the signature names it, into **kwargs for timm-style entrypoints, and a guess shown in one
line otherwise; kuangliu/pytorch-cifar-shaped classes train without a wrapper or fail with the fix."""

from __future__ import annotations

import pytest
from imagedata import make_train_val, train_config
from usermodels import isolated_imports, write_cifar

from dlenv import train as train_mod
from dlenv.errors import UserError
from dlenv.model import models


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_cifar(tmp_path)
    with isolated_imports(tmp_path):
        yield tmp_path


def _out(model):
    import torch

    model.eval()
    return model(torch.randn(2, 3, 16, 16)).shape[1]


@pytest.fixture
def said(monkeypatch):
    """The warnings usermodel gives, as it gives them (whatever another test's library did to logging's
    configuration in this process)."""
    from dlenv.model import usermodel

    lines: list[str] = []
    monkeypatch.setattr(usermodel.log, "warning", lambda fmt, *args: lines.append(fmt % args))
    return lines


@pytest.mark.parametrize("factory, classes", [("DLA", 3), ("UNetish", 5), ("resnet_entry", 4)])
def test_the_class_count_goes_where_the_signature_names_it(project, factory, classes, said):
    model = models.build_model(f"models/cifar.py:{factory}", classes)
    assert _out(model) == classes
    notes = said
    if factory == "resnet_entry":  # **kwargs: said in one line, with the call
        assert notes == ["--model models/cifar.py:resnet_entry: called resnet_entry(num_classes=4); it names no "
                         "class-count parameter (num_classes, n_classes, num_class, n_class, ...), so num_classes "
                         "went into its **kwargs"]
    else:  # named: no guess, nothing said
        assert notes == []


def test_timm_entrypoint_by_module_reference(project):
    pytest.importorskip("timm")
    model = models.build_model("timm.models.resnet:resnet18", 3)
    assert model.fc.out_features == 3  # not pretrained=3 (which would have downloaded)


def test_a_guess_is_one_line_with_the_call_and_the_parameter(project, said):
    model = models.build_model("models/cifar.py:build", 3)
    assert _out(model) == 3
    assert said == [
        "--model models/cifar.py:build: called build(3); it names no class-count parameter (num_classes, "
        "n_classes, num_class, n_class, ...), so the class count went into 'width' (a guess; name it num_classes "
        "to be sure)"]


def test_no_class_count_parameter_builds_its_own_ten(project, said):
    model = models.build_model("models/cifar.py:ResNet18", 10)
    assert _out(model) == 10
    assert "called ResNet18() without the class count" in said[0]


def test_vgg_without_its_name_fails_with_the_fix(project):
    with pytest.raises(UserError) as err:
        models.build_model("models/cifar.py:VGG", 10)
    msg = str(err.value)
    assert "\n" not in msg and "VGG(10) failed at line" in msg and "KeyError: 10" in msg
    assert "the class count went into 'vgg_name' (a guess)" in msg and "--model-args (e.g. vgg_name=...)" in msg
    model = models.build_model("models/cifar.py:VGG", 10, vgg_name="VGG11")
    assert _out(model) == 10


@pytest.mark.parametrize("ref, args", [("models/cifar.py:DLA", None), ("models/cifar.py:VGG", "vgg_name=VGG11"),
                                       ("models/cifar.py:ResNet18", None)])
def test_kuangliu_shapes_train_without_a_wrapper(project, ref, args):
    classes = tuple(f"c{i}" for i in range(10))
    data = make_train_val(project / "ds", per_class=1, val_per_class=1, classes=classes)
    cfg = train_config(project, data, model=ref, model_args=args, epochs=1, max_steps=1, batch_size=4)
    assert train_mod.train(cfg)["exit_code"] == 0


def test_a_head_of_another_size_than_the_data_says_so(project):
    data = make_train_val(project / "ds", per_class=2)
    cfg = train_config(project, data, model="models/cifar.py:ResNet18", epochs=1, max_steps=1)
    with pytest.raises(UserError, match=r"returned a tensor of shape \[2, 10\].*\[2, 2\]"):
        train_mod.train(cfg)
