"""dlenv.model.models: models by name, heads sized to the data, local weights only, convolutional or not."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from dlenv.errors import UserError
from dlenv.model import checkpointing, models
from dlenv.model.models import build_model, is_convolutional, list_model_names, model_from_state


@pytest.fixture(autouse=True)
def _no_downloads(monkeypatch):
    """Any attempt to fetch weights fails the test."""

    def refuse(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


def test_list_holds_classification_models_only():
    names = list_model_names()
    for want in ("resnet50", "mobilenet_v3_large", "efficientnet_v2_s", "convnext_tiny", "regnet_y_400mf",
                 "densenet121", "vit_b_16", "swin_t", "googlenet", "inception_v3", "squeezenet1_1"):
        assert want in names
    for other in ("fasterrcnn_resnet50_fpn", "deeplabv3_resnet50", "r3d_18", "raft_large", "quantized_resnet50"):
        assert other not in names
    assert names == sorted(names)


@pytest.mark.parametrize("name, size", [("resnet18", 32), ("squeezenet1_1", 32), ("mobilenet_v3_small", 32),
                                        ("efficientnet_b0", 32), ("googlenet", 32), ("inception_v3", 75),
                                        ("shufflenet_v2_x0_5", 32), ("regnet_x_400mf", 32)])
def test_head_is_sized_to_the_classes_in_train_and_eval(name, size):
    model = build_model(name, num_classes=7)
    x = torch.randn(2, 3, size, size)
    out = model.train()(x)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 7)  # no auxiliary-logit tuples
    with torch.no_grad():
        assert model.eval()(x).shape == (2, 7)


def test_builder_kwargs_pass_through():
    model = build_model("vit_b_16", num_classes=3, image_size=32)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize("bad, suggestion", [("resnt18", "resnet18"), ("ResNet50", "resnet50"),
                                             ("efficientnet_b9", "efficientnet_b")])
def test_unknown_name_lists_close_matches(bad, suggestion):
    with pytest.raises(UserError, match=f"{bad!r}.*did you mean.*{suggestion}"):
        build_model(bad, num_classes=2)


def test_unknown_name_without_neighbours_says_where_to_look():
    with pytest.raises(UserError, match="'zzzz' is not a torchvision classification model") as err:
        build_model("zzzz", num_classes=2)
    # the hint names something that exists: the function that lists the names this accepts
    assert "from dlenv.model.models import list_model_names" in str(err.value) and "dlenv models" not in str(err.value)


@pytest.mark.parametrize("name", ["ResNet50_Weights.DEFAULT", "resnet50_pretrained", "resnet50.pretrained"])
def test_model_names_that_ask_for_downloads_point_at_pretrained(name):
    with pytest.raises(UserError, match=r"asks for pretrained weights; use --model resnet50 --pretrained"):
        build_model(name, num_classes=2)


@pytest.mark.parametrize("weights", ["ResNet18_Weights.IMAGENET1K_V1", "DEFAULT", "IMAGENET1K_V1",
                                     "pretrained", True])
def test_weights_that_need_a_download_point_at_pretrained(weights):
    with pytest.raises(UserError, match=r"names no local file; .*use --model resnet18 --pretrained"):
        build_model("resnet18", num_classes=2, weights=weights)


def test_missing_weights_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        build_model("resnet18", num_classes=2, weights=tmp_path / "nope.pth")


def test_bad_num_classes():
    with pytest.raises(UserError, match="num_classes 0"):
        build_model("resnet18", num_classes=0)


def _same_params(a: nn.Module, b: nn.Module, skip=()) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items() if not k.startswith(skip))


def test_bare_state_dict_loads_exactly(tmp_path):
    src = build_model("resnet18", num_classes=4)
    path = tmp_path / "w.pth"
    # as DDP or torch.compile would save it
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, path)
    assert _same_params(build_model("resnet18", num_classes=4, weights=path), src)


def test_dlenv_checkpoint_and_nested_state_dicts_load(tmp_path):
    src = build_model("squeezenet1_1", num_classes=4)
    for i, obj in enumerate([{"format": "dlenv/1", "model": src.state_dict(), "epoch": 3},
                             {"state_dict": src.state_dict(), "epoch": 1}]):
        path = tmp_path / f"c{i}.pth"
        torch.save(obj, path)
        assert _same_params(build_model("squeezenet1_1", num_classes=4, weights=str(path)), src)


@pytest.mark.parametrize("name, head", [("resnet18", "fc."), ("squeezenet1_1", "classifier.1."),
                                        ("mobilenet_v3_small", "classifier.3.")])
def test_fine_tuning_skips_a_head_of_another_class_count(tmp_path, caplog, name, head):
    src = build_model(name, num_classes=1000)  # as torchvision's ImageNet weights
    path = tmp_path / "imagenet.pth"
    torch.save(src.state_dict(), path)
    with caplog.at_level(logging.WARNING, logger="dlenv.model.models"):
        model = build_model(name, num_classes=3, weights=path)
    assert _same_params(model, src, skip=(head,))
    assert next(v for k, v in model.state_dict().items() if k.startswith(head)).shape[0] == 3
    assert len(caplog.records) == 1 and "1000 classes, the data has 3" in caplog.records[0].getMessage()


def test_torchvision_weights_with_aux_heads_load_into_the_aux_free_model(tmp_path):
    from torchvision import models as tvm

    src = tvm.googlenet(weights=None, aux_logits=True, init_weights=True, num_classes=1000)
    path = tmp_path / "googlenet.pth"
    torch.save(src.state_dict(), path)
    model = build_model("googlenet", num_classes=1000, weights=path)
    assert not any(k.startswith("aux") for k in model.state_dict())
    assert _same_params(model, src)


def test_weights_of_another_architecture_are_refused(tmp_path):
    path = tmp_path / "r34.pth"
    torch.save(build_model("resnet34", num_classes=2).state_dict(), path)
    with pytest.raises(UserError, match=r"does not fit resnet18 \(0 missing, \d+ unexpected.*--model"):
        build_model("resnet18", num_classes=2, weights=path)


def test_a_non_classes_shape_mismatch_is_refused(tmp_path):
    sd = build_model("resnet18", num_classes=2).state_dict()
    sd["conv1.weight"] = torch.zeros(64, 3, 3, 3)
    path = tmp_path / "bad.pth"
    torch.save(sd, path)
    with pytest.raises(UserError, match=r"1 of another shape, e.g. conv1.weight"):
        build_model("resnet18", num_classes=2, weights=path)


def test_a_file_without_weights_is_refused(tmp_path):
    path = tmp_path / "list.pth"
    torch.save([1, 2, 3], path)
    with pytest.raises(UserError, match="holds no state dict"):
        build_model("resnet18", num_classes=2, weights=path)


def test_is_convolutional():
    from torchvision.models.swin_transformer import SwinTransformer
    from torchvision.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16)
    swin = SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[1, 1], window_size=[2, 2])
    assert not is_convolutional(vit)
    assert not is_convolutional(swin)
    assert not is_convolutional(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))
    for name in ("resnet18", "mobilenet_v3_small", "convnext_tiny", "squeezenet1_1"):
        assert is_convolutional(build_model(name, num_classes=2)), name
    # one 1x1 stride-1 conv is a real (pointwise) convolution, not a patch embedding
    assert is_convolutional(nn.Conv2d(3, 8, 1))


def test_public_names_resolve_lazily():
    import dlenv

    assert dlenv.build_model is models.build_model
    assert dlenv.apply_checkpointing is checkpointing.apply_checkpointing


def test_bare_googlenet_state_dict_with_aux_heads_loads(tmp_path):
    # torchvision saves googlenet with its auxiliary heads; dlenv builds it without them
    import torchvision

    theirs = torchvision.models.googlenet(weights=None, num_classes=3, aux_logits=True, init_weights=False)
    sd = {f"module.{k}": v for k, v in theirs.state_dict().items()}  # as saved from DDP
    model, classes, _ = model_from_state(sd, "googlenet")
    assert classes == ["0", "1", "2"]
    assert torch.equal(model.state_dict()["fc.weight"], theirs.state_dict()["fc.weight"])


# ---------------------------------------------------------------------------------------------------
# torchvision ViTs at the image size asked (models.builder_args): built at --img-size, --model-args image_size.


@pytest.mark.parametrize("name,model_args,img_size,expect", [
    ("vit_b_16", "", 32, {"image_size": 32}),
    ("vit_b_32", "", 64, {"image_size": 64}),
    ("vit_h_14", "", 56, {"image_size": 56}),
    ("vit_b_16", "image_size=32", 32, {"image_size": 32}),   # the same number as --img-size: accepted
    ("vit_b_16", "", None, {}),                               # no size yet: the builder's own 224
    ("vit_l_16", "image_size=224", 224, {}),                  # 224 is the builder's size: nothing to pass
    ("resnet18", "", 32, {}),                                 # any size, no arguments
    ("vit_b_16", "", 40, r"multiples of 16 \(here 32 or 48; 224 as pretrained\); pass --img-size 32"),
    ("vit_b_32", "", 16, r"multiples of 32 \(here 32; 224 as pretrained\); pass --img-size 32"),
    ("vit_b_16", "image_size=64", 32, "resized to --img-size 32.*pass --img-size 64 instead"),
    ("vit_b_16", "depth=2", 32, "--model-args depth: vit_b_16 takes only image_size"),
    ("resnet18", "image_size=32", 32, "--model-args is for models of your own.*resnet18 takes none"),
])
def test_a_torchvision_builders_arguments(name, model_args, img_size, expect):
    from dlenv.model.models import factory_kwargs

    if isinstance(expect, dict):
        assert factory_kwargs(name, model_args, img_size) == expect
        return
    with pytest.raises(UserError, match=expect) as err:
        factory_kwargs(name, model_args, img_size)
    assert "\n" not in str(err.value)


def test_vit_b_16_at_32_px_trains_forward_and_rebuilds_from_its_checkpoint():
    """--model vit_b_16 --img-size 32 once ended in 'Wrong image height': the trainer's path (the plan's
    factory_kwargs, then build_model) now builds it at 32 px, and val rebuilds it at the checkpoint's size."""
    from dlenv.files.runstate import FORMAT
    from dlenv.model.models import factory_kwargs

    torch.manual_seed(0)
    model = build_model("vit_b_16", 3, model_args=factory_kwargs("vit_b_16", "", 32)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 3) and model.encoder.pos_embedding.shape == (1, 5, 768)  # 2x2 patches + class token
    ckpt = {"format": FORMAT, "model": model.state_dict(), "model_name": "vit_b_16", "num_classes": 3,
            "class_names": ["a", "b", "c"], "img_size": 32, "config": {}, "epoch": 1}
    again, names, size = model_from_state(ckpt)
    with torch.no_grad():
        assert size == 32 and torch.equal(again.eval()(x), out)
    with pytest.raises(UserError, match="--img-size 40: vit_b_16 .* multiples of 16"):
        build_model("vit_b_16", 3, image_size=40)  # torchvision's own assert, said in one line


def test_pretrained_vit_weights_start_a_model_of_another_size(caplog):
    """A pretrained ViT (224 px, 7x7 patches for vit_b_32) at --img-size 64: its position embedding is
    resized to 2x2 patches (torchvision's interpolate_embeddings) and said in one line; the class token's
    embedding and every other weight are the pretrained ones."""
    torch.manual_seed(0)
    trained = build_model("vit_b_32", 1000).state_dict()  # stands in for the downloaded ImageNet weights
    with caplog.at_level(logging.WARNING, logger="dlenv"):
        model = build_model("vit_b_32", 10, pretrained_state=trained, image_size=64)
    pos = model.encoder.pos_embedding
    assert pos.shape == (1, 5, 768) and torch.equal(pos[:, :1], trained["encoder.pos_embedding"][:, :1])
    assert torch.equal(model.conv_proj.weight, trained["conv_proj.weight"])
    assert any("position embedding resized from 7x7 to 2x2 patches for 64 px" in r.getMessage()
               for r in caplog.records)
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 10)
