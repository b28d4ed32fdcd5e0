"""dlenv.data.pipeline: every input decision once (locate, workers, path, decoder, cache), and the loaders
and data it builds from the plan, on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from imagedata import make_image_folder, make_photo_layout

from dlenv.data import decode, demo, pipeline
from dlenv.data.fastpath import DeviceLoader
from dlenv.data.loaders import SafeLoader
from dlenv.data.pipeline import InputOptions, InputPlan
from dlenv.distributed import DistInfo
from dlenv.errors import UserError


@pytest.fixture
def photos(tmp_path):
    return pipeline.locate(str(make_photo_layout(tmp_path / "ds", 10, 4, 2, lambda i: (30 + 2 * i, 24))))


def test_locate_a_folder_synthetic_data_or_refuse(tmp_path):
    located = pipeline.locate(str(make_image_folder(tmp_path / "photos")))
    assert located.classes == ["cat", "dog"] and not located.demo and located.img_size == 20  # 24x20 images
    synthetic = pipeline.locate(None, synthetic=True)
    assert synthetic.layout is None and len(synthetic.classes) == 1000 and synthetic.source == "synthetic"
    with pytest.raises(UserError, match="--data /no/such: no such folder"):
        pipeline.locate("/no/such")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images found under"):
        pipeline.locate(str(tmp_path / "empty"))


def test_input_options_pick_the_path():
    assert InputOptions().gpu_path("cuda") and not InputOptions().gpu_path("cpu")
    assert InputOptions(cache=True).gpu_path("cpu") and InputOptions(gpu_augment="on").gpu_path("cpu")
    assert InputOptions(decoder="nvjpeg").gpu_path("cpu")
    assert not InputOptions(gpu_augment="off").gpu_path("cuda")


def test_input_options_of_a_config_takes_the_fields_it_has():
    from dlenv import config

    cfg = config.build(config.TrainConfig, decoder="pil", cache=True, workers=3, bad_images="error")
    assert InputOptions.of(cfg) == InputOptions(decoder="pil", cache="on", workers=3, bad_images="error")
    bench = config.build(config.BenchDataConfig, gpu_augment="off")
    assert InputOptions.of(bench).gpu_augment == "off"


@pytest.mark.parametrize("workers,local,expected", [(12, 4, 3), (2, 8, 1), (0, 8, 0), (5, 1, 5)])
def test_workers_are_shared_between_the_processes_of_a_node(workers, local, expected):
    assert pipeline.workers_per_process(workers, local) == expected


@pytest.mark.parametrize("opts,local,expected", [
    (dict(workers=3), 1, dict(workers=3, on_device=False, cache_mode="auto")),
    (dict(workers=3), 4, dict(workers=3)),  # a number given is kept, however many processes share the node
    (dict(workers=0, gpu_augment="on"), 1, dict(workers=0, on_device=True)),
    (dict(workers=0, cache=True), 2, dict(on_device=True, cache=True, cache_mode="disk")),  # one file, shared
    (dict(workers=0, cache=True, cache_mode="ram"), 2, dict(cache_mode="ram")),
    (dict(workers=0, decoder="cv2"), 1, dict(decoder="cv2", cpu_decoder="cv2")),
])
def test_decide_resolves_every_option_to_a_plain_value(photos, opts, local, expected):
    plan = pipeline.decide(InputOptions(**opts), photos, "cpu", 4, 16, local_world_size=local)
    assert plan.img_size == 16 and plan.batch_size == 4 and plan.train_scale == pipeline.PHOTO_TRAIN_SCALE
    for k, v in expected.items():
        assert getattr(plan, k) == v, k


def test_decide_auto_workers_are_shared_and_nvjpeg_has_a_cpu_fallback(photos, monkeypatch):
    monkeypatch.setattr(pipeline, "resolve_workers", lambda workers, batch, size, **kw: 12)
    assert pipeline.decide(InputOptions(), photos, "cpu", 4, 16, local_world_size=4).workers == 3
    monkeypatch.setattr(decode, "resolve_decoder", lambda *a, **k: "nvjpeg")
    plan = pipeline.decide(InputOptions(), photos, "cpu", 4, 16)
    # the cache and the classic path cannot decode with nvJPEG: the best CPU decoder, chosen here once
    assert plan.decoder == "nvjpeg" and plan.cpu_decoder in decode.CPU_DECODERS


def test_decide_sizes_shared_memory_by_what_the_workers_ship(photos, monkeypatch):
    """uint8 stored squares on the device path (a third of the classic path's float32 crops)."""
    seen = []
    monkeypatch.setattr(pipeline, "resolve_workers",
                        lambda workers, batch, size, **kw: seen.append(kw.get("sample_bytes")) or 2)
    pipeline.decide(InputOptions(gpu_augment="on"), photos, "cpu", 4, 16)
    pipeline.decide(InputOptions(gpu_augment="off"), photos, "cpu", 4, 16)
    side = decode.stored_size(16)
    assert seen == [3 * side * side, None]  # None: resolve_workers' float32 3 x 16 x 16 x 4


def test_decide_for_the_demo_and_for_synthetic_data(tmp_path):
    root = demo.ensure_demo_data(tmp_path / "demo", train_per_class=2, val_per_class=1)
    plan = pipeline.decide(InputOptions(workers=0), pipeline.locate(str(root)), "cpu", 4, 64)
    # --augment auto is light there: its shapes fill most of a small image
    assert (plan.augment, plan.train_scale, plan.hflip) == ("light", pipeline.AUGMENT_PRESETS["light"][0], True)
    synthetic = pipeline.decide(InputOptions(), pipeline.locate(None, synthetic=True), "cpu", 4, 16)
    assert synthetic.workers == 0 and synthetic.decoder == pipeline.SYNTHETIC
    assert "synthetic" in synthetic.describe("cpu")


def test_make_loaders_follows_the_plan(photos):
    plan = pipeline.decide(InputOptions(workers=0, gpu_augment="off"), photos, "cpu", 4, 16)
    train, val = pipeline.make_loaders(photos.layout, plan, "cpu")
    assert isinstance(train, SafeLoader) and isinstance(val, SafeLoader)
    assert "augmentation on the workers" in plan.describe("cpu")
    on_device = dataclasses.replace(plan, on_device=True)
    train, val = pipeline.make_loaders(photos.layout, on_device, "cpu", dtype=torch.bfloat16)
    x, y = next(iter(train))
    assert isinstance(train, DeviceLoader) and x.shape == (4, 3, 16, 16) and x.dtype == torch.bfloat16
    assert "augmentation on cpu" in on_device.describe("cpu")


def test_nvjpeg_needs_a_gpu(photos):
    plan = InputPlan(16, 4, on_device=True, decoder="nvjpeg", cpu_decoder="pil", workers=0)
    with pytest.raises(UserError, match="--decoder nvjpeg: the device is not a GPU; use --decoder auto"):
        pipeline.make_loaders(photos.layout, plan, "cpu")


@pytest.mark.parametrize("gpu_augment", ["off", "on"])
def test_build_data_gives_each_rank_its_shard(photos, gpu_augment):
    """Two ranks: each trains on half the training set, and their val shards cover every image once."""
    plan = pipeline.decide(InputOptions(workers=0, gpu_augment=gpu_augment), photos, "cpu", 2, 16)
    ranks = [pipeline.build_data(photos, plan, "cpu", DistInfo(rank=r, world_size=2), seed=1) for r in (0, 1)]
    # 5 each in batches of 2 would end in a batch of one: that index is left out on every rank
    assert [d.sampler.per_rank for d in ranks] == [4, 4] and [len(d.train) for d in ranks] == [2, 2]
    val = [int(y) for d in ranks for _, ys in d.val for y in ys]
    assert sorted(val) == sorted(y for _, y in photos.layout.val)


def test_build_data_for_synthetic_data():
    located = pipeline.locate(None, synthetic=True)
    plan = pipeline.decide(InputOptions(), located, "cpu", 2, 16)
    data = pipeline.build_data(located, plan, "cpu", DistInfo(), max_steps=3)
    assert data.sampler is None and len(data.train) == 3 and next(iter(data.train))[0].shape == (2, 3, 16, 16)


@pytest.mark.parametrize("opts,expected", [
    ({}, ("standard", pipeline.PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), True)),  # photos: torchvision's crops
    (dict(augment="light"), ("light", (0.5, 1.0), (0.9, 1.1), True)),
    (dict(augment="none"), ("none", (1.0, 1.0), (1.0, 1.0), False)),  # the whole image, never mirrored
    (dict(hflip=False), ("standard", pipeline.PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), False)),  # an old config.yaml
    (dict(hflip="off"), ("standard", pipeline.PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), False)),
    (dict(augment="none", hflip="on"), ("none", (1.0, 1.0), (1.0, 1.0), False)),
    (dict(crop_scale=(0.35, 1.0)), ("standard", (0.35, 1.0), (3 / 4, 4 / 3), True)),
])
def test_augment_options_resolve_once_into_the_plan(photos, opts, expected):
    plan = pipeline.decide(InputOptions(workers=0, **opts), photos, "cpu", 4, 16)
    assert (plan.augment, plan.train_scale, plan.train_ratio, plan.hflip) == expected
    assert plan.augment in plan.describe("cpu") and ("no flips" in plan.describe("cpu")) == (not expected[3])


@pytest.mark.parametrize("choice,classes,preset,flips,says", [
    ("auto", ["cat", "dog"], "standard", True, "auto: on"),
    ("auto", list("0123456789"), "standard", False, "the classes look like characters (0, 1, 2, 3, 4, 5, ...)"),
    ("auto", ["b", "d", "cat"], "light", False, "characters (b, d)"),  # most of the names: the report's rule
    ("auto", ["a", "cat", "dog"], "standard", True, "auto: on"),  # one character name of three is no script
    ("on", list("0123456789"), "standard", True, "--hflip on"),  # asked for: taken as given
    (True, list("0123456789"), "standard", True, "--hflip on"),  # hflip: true in a config.yaml from before auto
    ("off", ["cat", "dog"], "standard", False, "--hflip off"),
    (False, ["cat", "dog"], "standard", False, "--hflip off"),
    ("on", ["cat", "dog"], "none", False, "--augment none"),  # the whole image, as validation sees it
])
def test_decide_hflip_follows_the_dataset_reports_rule(choice, classes, preset, flips, says):
    from dlenv.data.report import flip_hint

    got, why = pipeline.decide_hflip(choice, classes, preset)
    assert got is flips and says in why and "\n" not in why
    if choice == "auto":  # the report warns exactly where auto turns the flips off
        assert flip_hint(classes).startswith("warning") is (not flips)


def test_hflip_auto_turns_flips_off_for_digits_in_the_plan_and_its_line(tmp_path):
    digits = pipeline.locate(str(make_image_folder(tmp_path / "digits", classes=tuple("0123456789"), per_class=1)))
    plan = pipeline.decide(InputOptions(workers=0), digits, "cpu", 4, 16)
    assert not plan.hflip and plan.hflip_why.startswith("auto: off") and "no flips" in plan.describe("cpu")
    flipped = pipeline.decide(InputOptions(workers=0, hflip="on"), digits, "cpu", 4, 16)
    assert flipped.hflip and flipped.hflip_why == "--hflip on" and "no flips" not in flipped.describe("cpu")


@pytest.mark.parametrize("argv,want", [
    ([], "auto"), (["--hflip"], "on"), (["--no-hflip"], "off"), (["--hflip", "off"], "off"),
    (["--hflip", "auto"], "auto"), (["--hflip", "on"], "on"), (["--hflip", "false"], "off"),
])
def test_hflip_spellings_on_the_command_line(argv, want):
    from dlenv import config
    from dlenv.cli import build_parser

    ns = vars(build_parser().parse_args(["train", *argv]))
    assert config.build(config.TrainConfig, **{k: v for k, v in ns.items() if k == "hflip"}).hflip == want


def test_a_bad_hflip_is_one_line_naming_the_flag():
    from dlenv import config

    with pytest.raises(UserError, match="--hflip 'sometimes': expected auto, on or off") as e:
        config.build(config.TrainConfig, hflip="sometimes")
    assert "\n" not in str(e.value)


def test_no_hflip_reaches_both_augmentation_paths():
    from dlenv.data.gpu_aug import GpuAugment
    from dlenv.data.loaders import build_transforms

    names = [type(t).__name__ for t in build_transforms(16, True, hflip=False).transforms]
    assert "RandomHorizontalFlip" not in names and "RandomResizedCrop" in names
    assert "RandomHorizontalFlip" in [type(t).__name__ for t in build_transforms(16, True).transforms]
    sizes = torch.tensor([[20, 20]] * 64)
    assert GpuAugment(16, True, hflip=False).boxes(sizes, seed=1)[:, 4].sum() == 0
    assert GpuAugment(16, True).boxes(sizes, seed=1)[:, 4].sum() > 0


@pytest.mark.parametrize("size,expected,capped", [((32, 32), 32, False), ((40, 30), 30, False),
                                                   ((400, 300), 224, True)])
def test_img_size_auto_is_the_typical_size_capped_for_speed(tmp_path, size, expected, capped):
    located = pipeline.locate(str(make_image_folder(tmp_path / "ds", size=size)))
    value, why = pipeline.auto_img_size(located)
    assert value == expected and located.img_size == expected
    assert f"typical shorter side is {min(size)} px" in why and ("capped at 224" in why) == capped


@pytest.mark.parametrize("cache,device,decoder,avail_gib,want", [
    ("auto", "cuda", "auto", 64, True),     # a small dataset on the GPU path: decoded once
    ("auto", "cpu", "auto", 64, False),     # the CPU path (torchvision transforms): as before
    ("auto", "cuda", "auto", 0.0001, False),  # more than 1/8 of the free memory: streamed
    ("auto", "cuda", "nvimgcodec", 64, False),  # a GPU decoder named: the user wants it
    ("auto", "cuda", "nvjpeg", 64, False),
    ("off", "cuda", "auto", 64, False), (False, "cuda", "auto", 64, False),
    ("on", "cpu", "auto", 0.0001, True), (True, "cuda", "auto", 0.0001, True),
])
def test_cache_auto_decodes_small_datasets_once(photos, monkeypatch, cache, device, decoder, avail_gib, want):
    from dlenv.data import cache as cache_mod

    monkeypatch.setattr(cache_mod, "available_memory", lambda: int(avail_gib * 2**30))
    monkeypatch.setattr(decode, "resolve_decoder", lambda name, *a, **k: "pil" if name == "auto" else name)
    opts = InputOptions(cache=cache, decoder=decoder, workers=0)
    on_device = opts.gpu_path(device)
    got, why = pipeline.decide_cache(opts, photos.layout, on_device, decode.stored_size(16))
    assert got is want
    assert bool(why) == (want and cache == "auto"), why  # said once, only when auto chose it
    if why:
        assert "14 images" in why and "--cache off" in why


def test_cache_auto_has_a_ceiling(photos, monkeypatch):
    from dlenv.data import cache as cache_mod

    monkeypatch.setattr(cache_mod, "available_memory", lambda: 1 << 50)  # any amount free
    monkeypatch.setattr(cache_mod, "nbytes", lambda n, size: pipeline.AUTO_CACHE_MAX_BYTES + 1)
    assert pipeline.decide_cache(InputOptions(), photos.layout, True, 32) == (False, "")


def test_plan_says_why_it_decodes_once(photos, monkeypatch):
    monkeypatch.setattr(decode, "resolve_decoder", lambda *a, **k: "pil")
    plan = pipeline.decide(InputOptions(gpu_augment="on"), photos, "cpu", 4, 16)
    assert plan.cache and plan.cache_why
    line = plan.describe("cpu")
    assert line.startswith("input: decoded once into memory, augmentation on cpu") and "--cache off" in line
    plan = pipeline.decide(InputOptions(gpu_augment="on", cache="off", workers=0), photos, "cpu", 4, 16)
    assert not plan.cache and "decoder pil" in plan.describe("cpu") and "0 workers" in plan.describe("cpu")


@pytest.mark.parametrize("given,want", [({}, "auto"), ({"cache": True}, "on"), ({"cache": "true"}, "on"),
                                        ({"cache": "off"}, "off"), ({"cache": False}, "off"),
                                        ({"cache": "auto"}, "auto")])
def test_cache_option_reads_old_and_new_spellings(given, want):
    from dlenv import config

    assert config.build(config.TrainConfig, **given).cache == want


def test_cache_option_refuses_other_values():
    from dlenv import config

    with pytest.raises(UserError, match="--cache"):
        config.build(config.TrainConfig, cache="sometimes")
