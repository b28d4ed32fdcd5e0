"""dlenv.model.pretrained without the internet: the real download code against a weights server on 127.0.0.1.

torchvision's files are served under their real names by pointing the weights enum's URL at a file the
test made (its own sha256 prefix in the name), through DLENV_TORCHVISION_URL, the mirror setting; timm's
through HF_ENDPOINT and the hub's resolve layout. Each test has its own cache in tmp_path (the working
folder), so a hit or a miss is the test's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from weightserver import hub_file, isolated_cache, serve, torchvision_file

from dlenv.errors import UserError
from dlenv.model import finetune, models, pretrained
from dlenv.options import values


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    return isolated_cache(monkeypatch, tmp_path)


@pytest.fixture
def resnet18_server(cwd, monkeypatch):
    """A server holding a resnet18 state dict as torchvision names its files; the enum points at it."""
    state = torchvision.models.resnet18().state_dict()
    path = torchvision_file(cwd / "srv", "resnet18", state)
    enum = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    with serve(cwd / "srv") as (url, requests):
        monkeypatch.setattr(enum.value, "url", f"https://download.pytorch.org/models/{path.name}")
        monkeypatch.setenv(pretrained.MIRROR_ENV, url + "/models")
        yield path, state, requests


def test_parse_pretrained():
    assert values.parse_pretrained(None) is None and values.parse_pretrained("off") is None
    assert values.parse_pretrained(True) == "DEFAULT" and values.parse_pretrained("default") == "DEFAULT"
    assert values.parse_pretrained("IMAGENET1K_V2") == "IMAGENET1K_V2"
    with pytest.raises(ValueError):
        values.parse_pretrained("../x y")


def test_torchvision_weights_resolve_to_their_file_and_preprocessing(cwd):
    w = pretrained.resolve("resnet50", "IMAGENET1K_V2")
    assert w.name == "ResNet50_Weights.IMAGENET1K_V2" and w.file.startswith("resnet50-") and w.hash_prefix
    assert w.url == f"{pretrained.TORCHVISION_HOST}/{w.file}" and w.num_classes == 1000
    # V2's eval recipe: resize 232, crop 224, bilinear, ImageNet statistics (torchvision's weights.transforms())
    assert (w.img_size, w.interpolation, w.mean) == (224, "bilinear", pretrained.IMAGENET_MEAN)
    assert pretrained.resolve("resnet50", "DEFAULT").name == "ResNet50_Weights.IMAGENET1K_V2"
    assert pretrained.resolve("vit_b_16", "ResNet50_Weights.IMAGENET1K_SWAG_E2E_V1").img_size == 384
    with pytest.raises(UserError, match="resnet50 has no such weights; it has IMAGENET1K_V1, IMAGENET1K_V2"):
        pretrained.resolve("resnet50", "IMAGENET9K")


def test_a_miss_downloads_once_then_hits_without_a_request(resnet18_server, cwd, capsys, monkeypatch):
    path, state, requests = resnet18_server
    w = pretrained.resolve("resnet18", "DEFAULT")
    got = pretrained.fetch(w)
    assert got == cwd / ".cache" / "torch" / "hub" / "checkpoints" / path.name
    assert requests == [("GET", f"/models/{path.name}")]
    assert "100%" in capsys.readouterr().err  # torch.hub's tqdm bar
    assert pretrained.fetch(w) == got and len(requests) == 1  # the hit asks nobody
    monkeypatch.setenv(pretrained.OFFLINE_ENV, "1")
    assert pretrained.fetch(w) == got  # and needs no connection
    sd = pretrained.fetched_state_dict(w, got)  # through dlenv.files.weights' allowlist: no --trust-pickle
    assert all(torch.equal(sd[k], v) for k, v in state.items())


def test_torch_home_moves_the_cache(resnet18_server, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "elsewhere"))
    got = pretrained.fetch(pretrained.resolve("resnet18", "DEFAULT"))
    assert got.parent == tmp_path / "elsewhere" / "hub" / "checkpoints"


def test_a_corrupt_download_is_refused_and_never_cached(resnet18_server, cwd):
    path, _, _ = resnet18_server
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    w = pretrained.resolve("resnet18", "DEFAULT")
    with pytest.raises(UserError, match=r"does not match its checksum \(sha256 should start [0-9a-f]{8}\); "
                                        "refusing it, nothing was saved") as err:
        pretrained.fetch(w)
    assert "\n" not in str(err.value)
    assert not any((cwd / ".cache" / "torch" / "hub" / "checkpoints").iterdir())


def test_a_cached_file_changed_later_is_refused(resnet18_server, cwd):
    w = pretrained.resolve("resnet18", "DEFAULT")
    got = pretrained.fetch(w)
    got.write_bytes(got.read_bytes()[:-10])
    with pytest.raises(UserError, match="does not match its checksum.*delete it and run again"):
        pretrained.fetch(w)


def test_offline_and_not_cached_is_one_line_with_the_file_the_place_and_the_command(cwd, monkeypatch):
    monkeypatch.setenv(pretrained.OFFLINE_ENV, "1")
    w = pretrained.resolve("resnet18", "DEFAULT")
    with pytest.raises(UserError) as err:
        pretrained.fetch(w)
    msg = str(err.value)
    assert "\n" not in msg and w.file in msg and ".cache/torch/hub/checkpoints/" in msg
    assert f"curl -L -o {w.file} https://download.pytorch.org/models/{w.file}" in msg


def test_an_unreachable_mirror_is_the_same_one_line(cwd, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(pretrained.MIRROR_ENV, f"http://127.0.0.1:{port}/models")
    w = pretrained.resolve("resnet18", "DEFAULT")
    with pytest.raises(UserError, match=rf"is not in .cache/torch/hub/checkpoints/ and http://127.0.0.1:{port}/"
                                        "models/resnet18-.*cannot be reached") as err:
        pretrained.fetch(w)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mirror", ["not a url", "mirror.example/models", "javascript:x", "http://[::1/models"])
def test_a_mirror_that_is_no_url_is_one_line(cwd, monkeypatch, mirror):
    monkeypatch.setenv(pretrained.MIRROR_ENV, mirror)
    with pytest.raises(UserError, match=f"^{pretrained.MIRROR_ENV}=.* is not a URL of a mirror; set it") as err:
        pretrained.fetch(pretrained.resolve("resnet18", "DEFAULT"))
    assert "\n" not in str(err.value)


def test_pretrained_resnet_gets_the_weights_and_a_fresh_head(resnet18_server):
    _, state, _ = resnet18_server
    plan = finetune.Plan(pretrained.resolve("resnet18", "DEFAULT"), 0.1, 0, fetch=True)
    model = models.build_model("resnet18", 3, pretrained_state=plan.state())
    assert torch.equal(model.conv1.weight, state["conv1.weight"]) and model.fc.out_features == 3
    recipe = plan.prepare(model, 3)
    assert recipe.head == ("fc.weight", "fc.bias")


# ---------------------------------------------------------------------------------------------------
# timm, through the hub's layout


@pytest.fixture
def timm_server(cwd, monkeypatch):
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18")
    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    hub_file(cwd / "hub", w.repo, model.state_dict())
    with serve(cwd / "hub") as (url, requests):
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield model, requests


def test_timm_weights_resolve_from_its_pretrained_config(cwd):
    pytest.importorskip("timm")
    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    assert w.repo == "timm/resnet18.a1_in1k" and w.file == "model.safetensors" and w.classifier == ("fc",)
    assert w.interpolation == "bicubic" and w.img_size == 224
    assert pretrained.resolve("timm/resnet18", "tv_in1k").repo == "timm/resnet18.tv_in1k"
    assert pretrained.resolve("timm/resnet18.tv_in1k", "DEFAULT").repo == "timm/resnet18.tv_in1k"
    with pytest.raises(UserError, match="no hub weights for timm/resnet18.nope; it has .*a1_in1k"):
        pretrained.resolve("timm/resnet18", "nope")
    with pytest.raises(UserError, match="timm has no model 'resnet18x'"):
        pretrained.resolve("timm/resnet18x", "DEFAULT")


@pytest.mark.parametrize("model, weights, want", [
    ("resnet50", "IMAGENET1K_V2", "bilinear"),
    ("efficientnet_b0", "DEFAULT", "bicubic"),           # torchvision's weights meta: BICUBIC
    ("vit_b_16", "IMAGENET1K_SWAG_E2E_V1", "bicubic"),
    ("timm/resnet18", "DEFAULT", "bicubic"),             # timm's pretrained_cfg: 'bicubic'
    ("timm/resnet18", "tv_in1k", "bilinear"),
])
def test_the_weights_resampling_becomes_the_pipelines_name(cwd, model, weights, want):
    if model.startswith("timm/"):
        pytest.importorskip("timm")
    w = pretrained.resolve(model, weights)
    assert w.interpolation == want and w.record()["interpolation"] == want
    assert pretrained.interpolation_of({"config": {"model": model, "pretrained": weights}}) == want


@pytest.mark.parametrize("value, want", [
    ("bicubic", "bicubic"), ("BILINEAR", "bilinear"), ("nearest", "nearest"), (None, "bilinear"),
    ("random", "bilinear"), ("lanczos", "bicubic"), (torchvision.transforms.InterpolationMode.BICUBIC, "bicubic"),
    (torchvision.transforms.InterpolationMode.HAMMING, "bicubic"),
])
def test_interpolation_names_map_onto_the_modes_both_paths_have(value, want):
    assert pretrained.interpolation(value) == want and want in pretrained.INTERPOLATIONS


def test_timm_miss_then_hit_through_hf_endpoint(timm_server, cwd, monkeypatch):
    model, requests = timm_server
    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    got = pretrained.fetch(w)
    assert str(got).startswith(str(cwd / ".cache" / "huggingface" / "hub" / "models--timm--resnet18.a1_in1k"))
    n = len(requests)
    assert n >= 1 and all(p.endswith("/timm/resnet18.a1_in1k/resolve/main/model.safetensors") for _, p in requests)
    assert pretrained.fetch(w) == got and len(requests) == n  # the hit asks nobody
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pretrained.fetch(w) == got  # and needs no connection
    built = models.build_model("timm/resnet18", 4, pretrained_state=pretrained.fetched_state_dict(w, got))
    assert torch.equal(built.conv1.weight, model.conv1.weight) and built.fc.out_features == 4


def test_timm_corrupt_blob_is_refused(timm_server, cwd):
    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    blob = pretrained.fetch(w).resolve()
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    with pytest.raises(UserError, match=r"\(timm/resnet18.a1_in1k\) does not match its checksum"):
        pretrained.fetch(w)


def test_timm_offline_is_one_line_with_the_hub_command(cwd, monkeypatch):
    pytest.importorskip("timm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        pretrained.fetch(pretrained.resolve("timm/resnet18", "DEFAULT"))
    msg = str(err.value)
    assert "\n" not in msg and "timm/resnet18.a1_in1k/model.safetensors is not in .cache/huggingface/hub/" in msg
    assert "hf download timm/resnet18.a1_in1k model.safetensors" in msg


def test_timm_model_args_reach_create_model(cwd):
    pytest.importorskip("timm")
    model = models.build_model("timm/resnet18", 3, drop_rate=0.25)
    assert model.drop_rate == 0.25
    with pytest.raises(UserError, match="--model timm/resnet18 --model-args: .*nope"):
        models.build_model("timm/resnet18", 3, nope=1)


def test_no_download_without_pretrained(cwd, monkeypatch):
    """Building any model by name, timm's included, never touches the network."""
    import urllib.request

    def refuse(*a, **k):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    models.build_model("resnet18", 2)
    if pytest.importorskip("timm"):
        models.build_model("timm/resnet18", 2)
    assert not (Path.cwd() / ".cache").exists()


def test_val_normalizes_as_the_run_did(cwd):
    """`dlenv val`, prune and export read the weights' mean, std and resampling from the checkpoint's options."""
    pytest.importorskip("timm")
    vit = {"config": {"model": "timm/vit_tiny_patch16_224", "pretrained": "DEFAULT"}}
    assert pretrained.norm_of(vit) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert pretrained.norm_of({"config": {"model": "resnet18", "pretrained": None}}) is None
    assert pretrained.norm_of({"config": {"model": "resnet18", "pretrained": "NOPE"}}) is None
    assert pretrained.norm_of({"model": {}}) is None
    assert pretrained.interpolation_of(vit) == "bicubic" and pretrained.interpolation_of({"model": {}}) == "bilinear"


def test_timm_arguments_that_would_fetch_weights_are_refused(cwd):
    pytest.importorskip("timm")
    for key in ("pretrained", "checkpoint_path"):
        with pytest.raises(UserError, match=f"--model-args {key}=...: dlenv loads timm's weights itself; use "
                                            r"--pretrained \[TAG\]"):
            models.build_model("timm/resnet18", 2, model_args={key: "true"})


def test_a_timm_checkpoint_rebuilds_with_its_arguments_and_size(cwd):
    """val, prune and export rebuild a timm model with the run's --model-args and, for a ViT, its size."""
    pytest.importorskip("timm")
    from dlenv.files import runstate

    name = "timm/vit_tiny_patch16_224"
    model = models.build_model(name, 3, model_args={"img_size": 32, "depth": 2})
    ckpt = {"format": runstate.FORMAT, "model": model.state_dict(), "model_name": name, "num_classes": 3,
            "class_names": ["a", "b", "c"], "img_size": 32, "config": {"model": name, "model_args": "depth=2"}}
    rebuilt, classes, size = models.model_from_state(ckpt, source="x.pth")
    assert size == 32 and len(rebuilt.blocks) == 2 and rebuilt.patch_embed.img_size == (32, 32)
    ckpt["config"]["model_args"] = "depth=100000000"
    with pytest.raises(UserError, match="depth=100000000, beyond the bounds"):
        models.model_from_state(ckpt, source="x.pth")


# ---------------------------------------------------------------------------------------------------
# What a new user hit (issue 33, section 4): each cause named as it is, checksums never skipped


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_is_said_at_once_not_as_a_missing_file(cwd, monkeypatch, capsys):
    pytest.importorskip("timm")
    import huggingface_hub

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    # asked once, by dlenv: huggingface_hub's download retries a refused connection five times over ~23 s
    downloads: list = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **kw: downloads.append(a))
    with pytest.raises(UserError) as err:
        pretrained.fetch(pretrained.resolve("timm/resnet18", "DEFAULT"))
    msg = str(err.value)
    assert "\n" not in msg and "cannot be reached" in msg and "has no" not in msg, msg
    assert downloads == [], "huggingface_hub was asked, and its retries waited for"
    assert "Retrying" not in capsys.readouterr().err


def test_a_404_from_the_torchvision_mirror_says_the_mirror_lacks_the_file(resnet18_server, cwd, monkeypatch):
    path, _, _ = resnet18_server
    path.unlink()  # the server is up; the file is not there
    with pytest.raises(UserError) as err:
        pretrained.fetch(pretrained.resolve("resnet18", "DEFAULT"))
    msg = str(err.value)
    assert "\n" not in msg and "answered 404" in msg and "does not have" in msg and "cannot be reached" not in msg
    assert not any((cwd / ".cache" / "torch" / "hub" / "checkpoints").iterdir())


def test_a_downloaded_torchvision_file_is_readable_by_the_team(resnet18_server, cwd):
    import os
    import stat

    old = os.umask(0o022)
    try:
        got = pretrained.fetch(pretrained.resolve("resnet18", "DEFAULT"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(got.stat().st_mode) == 0o644


def test_a_download_is_one_line_in_a_log(resnet18_server, cwd, capsys):
    pretrained.fetch(pretrained.resolve("resnet18", "DEFAULT"), progress=False)
    err = capsys.readouterr().err
    assert "--pretrained: downloading http://127.0.0.1:" in err and "into .cache/torch/hub/checkpoints/" in err


def _as_plain_file(path: Path) -> Path:
    """What a filesystem without symlinks (or `cp -r`) leaves: the snapshot entry a copy, not a link."""
    blob = path.resolve()
    path.unlink()
    path.write_bytes(blob.read_bytes())
    return blob


@pytest.mark.parametrize("case, keep_blob, record, change, want", [
    ("a cp -r copy: its blob is there", True, False, False, None),
    ("a cp -r copy, changed", True, False, True, "nothing in the cache records"),
    ("no symlinks, downloaded by dlenv", False, True, False, None),
    ("no symlinks, downloaded by dlenv, changed", False, True, True, "does not match its checksum"),
    ("a plain file nothing vouches for", False, False, False, "nothing in the cache records"),
])
def test_a_hub_file_that_is_a_plain_file_is_still_checked(timm_server, cwd, case, keep_blob, record, change, want):
    from dlenv.model import hubcache

    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    path = pretrained.fetch(w)
    blob = _as_plain_file(path)
    if not keep_blob:
        blob.unlink()
    if record:
        hubcache.record(path, pretrained.hf_cache())
    if change:
        path.write_bytes(path.read_bytes()[:-1] + b"\0")
    if want is None:
        assert pretrained.fetch(w) == path
    else:
        with pytest.raises(UserError, match=want) as err:
            pretrained.fetch(w)
        assert "\n" not in str(err.value)


def test_timm_says_the_head_starts_fresh(timm_server, cwd, caplog):
    import logging

    w = pretrained.resolve("timm/resnet18", "DEFAULT")
    state = pretrained.fetched_state_dict(w, pretrained.fetch(w))
    with caplog.at_level(logging.WARNING):
        pretrained.timm_model("timm/resnet18", 4, state, {})
    said = [r.getMessage() for r in caplog.records]
    assert any("fc.weight" in m and "has 1000 classes, the data has 4; it starts fresh" in m for m in said), said
