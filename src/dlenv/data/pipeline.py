"""Every input decision, made once: where the data is, its layout, the decoder, where augmentation runs,
the cache and the workers.

    located = locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)     # folder, demo or synthetic
    plan = decide(InputOptions.of(cfg), located, device, batch, img_size)  # plain values
    data = build_data(located, plan, device, ...)                           # the loaders

`decide` turns the input options (--decoder, --gpu-augment, --cache, --cache-mode, --cache-dir,
--workers, --bad-images) into an `InputPlan` of plain values: the trainer prints it and writes it to
config.yaml, and everything after reads the plan instead of deciding again. `make_loaders` builds
the (train, val) loaders a plan describes: the device path (`fastpath`: uint8 batches augmented on
the device, from DataLoader workers, a decoded `cache` or nvJPEG) or the CPU path (`loaders`:
torchvision transforms in the workers). bench-data measures variants of the same plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dlenv.data import decode
from dlenv.data.loaders import resolve_workers, shipped_bytes
from dlenv.errors import UserError

#: micro-batches per epoch of --synthetic data without --max-steps
SYNTHETIC_BATCHES = 100
#: the decoder of a plan for synthetic data (made on the device, nothing decoded)
SYNTHETIC = "synthetic"
#: RandomResizedCrop's scale range for real photos (torchvision's default)
PHOTO_TRAIN_SCALE = (0.08, 1.0)
#: --augment presets: (crop area range, crop aspect range). standard is torchvision's RandomResizedCrop;
#: light keeps most of the image near its shape (a short run learns faster, small objects stay in the
#: crop); none trains on the whole image, as validation sees it.
AUGMENT_PRESETS = {"standard": (PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3)), "light": ((0.5, 1.0), (0.9, 1.1)),
                   "none": ((1.0, 1.0), (1.0, 1.0))}
#: --img-size auto never goes above this (the photo default: larger inputs cost time for little gain
#: when training from scratch), nor below 16 (the trainer's minimum)
AUTO_IMG_SIZE_CAP, AUTO_IMG_SIZE_MIN = 224, 16


# ---------------------------------------------------------------------------------------------------
# Where the data is.


@dataclass(frozen=True)
class Located:
    """A dataset found: its layout (None for synthetic data), class names and what to call it."""

    layout: Any                 # data.folder.Layout, or None
    classes: list[str]
    source: str                 # the folder as given, "demo" or "synthetic"

    @property
    def demo(self) -> bool:
        """The built-in demo data, or a folder of it given as --data: 64 px images, gentler crops."""
        from dlenv.data.demo import is_demo_folder

        return self.source == "demo" or (self.layout is not None and is_demo_folder(self.layout.root))

    @property
    def img_size(self) -> int:
        """The training size when --img-size is auto: see `auto_img_size`."""
        return auto_img_size(self)[0]


def auto_img_size(located: Located) -> tuple[int, str]:
    """(--img-size auto's size, the reason): the median shorter side of up to 200 training images (headers
    only), capped at AUTO_IMG_SIZE_CAP for speed; 224 for synthetic data or when no header can be read."""
    from dlenv.data.imagesize import typical_side

    if located.layout is None or not located.layout.train:
        return 224, "the default for synthetic data"
    found = typical_side([p for p, _ in located.layout.train])
    if found is None:
        return 224, "the default for photos (no image header could be read)"
    typical, sampled = found
    size = max(AUTO_IMG_SIZE_MIN, min(AUTO_IMG_SIZE_CAP, typical))
    why = f"the training images' typical shorter side is {typical} px ({sampled} sampled)"
    if typical > AUTO_IMG_SIZE_CAP:
        why += f", capped at {AUTO_IMG_SIZE_CAP} for speed"
    return size, why


def locate(data: str | None, synthetic: bool = False, val_split: float = 0.2, seed: int = 0) -> Located:
    """The dataset --data names (the demo data, written on first use, when None; 1000 classes of random
    images for --synthetic). Raises UserError for a missing folder or one without images."""
    if synthetic:
        return Located(None, [str(i) for i in range(1000)], "synthetic")
    from dlenv.data.folder import find_layout

    if data is None:
        from dlenv.data.demo import ensure_demo_data

        root, source = ensure_demo_data(), "demo"
    else:
        root, source = Path(data), str(data)
        if not root.is_dir():
            raise UserError(f"--data {data}: no such folder; pass a folder of class folders "
                            "(or with train/ and val/), or unpack an archive with `invoke unpack`")
    layout = find_layout(root, val_split, seed)
    if not layout.train or not layout.classes:
        raise UserError(f"--data {root}: no training images in class folders found")
    return Located(layout, list(layout.classes), source)


# ---------------------------------------------------------------------------------------------------
# The decisions.


@dataclass(frozen=True)
class InputOptions:
    """The input options as given: --decoder, --gpu-augment, --cache, --cache-mode, --cache-dir, --workers,
    --bad-images."""

    decoder: str = "auto"
    gpu_augment: str = "auto"
    cache: bool | str = "auto"      # 'auto', 'on', 'off' (True/False: a config.yaml from before 'auto')
    cache_mode: str = "auto"
    cache_dir: str = ".dlenv-cache"
    workers: int | str = "auto"
    bad_images: str = "skip"
    augment: str = "auto"
    hflip: bool | str = "auto"      # 'auto', 'on', 'off' (True/False: a config.yaml from before 'auto')
    crop_scale: Any = "auto"

    @classmethod
    def of(cls, cfg: Any) -> InputOptions:
        """The fields of this class that `cfg` (a TrainConfig, BenchDataConfig, ...) has."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})

    def gpu_path(self, device: Any) -> bool:
        """Whether batches are augmented on the device (`fastpath`) rather than by torchvision transforms
        in the workers (`loaders`). --cache on and a GPU decoder imply it; 'auto' is on for CUDA."""
        if self.cache_on() or self.decoder in decode.GPU_DECODERS or self.gpu_augment == "on":
            return True
        return self.gpu_augment == "auto" and torch.device(device).type == "cuda"

    def cache_on(self) -> bool:
        """--cache given as on (or true), not auto."""
        return self.cache is True or self.cache == "on"


@dataclass(frozen=True)
class InputPlan:
    """What `decide` resolved. Plain values: shown to the user, stored in config.yaml, read by the loaders."""

    img_size: int
    batch_size: int
    on_device: bool             # augmentation on the device (fastpath), else in the workers (loaders)
    decoder: str                # 'pil', 'cv2', 'tvio', 'nvjpeg' or 'nvimgcodec'
    cpu_decoder: str            # where the GPU cannot decode (the cache, the CPU path): the best CPU one
    workers: int
    cache: bool = False
    cache_mode: str = "auto"    # 'ram', 'disk', or 'auto' (the cache picks by size, see data.cache)
    cache_dir: str = ".dlenv-cache"
    bad_images: str = "skip"
    train_scale: tuple[float, float] = PHOTO_TRAIN_SCALE
    train_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True
    hflip_why: str = "--hflip on"  # why flips are on or off (`decide_hflip`)
    augment: str = "standard"
    norm: tuple[tuple, tuple] | None = None  # (mean, std) of pretrained weights; None: ImageNet's
    cache_why: str = ""         # why --cache auto decodes once (empty: it was asked for, or is off)
    interpolation: str = "bilinear"  # every resize and crop: pretrained weights' own (bicubic for most timm's)

    def describe(self, device: Any) -> str:
        """One line: where batches come from, how and where they are augmented."""
        if self.decoder == SYNTHETIC:
            return f"input: synthetic batches made on {torch.device(device).type}"
        where = torch.device(device).type if self.on_device else "the workers"
        if self.cache:
            source = "decoded once into memory" if self.cache_why else "--cache"
        else:
            source = f"decoder {self.decoder}"
        workers = "" if self.cache or self.decoder in decode.GPU_DECODERS else f", {self.workers} workers"
        line = f"input: {source}, augmentation on {where} ({self.augmentation()}){workers}"
        return f"{line}; {self.cache_why}" if self.cache_why else line

    def augmentation(self) -> str:
        """The training augmentation in words: preset, crop range, flips, interpolation."""
        lo, hi = self.train_scale
        crops = "whole image" if lo == hi == 1.0 else f"crops {lo:.0%}-{hi:.0%}"
        return f"{self.augment}: {crops}, {'flips' if self.hflip else 'no flips'}, {self.interpolation}"


def decide_augment(opts: InputOptions, demo: bool) -> tuple[str, tuple[float, float], tuple[float, float]]:
    """(preset, crop area range, crop aspect range) for --augment and --crop-scale.

    auto is standard (what works for photos), light for the demo data (its shapes fill most of a small
    image, and a short run learns faster from gentler crops); --crop-scale overrides the preset's range."""
    preset = opts.augment if opts.augment != "auto" else ("light" if demo else "standard")
    scale, ratio = AUGMENT_PRESETS[preset]
    if opts.crop_scale != "auto":
        scale = tuple(opts.crop_scale)
    return preset, scale, ratio


def decide_hflip(choice: bool | str, classes: list[str], preset: str) -> tuple[bool, str]:
    """(flip training images left-right?, why) for --hflip `choice` ('auto', 'on', 'off'; True/False from a
    config.yaml written before auto) on data of these `classes` with --augment `preset`.

    auto follows the dataset report's rule (dlenv.data.report.character_classes): no flips where most
    class names are single characters, whose mirror image is another class or none; flips elsewhere.
    --augment none never flips: it trains on the whole image as validation sees it."""
    from dlenv.data.report import character_classes

    if preset == "none":
        return False, "off: --augment none trains on the whole image, as validation sees it"
    if choice in ("on", "off", True, False):
        on = choice in ("on", True)
        return on, f"--hflip {'on' if on else 'off'}"
    chars = character_classes(classes)
    if chars:
        return False, (f"auto: off, the classes look like characters ({chars}) and a mirror image can be "
                       "another class or none (--hflip on to flip anyway)")
    return True, "auto: on, the class names are no characters (--hflip off where a mirror image is another class)"


def workers_per_process(workers: int, local_world_size: int) -> int:
    """DataLoader workers for each of `local_world_size` processes of a node sharing its CPUs."""
    return max(1, workers // max(1, local_world_size)) if workers else 0


def decide(opts: InputOptions, located: Located, device: Any, batch_size: int, img_size: int,
           local_world_size: int = 1, norm: tuple[tuple, tuple] | None = None,
           interpolation: str = "bilinear") -> InputPlan:
    """The input plan for `located` data on `device` (`local_world_size` processes share the node).

    Workers: the number given, or 'auto' (CPUs and /dev/shm, shared by the node's processes). Where
    augmentation runs: `InputOptions.gpu_path`. The cache: `decide_cache` (a small dataset is decoded
    once). The decoder: 'auto' is nvImageCodec on the GPU's JPEG engines or nvJPEG where
    `decode.resolve_decoder` says so for these files (only when batches are augmented on a GPU and not
    cached), else the fastest CPU decoder on a few of them. The cache mode: 'auto' becomes 'disk' when
    several processes share the node (one file in the page cache, not a copy in each process).
    `norm`: the (mean, std) pretrained weights were trained with (dlenv.pretrained), else ImageNet's;
    `interpolation`: their resampling, else bilinear.
    Raises UserError for an unknown decoder or a missing library.
    """
    device = torch.device(device)
    if located.layout is None:  # synthetic batches are made on the device: nothing to decode or augment
        return InputPlan(img_size, batch_size, True, SYNTHETIC, SYNTHETIC, 0)
    on_device = opts.gpu_path(device)
    size = decode.stored_size(img_size)
    # the device path's workers ship uint8 stored squares, the CPU path's float32 crops
    # a number given is per process: the node's processes each start that many, all through one /dev/shm
    workers = resolve_workers(opts.workers, batch_size, img_size,
                              sample_bytes=shipped_bytes(img_size, True) if on_device else None,
                              share=1 if opts.workers == "auto" else local_world_size)
    if opts.workers == "auto":  # the processes of a node share its CPUs
        workers = workers_per_process(workers, local_world_size)
    paths = [p for p, _ in located.layout.train]
    cache, cache_why = decide_cache(opts, located.layout, on_device, size)
    decoder = decode.resolve_decoder(opts.decoder, paths, size, gpu=device if on_device and not cache else None,
                                     batch=batch_size, workers=workers)
    cpu_decoder = decoder if decoder not in decode.GPU_DECODERS else decode.pick_decoder(paths, size)
    cache_mode = "disk" if opts.cache_mode == "auto" and local_world_size > 1 else opts.cache_mode
    preset, scale, ratio = decide_augment(opts, located.demo)
    hflip, hflip_why = decide_hflip(opts.hflip, located.classes, preset)
    return InputPlan(img_size, batch_size, on_device, decoder, cpu_decoder, workers, cache=cache,
                     cache_mode=cache_mode, cache_dir=opts.cache_dir, bad_images=opts.bad_images,
                     train_scale=scale, train_ratio=ratio, hflip=hflip, hflip_why=hflip_why, augment=preset, norm=norm,
                     interpolation=interpolation, cache_why=cache_why)


#: --cache auto decodes a dataset once when its decoded form (train + val, stored squares) takes at most
#: this share of the memory available and at most AUTO_CACHE_MAX_BYTES: small datasets, which are
#: otherwise decoded again every epoch for nothing. Larger ones stream from the files (or --cache on).
AUTO_CACHE_SHARE = 1 / 8
AUTO_CACHE_MAX_BYTES = 2 << 30


def decide_cache(opts: InputOptions, layout: Any, on_device: bool, size: int) -> tuple[bool, str]:
    """(decode once?, the line that says why: only when 'auto' chose it). 'on'/'off' as given. 'auto': on
    for the device path (the cache feeds GPU augmentation) when the user named no GPU decoder and the
    decoded dataset fits AUTO_CACHE_SHARE of available memory and AUTO_CACHE_MAX_BYTES."""
    from dlenv.data.cache import available_memory, nbytes

    if opts.cache_on():
        return True, ""
    if opts.cache in (False, "off") or not on_device or opts.decoder in decode.GPU_DECODERS:
        return False, ""
    n = len(layout.train) + len(layout.val)
    need = nbytes(n, size)
    if need > AUTO_CACHE_MAX_BYTES or need > AUTO_CACHE_SHARE * available_memory():
        return False, ""
    return True, (f"{n:,} images take {need / 2**20:,.0f} MiB decoded, a small share of free memory "
                  "(--cache off decodes every epoch instead)")


# ---------------------------------------------------------------------------------------------------
# Building what the plan says.


def make_loaders(layout: Any, plan: InputPlan, device: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format, train_sampler: Any = None,
                 val_sampler: Any = None, say: Callable[[str], None] = print,
                 epochs: int | None = None) -> tuple[Any, Any]:
    """(train, val) loaders of a folder.Layout as `plan` says; val is None when the layout has no val.

    Train goes in `train_sampler` order (default: a ResumableSampler seeded by `seed`). On the device
    path batches arrive on `device`, in `memory_format` and `dtype`, and val goes in `val_sampler`
    order (default: sample order); `epochs` (the run's, None: open-ended) tells the device path's
    workers where to stop decoding ahead. Raises UserError for nvJPEG where it cannot run and a cache that
    does not fit.
    """
    device = torch.device(device)
    if plan.on_device:
        return _device_loaders(layout, plan, device, seed, dtype, memory_format, train_sampler, val_sampler, say,
                               epochs)
    from dlenv.data.loaders import build_loaders

    return build_loaders(layout, plan.img_size, plan.batch_size, plan.workers, seed=seed,
                         bad_images=plan.bad_images, train_sampler=train_sampler,
                         pin_memory=device.type == "cuda", train_scale=plan.train_scale, decoder=plan.cpu_decoder,
                         train_ratio=plan.train_ratio, hflip=plan.hflip, norm=plan.norm,
                         interpolation=plan.interpolation)


def _device_loaders(layout: Any, plan: InputPlan, device: torch.device, seed: int, dtype: torch.dtype,
                    memory_format: torch.memory_format, train_sampler: Any, val_sampler: Any,
                    say: Callable[[str], None], epochs: int | None = None) -> tuple[Any, Any]:
    """DeviceLoaders (dlenv.data.fastpath) over the plan's source: the cache, DataLoader workers, or a GPU decoder
    (dlenv.data.gpudecode: nvJPEG or nvImageCodec)."""
    from dlenv.cpus import usable_cpus
    from dlenv.data.cache import build_cache
    from dlenv.data.fastpath import CacheSource, DeviceLoader, WorkerSource, stored_tensors
    from dlenv.data.gpu_aug import GpuAugment
    from dlenv.data.gpudecode import NvimgcodecSource, NvjpegSource
    from dlenv.data.loaders import ImageDataset
    from dlenv.data.sampler import ResumableSampler

    gpu_decoder = plan.decoder if plan.decoder in decode.GPU_DECODERS and not plan.cache else None
    if gpu_decoder:
        from dlenv import compat
        from dlenv.data import hwdecode

        if device.type != "cuda":
            why = "the device is not a GPU"
        else:
            why = compat.cuda_jpeg_unavailable(device) if gpu_decoder == "nvjpeg" else hwdecode.unavailable(device)
        if why:
            raise UserError(f"--decoder {gpu_decoder}: {why}; use --decoder auto")
    size = decode.stored_size(plan.img_size)
    pin = device.type == "cuda"
    splits = [(layout.train, train_sampler, True)] + ([(layout.val, val_sampler, False)] if layout.val else [])
    out = []
    for samples, sampler, train in splits:
        augment = GpuAugment(plan.img_size, train, dtype, memory_format, scale=plan.train_scale,
                             ratio=plan.train_ratio, hflip=plan.hflip, norm=plan.norm,
                             interpolation=plan.interpolation)
        if train and sampler is None:
            sampler = ResumableSampler(len(samples), seed=seed, batch_size=plan.batch_size)
        if plan.cache:
            # decoding threads of this process: every core helps, /dev/shm plays no part
            decoded = build_cache(samples, size, plan.cpu_decoder, plan.cache_mode, plan.cache_dir, usable_cpus(),
                                  plan.bad_images, say)
            source: Any = CacheSource(decoded, sampler, plan.batch_size, pin)
        elif gpu_decoder == "nvimgcodec":
            source = NvimgcodecSource(samples, sampler, plan.batch_size, size, plan.bad_images, device)
        elif gpu_decoder:
            source = NvjpegSource(samples, sampler, plan.batch_size, size, plan.bad_images)
        else:
            ds = ImageDataset(samples, stored_tensors, plan.bad_images,
                              load=partial(decode.decode_stored, size=size, decoder=plan.cpu_decoder))
            source = WorkerSource(ds, sampler, plan.batch_size, plan.workers, pin,
                                  last_epoch=epochs - 1 if epochs else None)
        out.append(DeviceLoader(source, augment, device, plan.batch_size, sampler, seed))
    return out[0], (out[1] if len(out) > 1 else None)


@dataclass
class Data:
    """What the trainer iterates: train and val batches, the resumable sampler, and the plan they follow."""

    train: Any                  # iterable of (images, targets)
    val: Any                    # iterable, or None
    sampler: Any                # ResumableSampler, or None for synthetic data
    classes: list[str]
    source: str                 # what to print and store: folder path, "demo", "synthetic"
    plan: InputPlan


def build_data(located: Located, plan: InputPlan, device: Any, dist: Any, *, seed: int = 0,
               dtype: torch.dtype = torch.float32, memory_format: torch.memory_format = torch.contiguous_format,
               max_steps: int | None = None, say: Callable[[str], None] = print, epochs: int | None = None) -> Data:
    """The training and validation batches of this process (`dist`: a distributed.DistInfo).

    Synthetic data (`located.layout` None) is made on the device: `max_steps` batches per epoch
    (SYNTHETIC_BATCHES without it). A real dataset trains on this rank's share of a resumable sampler
    and validates on its own shard, without padding (the trainer's validation sums the shards);
    `epochs`, the run's, is where its workers stop decoding ahead.
    """
    from dlenv import distributed
    from dlenv.data.sampler import ResumableSampler

    device = torch.device(device)
    if located.layout is None:
        from dlenv.data.synthetic import SyntheticLoader

        n, b, size, k = max_steps or SYNTHETIC_BATCHES, plan.batch_size, plan.img_size, len(located.classes)
        train = SyntheticLoader(b, size, k, device, n, memory_format, seed)
        val = SyntheticLoader(b, size, k, device, 2, memory_format, seed + 1)
        return Data(train, val, None, located.classes, located.source, plan)
    layout = located.layout
    sampler = ResumableSampler(len(layout.train), seed=seed, rank=dist.rank, world_size=dist.world_size,
                               batch_size=plan.batch_size)
    sharded = layout.val and dist.world_size > 1
    val_sampler = distributed.EvalShardSampler(len(layout.val), dist.rank, dist.world_size) if sharded else None
    train, val = make_loaders(layout, plan, device, seed=seed, dtype=dtype, memory_format=memory_format,
                              train_sampler=sampler, val_sampler=val_sampler, say=say, epochs=epochs)
    if not plan.on_device and val is not None:  # the CPU path's loader: a copy that reads this rank's shard
        val = distributed.shard_eval_loader(val, dist.rank, dist.world_size)
    return Data(train, val, sampler, located.classes, located.source, plan)
