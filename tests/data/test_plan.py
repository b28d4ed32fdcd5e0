"""dlenv.data.plan: every input decision once (workers, path, decoder and its backends, cache and its mode,
augmentation, flips), into a frozen plan of plain values, built without side effects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from imagedata import make_image_folder, make_photo_layout, photo
from PIL import Image

from dlenv.data import decode, demo, hwdecode, pipeline
from dlenv.data.plan import (
    AUGMENT_PRESETS,
    AUTO_CACHE_MAX_BYTES,
    AUTO_DECODER,
    CHARACTER_CROPS,
    ENGINE_BACKENDS,
    NVJPEG_BELOW_WORKERS,
    PHOTO_TRAIN_SCALE,
    SYNTHETIC,
    InputOptions,
    decide_augment,
    decide_cache,
    decide_hflip,
    mean_pixels,
    pick_decoder,
    prefer_engines,
    prefer_nvjpeg,
    resolve_decoder,
    workers_per_process,
)
from dlenv.errors import UserError


@pytest.fixture
def photos(tmp_path):
    return pipeline.locate(str(make_photo_layout(tmp_path / "ds", 10, 4, 2, lambda i: (30 + 2 * i, 24))))


def test_input_options_pick_the_path():
    assert InputOptions().gpu_path("cuda") and not InputOptions().gpu_path("cpu")
    assert InputOptions(cache=True).gpu_path("cpu") and InputOptions(gpu_augment="on").gpu_path("cpu")
    assert InputOptions(decoder="nvjpeg").gpu_path("cpu")
    assert not InputOptions(gpu_augment="off").gpu_path("cuda")


def test_input_options_of_a_config_takes_the_fields_it_has():
    from dlenv.options import config

    cfg = config.build(config.TrainConfig, decoder="pil", cache=True, workers=3, bad_images="error")
    assert InputOptions.of(cfg) == InputOptions(decoder="pil", cache="on", workers=3, bad_images="error")
    bench = config.build(config.BenchDataConfig, gpu_augment="off")
    assert InputOptions.of(bench).gpu_augment == "off"
    # the run's seed (order and crops) and epochs (where the workers stop decoding ahead) reach the plan
    run = InputOptions.of(config.build(config.TrainConfig, seed=7, epochs=3))
    assert (run.seed, run.epochs) == (7, 3)
    plan = run.decide(pipeline.locate(None, synthetic=True), "cpu", 2, 16)
    assert (plan.seed, plan.epochs, plan.cache_mode, plan.workers) == (7, 3, "off", 0)


@pytest.mark.parametrize("workers,local,expected", [(12, 4, 3), (2, 8, 1), (0, 8, 0), (5, 1, 5)])
def test_workers_are_shared_between_the_processes_of_a_node(workers, local, expected):
    assert workers_per_process(workers, local) == expected


@pytest.mark.parametrize("opts,local,expected", [
    (dict(workers=3), 1, dict(workers=3, on_device=False, cache_mode="off")),
    (dict(workers=3), 4, dict(workers=3)),  # a number given is kept, however many processes share the node
    (dict(workers=0, gpu_augment="on"), 1, dict(workers=0, on_device=True)),
    (dict(workers=0, cache=True), 2, dict(on_device=True, cache=True, cache_mode="disk")),  # one file, shared
    (dict(workers=0, cache=True, cache_mode="ram"), 2, dict(cache_mode="ram")),
    (dict(workers=0, decoder="cv2"), 1, dict(decoder="cv2", cpu_decoder="cv2")),
])
def test_decide_resolves_every_option_to_a_plain_value(photos, opts, local, expected):
    plan = InputOptions(**opts).decide(photos, "cpu", 4, 16, local_world_size=local)
    assert plan.img_size == 16 and plan.batch_size == 4 and plan.train_scale == PHOTO_TRAIN_SCALE
    for k, v in expected.items():
        assert getattr(plan, k) == v, k


def test_decide_auto_workers_are_shared_and_nvjpeg_has_a_cpu_fallback(photos, monkeypatch):
    monkeypatch.setattr("dlenv.data.plan.decide_workers", lambda workers, batch, size, **kw: (12, ""))
    assert InputOptions().decide(photos, "cpu", 4, 16, local_world_size=4).workers == 3
    monkeypatch.setattr("dlenv.data.plan.resolve_decoder", lambda *a, **k: "nvjpeg")
    monkeypatch.setattr("dlenv.data.plan.gpu_unavailable", lambda decoder, device: None)
    plan = InputOptions().decide(photos, "cpu", 4, 16)
    # the cache and the classic path cannot decode with nvJPEG: the best CPU decoder, chosen here once
    assert plan.decoder == "nvjpeg" and plan.cpu_decoder in decode.CPU_DECODERS


def test_decide_sizes_shared_memory_by_what_the_workers_ship(photos, monkeypatch):
    """uint8 stored squares on the device path (a third of the classic path's float32 crops)."""
    seen = []
    monkeypatch.setattr("dlenv.data.plan.decide_workers",
                        lambda workers, batch, size, **kw: seen.append(kw.get("sample_bytes")) or (2, ""))
    InputOptions(gpu_augment="on").decide(photos, "cpu", 4, 16)
    InputOptions(gpu_augment="off").decide(photos, "cpu", 4, 16)
    side = decode.stored_size(16)
    assert seen == [3 * side * side, None]  # None: decide_workers' float32 3 x 16 x 16 x 4


def test_decide_for_the_demo_and_for_synthetic_data(tmp_path):
    root = demo.ensure_demo_data(tmp_path / "demo", train_per_class=2, val_per_class=1)
    plan = InputOptions(workers=0).decide(pipeline.locate(str(root)), "cpu", 4, 64)
    # --augment auto is light there: its shapes fill most of a small image
    assert (plan.augment, plan.train_scale, plan.hflip) == ("light", AUGMENT_PRESETS["light"][0], True)
    synthetic = InputOptions().decide(pipeline.locate(None, synthetic=True), "cpu", 4, 16)
    assert synthetic.workers == 0 and synthetic.decoder == SYNTHETIC
    assert "synthetic" in synthetic.describe("cpu")


@pytest.mark.parametrize("decoder", ["nvjpeg", "nvimgcodec"])
def test_a_gpu_decoder_is_checked_once_while_planning(photos, decoder):
    with pytest.raises(UserError, match=f"--decoder {decoder}: the device is not a GPU; use --decoder auto") as e:
        InputOptions(decoder=decoder, workers=0).decide(photos, "cpu", 4, 16)
    assert "\n" not in str(e.value)
    cached = InputOptions(decoder=decoder, cache="on", cache_mode="ram", workers=0).decide(photos, "cpu", 4, 16)
    assert cached.cache and cached.source == "cache"  # the cache decodes on the CPU: no GPU needed


@pytest.mark.parametrize("opts,expected", [
    ({}, ("standard", PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), True)),  # photos: torchvision's crops
    (dict(augment="light"), ("light", (0.5, 1.0), (0.9, 1.1), True)),
    (dict(augment="none"), ("none", (1.0, 1.0), (1.0, 1.0), False)),  # the whole image, never mirrored
    (dict(hflip=False), ("standard", PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), False)),  # an old config.yaml
    (dict(hflip="off"), ("standard", PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3), False)),
    (dict(augment="none", hflip="on"), ("none", (1.0, 1.0), (1.0, 1.0), False)),
    (dict(crop_scale=(0.35, 1.0)), ("standard", (0.35, 1.0), (3 / 4, 4 / 3), True)),
])
def test_augment_options_resolve_once_into_the_plan(photos, opts, expected):
    plan = InputOptions(workers=0, **opts).decide(photos, "cpu", 4, 16)
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

    got, why = decide_hflip(choice, classes, preset)
    assert got is flips and says in why and "\n" not in why
    if choice == "auto":  # the report warns exactly where auto turns the flips off
        assert flip_hint(classes).startswith("warning") is (not flips)


@pytest.mark.parametrize("opts,classes,expected,says", [
    ({}, list("0123456789"), ("light", CHARACTER_CROPS[0], CHARACTER_CROPS[1]), "look like characters (0, 1, 2"),
    ({}, ["b", "d", "cat"], ("light", CHARACTER_CROPS[0], CHARACTER_CROPS[1]), "characters (b, d)"),
    ({}, ["cat", "dog"], ("standard", PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3)), "auto: standard"),
    (dict(augment="standard"), list("0123456789"), ("standard", PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3)),
     "--augment standard"),                                   # asked for: taken as given
    (dict(crop_scale=(0.5, 1.0)), list("0123"), ("light", (0.5, 1.0), CHARACTER_CROPS[1]), "--crop-scale 0.5 1"),
])
def test_auto_crops_keep_character_like_images_readable(opts, classes, expected, says):
    preset, scale, ratio, why = decide_augment(InputOptions(**opts), False, classes)
    assert (preset, scale, ratio) == expected and says in why
    assert scale[0] >= 0.5 or "characters" not in why  # never the photo crops of a few percent for a glyph


def test_the_plan_of_a_digit_dataset_picks_the_gentle_crops_and_says_so(tmp_path):
    digits = pipeline.locate(str(make_image_folder(tmp_path / "digits", classes=tuple("0123456789"), per_class=1)))
    plan = InputOptions(workers=0).decide(digits, "cpu", 4, 16)
    assert (plan.train_scale, plan.train_ratio) == CHARACTER_CROPS
    assert "characters" in plan.augment_why and "crops 80%-100%" in plan.describe("cpu")


def test_hflip_auto_turns_flips_off_for_digits_in_the_plan_and_its_line(tmp_path):
    digits = pipeline.locate(str(make_image_folder(tmp_path / "digits", classes=tuple("0123456789"), per_class=1)))
    plan = InputOptions(workers=0).decide(digits, "cpu", 4, 16)
    assert not plan.hflip and plan.hflip_why.startswith("auto: off") and "no flips" in plan.describe("cpu")
    flipped = InputOptions(workers=0, hflip="on").decide(digits, "cpu", 4, 16)
    assert flipped.hflip and flipped.hflip_why == "--hflip on" and "no flips" not in flipped.describe("cpu")


@pytest.mark.parametrize("argv,want", [
    ([], "auto"), (["--hflip"], "on"), (["--no-hflip"], "off"), (["--hflip", "off"], "off"),
    (["--hflip", "auto"], "auto"), (["--hflip", "on"], "on"), (["--hflip", "false"], "off"),
])
def test_hflip_spellings_on_the_command_line(argv, want):
    from dlenv.cli import build_parser
    from dlenv.options import config

    ns = vars(build_parser().parse_args(["train", *argv]))
    assert config.build(config.TrainConfig, **{k: v for k, v in ns.items() if k == "hflip"}).hflip == want


def test_a_bad_hflip_is_one_line_naming_the_flag():
    from dlenv.options import config

    with pytest.raises(UserError, match="--hflip 'sometimes': expected auto, on or off") as e:
        config.build(config.TrainConfig, hflip="sometimes")
    assert "\n" not in str(e.value)


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
    monkeypatch.setattr("dlenv.data.plan.resolve_decoder", lambda name, *a, **k: "pil" if name == "auto" else name)
    opts = InputOptions(cache=cache, decoder=decoder, workers=0)
    on_device = opts.gpu_path(device)
    got, why = decide_cache(opts, photos.layout, on_device, decode.stored_size(16))
    assert got is want
    assert bool(why) == (want and cache == "auto"), why  # said once, only when auto chose it
    if why:
        assert "14 images" in why and "--cache off" in why


def test_cache_auto_has_a_ceiling(photos, monkeypatch):
    from dlenv.data import cache as cache_mod

    monkeypatch.setattr(cache_mod, "available_memory", lambda: 1 << 50)  # any amount free
    monkeypatch.setattr(cache_mod, "nbytes", lambda n, size: AUTO_CACHE_MAX_BYTES + 1)
    assert decide_cache(InputOptions(), photos.layout, True, 32) == (False, "")


def test_plan_says_why_it_decodes_once(photos, monkeypatch):
    monkeypatch.setattr("dlenv.data.plan.resolve_decoder", lambda *a, **k: "pil")
    plan = InputOptions(gpu_augment="on").decide(photos, "cpu", 4, 16)
    assert plan.cache and plan.cache_why
    line = plan.describe("cpu")
    assert line.startswith("input: decoded once into memory, augmentation on cpu") and "--cache off" in line
    plan = InputOptions(gpu_augment="on", cache="off", workers=0).decide(photos, "cpu", 4, 16)
    assert not plan.cache and "decoder pil" in plan.describe("cpu") and "0 workers" in plan.describe("cpu")


@pytest.mark.parametrize("given,want", [({}, "auto"), ({"cache": True}, "on"), ({"cache": "true"}, "on"),
                                        ({"cache": "off"}, "off"), ({"cache": False}, "off"),
                                        ({"cache": "auto"}, "auto")])
def test_cache_option_reads_old_and_new_spellings(given, want):
    from dlenv.options import config

    assert config.build(config.TrainConfig, **given).cache == want


def test_cache_option_refuses_other_values():
    from dlenv.options import config

    with pytest.raises(UserError, match="--cache"):
        config.build(config.TrainConfig, cache="sometimes")


# --------------------------------------------------------------------------- the decoder


def test_resolve_and_pick(tmp_path):
    assert resolve_decoder("cv2") == "cv2" and resolve_decoder("nvjpeg") == "nvjpeg"
    assert resolve_decoder("auto") == AUTO_DECODER
    with pytest.raises(UserError, match="--decoder 'jpeg'"):
        resolve_decoder("jpeg")
    files = [str(photo(tmp_path / f"{i}.jpg", seed=i)) for i in range(4)]
    assert pick_decoder(files, 32) in decode.CPU_DECODERS
    assert resolve_decoder("auto", files, 32) in decode.CPU_DECODERS
    Image.new("RGB", (8, 8)).save(tmp_path / "p.png")
    assert pick_decoder([str(tmp_path / "p.png")] * 4, 32) == AUTO_DECODER


def test_auto_decodes_on_the_gpu_only_for_jpegs_on_cuda(tmp_path, monkeypatch):
    from dlenv import compat

    files = [str(photo(tmp_path / f"{i}.jpg", seed=i)) for i in range(4)]
    assert not prefer_nvjpeg(files, "cpu")
    assert resolve_decoder("auto", files, 32, gpu="cpu") in decode.CPU_DECODERS
    # a CUDA device whose torchvision batch-decodes: JPEGs go to nvJPEG, a folder of PNGs does not
    import types

    gib = 2**30
    card = types.SimpleNamespace(total_memory=80 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: card)
    monkeypatch.setattr(compat, "cuda_jpeg_batch_decode", lambda: True)
    monkeypatch.setattr(compat, "cuda_jpeg_unavailable", lambda device="cuda": None)
    assert resolve_decoder("auto", files, 32, gpu="cuda") == "nvjpeg"
    assert resolve_decoder("auto", files, 32) in decode.CPU_DECODERS  # augmentation on the CPU: no GPU
    # nvJPEG takes the model's GPU time: with enough workers the CPU decoders train faster
    few, enough = NVJPEG_BELOW_WORKERS - 1, NVJPEG_BELOW_WORKERS
    assert resolve_decoder("auto", files, 32, gpu="cuda", workers=few) == "nvjpeg"
    assert resolve_decoder("auto", files, 32, gpu="cuda", workers=enough) in decode.CPU_DECODERS
    assert resolve_decoder("auto", files, 32, gpu="cuda", workers=0) == "nvjpeg"
    Image.new("RGB", (8, 8)).save(tmp_path / "p.png")
    assert not prefer_nvjpeg(files[:2] + [str(tmp_path / "p.png")] * 2, "cuda")
    # a decoded batch must stay small beside training: 120x90 photos x 256 x 18 B = 50 MB
    assert mean_pixels(files) == 120 * 90
    card.total_memory = 2 * gib  # 5% of it is 100 MB: fits
    assert prefer_nvjpeg(files, "cuda", batch=256)
    card.total_memory = gib // 2  # 25 MB: the CPU decoders (reduced-size decoding) instead
    assert not prefer_nvjpeg(files, "cuda", batch=256)
    assert resolve_decoder("auto", files, 32, gpu="cuda", batch=256) in decode.CPU_DECODERS
    monkeypatch.setattr(compat, "cuda_jpeg_batch_decode", lambda: False)  # torchvision < 0.19 (1.13 image)
    assert resolve_decoder("auto", files, 32, gpu="cuda") in decode.CPU_DECODERS


@pytest.mark.gpu
def test_auto_on_cuda_prefers_the_jpeg_engines_then_nvjpeg_then_the_cpu(tmp_path):
    """The order resolve_decoder documents: nvImageCodec on the JPEG engines where they and the library are
    there; else torchvision's batch decode on CUDA where it works; else a CPU decoder."""
    from dlenv import compat

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    files = [str(photo(tmp_path / f"{i}.jpg", seed=i)) for i in range(4)]
    got = resolve_decoder("auto", files, 32, gpu="cuda", workers=2)
    engines = prefer_engines(files, "cuda", 256, 2)
    nvjpeg = compat.cuda_jpeg_batch_decode() and compat.cuda_jpeg_unavailable("cuda") is None
    want = "nvimgcodec" if engines else "nvjpeg" if nvjpeg else None
    assert got == want if want else got in decode.CPU_DECODERS, (got, engines, nvjpeg)


def test_auto_takes_the_engines_with_few_cores_only(tmp_path, monkeypatch):
    import types

    from dlenv import compat

    files = [str(photo(tmp_path / f"{i}.jpg", seed=i)) for i in range(4)]
    card = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: card)
    monkeypatch.setattr(compat, "cuda_jpeg_batch_decode", lambda: True)
    monkeypatch.setattr(compat, "cuda_jpeg_unavailable", lambda device="cuda": None)
    engines = {"on": True}
    monkeypatch.setattr(hwdecode, "has_engines", lambda device: engines["on"])
    few, enough = NVJPEG_BELOW_WORKERS - 1, NVJPEG_BELOW_WORKERS
    cases = [  # (engines, workers, decoder auto picks)
        (True, few, "nvimgcodec"), (True, 0, "nvimgcodec"), (True, enough, None),
        (False, few, "nvjpeg"), (False, enough, None),
    ]
    for on, workers, want in cases:
        engines["on"] = on
        got = resolve_decoder("auto", files, 32, gpu="cuda", workers=workers)
        assert got == want if want else got in decode.CPU_DECODERS, (on, workers, got)
    engines["on"] = True
    assert resolve_decoder("auto", files, 32, workers=few) in decode.CPU_DECODERS  # no GPU path
    Image.new("RGB", (8, 8)).save(tmp_path / "p.png")
    assert not prefer_engines([str(tmp_path / "p.png")] * 4, "cuda", workers=few)  # PNGs
    assert resolve_decoder("nvimgcodec") == "nvimgcodec"
    with pytest.raises(Exception, match="nvimgcodec"):
        resolve_decoder("nvimgcodecs")


def test_nvimgcodec_backends_are_the_plans_engines_and_cpu_where_the_gpu_has_engines(photos, monkeypatch):
    """Decided once: the source only takes what the plan says (tests/data/test_sources.py)."""
    engines = {"on": True}
    monkeypatch.setattr(hwdecode, "unavailable", lambda device: None)
    monkeypatch.setattr(hwdecode, "has_engines", lambda device: engines["on"])
    plan = InputOptions(decoder="nvimgcodec", workers=0).decide(photos, "cuda", 4, 16)
    assert plan.source == "nvimgcodec" and plan.gpu_backends == ENGINE_BACKENDS == ("HW_GPU_ONLY", "CPU_ONLY")
    engines["on"] = False  # nvImageCodec on a GPU without engines: every backend
    assert InputOptions(decoder="nvimgcodec", workers=0).decide(photos, "cuda", 4, 16).gpu_backends == ()
    monkeypatch.setattr(hwdecode, "unavailable", lambda device: "nvImageCodec is not installed (ImportError)")
    with pytest.raises(UserError, match="--decoder nvimgcodec: nvImageCodec is not installed .*; use --decoder auto"):
        InputOptions(decoder="nvimgcodec", workers=0).decide(photos, "cuda", 4, 16)


# --------------------------------------------------------------------------- the cache's mode


@pytest.mark.parametrize("mode,local,on_disk,avail_gib,want", [
    ("ram", 4, True, 0, "ram"), ("disk", 1, False, 64, "disk"),  # as given
    ("auto", 1, False, 64, "ram"),      # small beside free memory
    ("auto", 1, False, 0.00001, "disk"),  # over half of it (14 squares of 18 px: 13,608 bytes)
    ("auto", 2, False, 64, "disk"),     # processes of a node share one file in the page cache
    ("auto", 1, True, 64, "disk"),      # a disk cache of these files is there: reused (or rebuilt there)
])
def test_cache_mode_is_ram_or_disk_after_planning_never_auto(photos, monkeypatch, mode, local, on_disk, avail_gib,
                                                             want):
    from dlenv.data import cache as cache_mod

    monkeypatch.setattr(cache_mod, "available_memory", lambda: int(avail_gib * 2**30))
    monkeypatch.setattr(cache_mod, "on_disk", lambda samples, size, cache_dir: on_disk)
    plan = InputOptions(cache="on", cache_mode=mode, workers=0).decide(photos, "cpu", 4, 16, local_world_size=local)
    assert plan.cache_mode == want and plan.source == "cache"
    assert InputOptions(cache="off", cache_mode=mode, workers=0).decide(photos, "cpu", 4, 16).cache_mode == "off"


def test_cache_mode_auto_finds_a_disk_cache_built_before(photos, tmp_path):
    from dlenv.data.cache import build_cache

    opts = InputOptions(cache="on", cache_dir=str(tmp_path / "c"), workers=0)
    assert opts.decide(photos, "cpu", 4, 16).cache_mode == "ram"
    build_cache(photos.layout.val, decode.stored_size(16), mode="disk", cache_dir=tmp_path / "c", say=lambda m: None)
    assert opts.decide(photos, "cpu", 4, 16).cache_mode == "disk"


def test_a_bad_cache_mode_is_one_line():
    from dlenv.data.plan import decide_cache_mode

    with pytest.raises(UserError, match="--cache-mode 'tape' is not one of: auto, ram, disk"):
        decide_cache_mode(InputOptions(cache_mode="tape"), 1, ([],), 32)


# --------------------------------------------------------------------------- a plan is pure


def test_a_plan_is_decided_on_a_cpu_without_reading_data_building_a_model_or_writing(photos, tmp_path, monkeypatch):
    """The done-when of issue 35: with options that need no probe, deciding opens no image, builds no model
    and no loader, starts no thread or process and writes nothing; the plan is frozen, the same when decided
    again. --decoder auto opens a few images (it times the CPU decoders on them), and no more."""
    import sys
    import threading

    images: list[str] = []
    watching = [True]

    def audit(event, args):  # every file open in this process, whichever module opens it and how
        if watching[0] and event == "open" and str(args[0]).endswith(".jpg"):
            images.append(str(args[0]))

    sys.addaudithook(audit)  # hooks cannot be removed: this one goes quiet at the end
    monkeypatch.setattr(torch.nn.Module, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", lambda *a, **k: pytest.fail("a loader was built"))
    try:
        files = sorted(tmp_path.rglob("*"))
        threads = threading.active_count()
        opts = InputOptions(decoder="pil", cache="on", cache_mode="auto", cache_dir=str(tmp_path / "c"), workers=2,
                            hflip="on", augment="standard")
        plan = opts.decide(photos, "cpu", 4, 16)
        assert images == [] and sorted(tmp_path.rglob("*")) == files and threading.active_count() == threads
        assert plan.cache_mode in ("ram", "disk") and plan.workers <= 2 and plan == opts.decide(photos, "cpu", 4, 16)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.workers = 3
        auto = InputOptions(cache_dir=str(tmp_path / "c")).decide(photos, "cpu", 4, 16)
        assert 2 <= len(set(images)) <= 6 and auto.decoder in decode.CPU_DECODERS
        assert sorted(tmp_path.rglob("*")) == files
    finally:
        watching[0] = False


# ---------------------------------------------------------------------------------------------------
# Overlap on few cores (issue 49): which path the plan takes by CPU cores, JPEG engines and torchvision.

#: (cores, JPEG engines, torchvision batch-decodes on CUDA (0.19+: the 2.x profile; 0.14 on 1.13)) ->
#: (workers auto gives, decoder auto picks (None: a CPU one), overlapped under --decode-overlap on)
PATHS_BY_CORES = [
    (2, True, True, 2, "nvimgcodec", True), (4, True, True, 4, "nvimgcodec", True),
    (8, True, True, 8, None, False), (16, True, True, 14, None, False),
    (2, False, True, 2, "nvjpeg", True), (4, False, True, 4, "nvjpeg", True),
    (8, False, True, 8, None, False), (16, False, True, 14, None, False),
    # the image's profile: torchvision 0.14 decodes one JPEG per call, so auto never takes nvJPEG there
    (2, True, False, 2, "nvimgcodec", True), (4, True, False, 4, "nvimgcodec", True),
    (8, True, False, 8, None, False), (2, False, False, 2, None, False), (4, False, False, 4, None, False),
]


@pytest.fixture
def cuda_box(tmp_path, monkeypatch):
    """A CUDA box of 80 GiB as the plan sees it (on a CPU): `set(cores, engines, batch_decode)`; decoding on
    it is not tried (the GPU decoders' checks answer as told); /dev/shm never holds the workers back."""
    import types

    from dlenv import compat
    from dlenv.data import workers

    located = pipeline.locate(str(make_photo_layout(tmp_path / "jpegs", 12, 4, 2, lambda i: (120, 90))))
    card = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: card)
    monkeypatch.setattr(compat, "cuda_jpeg_unavailable", lambda device="cuda": None)
    monkeypatch.setattr(hwdecode, "unavailable", lambda device: None)
    monkeypatch.setattr(workers.shutil, "disk_usage", lambda path: (_ for _ in ()).throw(OSError("no shm")))

    def set_box(cores, engines, batch_decode):
        monkeypatch.setattr(workers, "usable_cpus", lambda: cores)
        monkeypatch.setattr(hwdecode, "has_engines", lambda device: engines)
        monkeypatch.setattr(compat, "cuda_jpeg_batch_decode", lambda: batch_decode)
        return located

    return set_box


#: --decode-overlap -> the words of the input line where a GPU decoder could overlap
OVERLAP_SAYS = {"auto": "in series: overlapping them (--decode-overlap on) measured slower on an H200 at 2 and 4 cores",
                "on": "overlapped (--decode-overlap on): the GPU decodes the next batch",
                "off": "in series (--decode-overlap off)"}


@pytest.mark.parametrize("choice", ["auto", "on", "off"])
@pytest.mark.parametrize("cores,engines,batch_decode,workers,decoder,overlap", PATHS_BY_CORES)
def test_the_path_auto_takes_by_cores_engines_and_torchvision(cuda_box, cores, engines, batch_decode, workers,
                                                              decoder, overlap, choice):
    """auto never overlaps (measured slower at 2 and 4 cores); on overlaps where a GPU decoder decodes."""
    located = cuda_box(cores, engines, batch_decode)
    plan = InputOptions(cache="off", decode_overlap=choice).decide(located, "cuda", 256, 224)
    assert plan.on_device and plan.workers == workers
    assert plan.decoder == decoder if decoder else plan.decoder in decode.CPU_DECODERS, plan.decoder
    assert plan.overlap is (overlap and choice == "on") and plan.source == (decoder or "workers")
    line = plan.describe("cuda")
    assert (OVERLAP_SAYS[choice] in line) is bool(decoder) and "\n" not in line
    assert ("overlapped" in line) is plan.overlap
    assert plan.gpu_backends == (ENGINE_BACKENDS if decoder == "nvimgcodec" else ())


@pytest.mark.parametrize("opts,device,batch_decode,overlap,says", [
    (dict(decoder="nvimgcodec"), "cuda", True, False, "measured slower"),   # named, at 16 cores: auto, in series
    (dict(decoder="nvimgcodec", decode_overlap="on"), "cuda", True, True, "overlapped"),
    (dict(decoder="nvjpeg", decode_overlap="on"), "cuda", True, True, "overlapped"),
    (dict(decoder="nvjpeg", decode_overlap="off"), "cuda", True, False, "--decode-overlap off"),
    # torchvision 0.14 (1.13): in series whatever is asked
    (dict(decoder="nvjpeg", decode_overlap="on"), "cuda", False, False, "decodes one JPEG per call"),
    # the cache decodes once: nothing to overlap
    (dict(decoder="nvimgcodec", cache="on", decode_overlap="on"), "cuda", True, False, None),
    (dict(gpu_augment="on", decode_overlap="on"), "cpu", True, False, None),  # a CPU device: no GPU decoder
    (dict(gpu_augment="on", decoder="cv2", decode_overlap="on"), "cuda", True, False, None),  # CPU decoder, workers
    (dict(), "cpu", True, False, None),                    # the CPU-only default: the classic path, unchanged
])
def test_overlap_follows_the_decoder_and_says_why_not(cuda_box, opts, device, batch_decode, overlap, says):
    located = cuda_box(16, True, batch_decode)
    plan = InputOptions(**{"cache": "off", **opts}).decide(located, device, 256, 224)
    assert plan.overlap is overlap
    line = plan.describe(device)
    if says:
        assert says in line and says in plan.overlap_why
    else:
        assert plan.overlap_why == "" and "overlap" not in line and "series" not in line
    if device == "cpu" and not opts:
        assert not plan.on_device and plan.decoder in decode.CPU_DECODERS


@pytest.mark.parametrize("choice,decoder,device,cache,overlap", [
    ("on", "nvimgcodec", "cuda", False, True),
    ("auto", "nvimgcodec", "cuda", False, False), ("off", "nvimgcodec", "cuda", False, False),
    *[(choice, decoder, device, cache, False) for choice in ("auto", "on", "off")
      for decoder, device, cache in (("nvimgcodec", "cpu", False), ("nvimgcodec", "cuda", True), ("pil", "cuda", False),
                                     ("cv2", "cuda", False), ("synthetic", "cuda", False))],
])
def test_decide_overlap_is_a_rule_of_the_option_decoder_device_and_cache(choice, decoder, device, cache, overlap):
    from dlenv.data.plan import decide_overlap

    got, why = decide_overlap(choice, decoder, device, cache)
    assert got is overlap
    # words only where a GPU decoder decodes on CUDA, uncached: nothing to overlap says nothing
    assert bool(why) is (decoder == "nvimgcodec" and device == "cuda" and not cache)
    assert (OVERLAP_SAYS[choice] in why) is bool(why)


# --------------------------------------------------------------------------- the cache in GPU memory

#: (cores, engines, torchvision batch-decodes, GPU room, host room) -> (cache mode, decoder, source)
CACHE_BY_ROOM = [
    # room on the GPU: kept there whatever the cores, filled by the engines, else nvJPEG, else a CPU decoder
    *[(c, True, True, True, True, "gpu", "nvimgcodec", "cache") for c in (2, 4, 8, 16)],
    *[(c, False, True, True, True, "gpu", "nvjpeg", "cache") for c in (2, 4, 8, 16)],
    *[(c, False, False, True, True, "gpu", None, "cache") for c in (2, 16)],  # 1.13's torchvision: the CPU fills
    (2, True, False, True, True, "gpu", "nvimgcodec", "cache"),  # the image's profile with engines
    # no room on the GPU, a small dataset: decoded once into host memory, as before
    *[(c, e, True, False, True, "ram", None, "cache") for c in (2, 16) for e in (True, False)],
    # no room anywhere: streamed, the decoder by cores (the engines below 8 workers)
    (2, True, True, False, False, "off", "nvimgcodec", "nvimgcodec"), (4, True, True, False, False, "off",
                                                                         "nvimgcodec", "nvimgcodec"),
    (8, True, True, False, False, "off", None, "workers"), (16, True, True, False, False, "off", None, "workers"),
    (2, False, True, False, False, "off", "nvjpeg", "nvjpeg"), (16, False, False, False, False, "off", None, "workers"),
]


@pytest.mark.parametrize("cores,engines,batch_decode,gpu_room,host_room,mode,decoder,source", CACHE_BY_ROOM)
def test_cache_auto_keeps_a_dataset_that_fits_the_gpu_there(cuda_box, monkeypatch, cores, engines, batch_decode,
                                                             gpu_room, host_room, mode, decoder, source):
    from dlenv.data import cache as cache_mod

    located = cuda_box(cores, engines, batch_decode)
    total = 80 * 2**30
    monkeypatch.setattr("dlenv.data.gpucache.gpu_memory", lambda device: (total, total if gpu_room else 2**10))
    monkeypatch.setattr(cache_mod, "available_memory", lambda: 2**40 if host_room else 2**10)
    plan = InputOptions().decide(located, "cuda", 256, 224)
    assert (plan.cache_mode, plan.source) == (mode, source)
    assert plan.decoder == decoder if decoder else plan.decoder in decode.CPU_DECODERS, plan.decoder
    assert plan.gpu_backends == (ENGINE_BACKENDS if plan.decoder == "nvimgcodec" else ())
    line = plan.describe("cuda")
    assert ("decoded once into GPU memory" in line) is (mode == "gpu") and "\n" not in line
    if mode == "gpu":
        assert f"by {plan.decoder}" in line and "of the GPU's memory" in line and "--cache off" in line


@pytest.mark.parametrize("need,total,free,fits", [
    (5 * 2**30, 80 * 2**30, 80 * 2**30, True),    # 1/16 of an 80 GiB card
    (5 * 2**30 + 1, 80 * 2**30, 80 * 2**30, False),
    (2 * 2**30, 80 * 2**30, 3 * 2**30, False),    # over half of what is free
    (1, 0, 0, False),                             # no CUDA device
])
def test_gpu_cache_room_is_a_share_of_the_card_and_half_its_free_memory(monkeypatch, need, total, free, fits):
    from dlenv.data import gpucache

    monkeypatch.setattr(gpucache, "gpu_memory", lambda device: (total, free))
    assert gpucache.gpu_cache_room(need, "cuda") is fits


def test_cache_mode_gpu_as_given_and_refused_off_cuda(photos, monkeypatch):
    from dlenv.data import plan as plan_mod

    monkeypatch.setattr("dlenv.data.gpucache.gpu_memory", lambda device: (0, 0))
    assert plan_mod.decide_cache_mode(InputOptions(cache_mode="gpu"), 1, (photos.layout.train,), 32, "cuda") == "gpu"
    with pytest.raises(UserError, match="--cache-mode gpu: the device is cpu, not a CUDA GPU"):
        InputOptions(cache="on", cache_mode="gpu", workers=0).decide(photos, "cpu", 4, 16)
    # asked for ram: the host cache, even where the GPU has room
    monkeypatch.setattr("dlenv.data.gpucache.gpu_memory", lambda device: (2**40, 2**40))
    assert plan_mod.decide_cache_mode(InputOptions(cache_mode="ram"), 1, (photos.layout.train,), 32, "cuda") == "ram"
    assert plan_mod.decide_cache_mode(InputOptions(), 4, (photos.layout.train,), 32, "cuda") == "gpu"  # per GPU
