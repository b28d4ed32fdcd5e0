"""Every input decision, made once, into a frozen `InputPlan` of plain values.

    located = pipeline.locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)   # folder, demo or synthetic
    plan = InputOptions.of(cfg).decide(located, device, batch, img_size)          # this module: decisions
    data = pipeline.build(located, plan, device, dist)                            # builds what the plan says

`InputOptions.decide` turns the input options (--decoder, --gpu-augment, --cache, --cache-mode, --cache-dir,
--workers, --bad-images, --augment, --hflip, --crop-scale, --decode-overlap) into an `InputPlan`: where
augmentation runs, the decoder (the auto policy and the GPU decoders' availability are here), the nvImageCodec
backends, whether a GPU decoder's decoding overlaps the augmentation (`decide_overlap`), the cache and its mode
(ram, disk or off: never auto after planning), the workers as a number (`workers.decide_workers`, with the
sentence that says why when /dev/shm held them back), the crops and flips.
The trainer prints the plan and writes it to config.yaml; everything after reads it instead of deciding
again. Deciding reads no image data beyond a few headers (and, for --decoder auto, a few timed decodes;
for a GPU decoder, a test image decoded on the GPU), builds nothing and writes nothing.

A new decoder is a source in `sources` (keyed by `InputPlan.source`), its rule here, and a choice in config.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlenv import compat
from dlenv.data import cache, decode, gpucache, hwdecode
from dlenv.data.decode import mean_pixels
from dlenv.data.pipeline import Located
from dlenv.data.report import character_classes
from dlenv.data.workers import decide_workers, shipped_bytes
from dlenv.errors import UserError, optional_import

#: the decoder of a plan for synthetic data (made on the device, nothing decoded)
SYNTHETIC = "synthetic"
#: RandomResizedCrop's scale range for real photos (torchvision's default)
PHOTO_TRAIN_SCALE = (0.08, 1.0)
#: --augment presets: (crop area range, crop aspect range). standard is torchvision's RandomResizedCrop;
#: light keeps most of the image near its shape (a short run learns faster, small objects stay in the
#: crop); none trains on the whole image, as validation sees it.
AUGMENT_PRESETS = {"standard": (PHOTO_TRAIN_SCALE, (3 / 4, 4 / 3)), "light": ((0.5, 1.0), (0.9, 1.1)),
                   "none": ((1.0, 1.0), (1.0, 1.0))}
#: auto's crops for classes that look like characters (digits, letters): most of the glyph and nearly its
#: shape, a light shift and zoom. standard's 8% crops of a digit are often no digit at all (on MNIST-like
#: digits, 3 epochs: 65.5% top-1 against 86.5% with --augment none)
CHARACTER_CROPS = ((0.8, 1.0), (0.9, 1.1))
#: the CPU decoder --decoder auto keeps unless another is clearly faster on the data (`pick_decoder`)
AUTO_DECODER = "pil"
#: decoders that decode whole batches on the GPU (dlenv.data.sources)
GPU_DECODERS = ("nvjpeg", "nvimgcodec")
#: bytes of GPU memory per decoded pixel while a GPU-decoded batch is squashed: the RGB image, its
#: stacked copy and the float copy the antialiased resize works on (sources.squash)
NVJPEG_BYTES_PER_PIXEL = 18
#: the share of the GPU's memory a decoded batch may take for 'auto' to decode on the GPU
NVJPEG_MEMORY_SHARE = 0.05
#: DataLoader workers from which the CPU decoders (with augmentation on the GPU) out-train the GPU decoders
#: (measured with scripts/bench_pipeline.py: docs/input-pipeline.md, "Few cores per GPU")
NVJPEG_BELOW_WORKERS = 8
#: nvImageCodec's backends where the GPU has JPEG engines: only they and the CPU decode (its CUDA decoder
#: would take part of each batch to the SMs the model trains on); elsewhere every backend ('()')
ENGINE_BACKENDS = ("HW_GPU_ONLY", "CPU_ONLY")
#: --cache auto decodes a dataset once when its decoded form (train + val, stored squares) takes at most
#: this share of the memory available and at most AUTO_CACHE_MAX_BYTES: small datasets, which are
#: otherwise decoded again every epoch for nothing. Larger ones stream from the files (or --cache on).
AUTO_CACHE_SHARE = 1 / 8
AUTO_CACHE_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class InputPlan:
    """What `InputOptions.decide` resolved. Plain values: shown to the user, stored in config.yaml, read by
    `pipeline.build` and the sources."""

    img_size: int
    batch_size: int
    on_device: bool             # augmentation on the device (fastpath), else in the workers (loaders)
    decoder: str                # 'pil', 'cv2', 'tvio', 'nvjpeg', 'nvimgcodec' (or SYNTHETIC); a gpu cache's filler
    cpu_decoder: str            # where the GPU cannot decode (the cache, the CPU path): the best CPU one
    workers: int
    cache_mode: str = "off"     # 'ram', 'disk', 'gpu' (in the device's memory), or 'off' (no cache)
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
    gpu_backends: tuple[str, ...] = ()  # nvImageCodec's backends (ENGINE_BACKENDS, or () for all)
    seed: int = 0               # the order and the crops
    epochs: int | None = None   # the run's (None: open-ended): the device path's workers decode no further
    overlap: bool = False       # a GPU decoder decodes the next batch in a thread and stream of its own
    overlap_why: str = ""       # why it does, or why a GPU decoder does not (`decide_overlap`)
    workers_why: str = ""       # why the workers are fewer than asked (/dev/shm: `decide_workers`); "" if not
    augment_why: str = ""       # why the crops are what they are (`decide_augment`)

    @property
    def cache(self) -> bool:
        """Whether the dataset is decoded once (`cache_mode` ram or disk)."""
        return self.cache_mode != "off"

    @property
    def source(self) -> str:
        """Where the device path's batches come from, the key of `sources.SOURCES`: 'cache', a GPU decoder's
        name, or 'workers' (DataLoader workers with the CPU decoder)."""
        if self.cache:
            return "cache"
        return self.decoder if self.decoder in GPU_DECODERS else "workers"

    def describe(self, device: Any) -> str:
        """One line: where batches come from, how and where they are augmented."""
        if self.decoder == SYNTHETIC:
            return f"input: synthetic batches made on {torch.device(device).type}"
        where = torch.device(device).type if self.on_device else "the workers"
        if self.cache:
            kept = "GPU memory" if self.cache_mode == "gpu" else "memory"
            source = f"decoded once into {kept}" if self.cache_why else f"--cache {self.cache_mode}"
            source = f"{source} by {self.decoder}" if self.cache_mode == "gpu" else source
        else:
            source = f"decoder {self.decoder}"
        workers = "" if self.cache or self.decoder in GPU_DECODERS else f", {self.workers} workers"
        line = f"input: {source}, augmentation on {where} ({self.augmentation()}){workers}"
        line = f"{line}; {self.overlap_why}" if self.overlap_why else line
        return f"{line}; {self.cache_why}" if self.cache_why else line

    def augmentation(self) -> str:
        """The training augmentation in words: preset, crop range, flips, interpolation."""
        lo, hi = self.train_scale
        crops = "whole image" if lo == hi == 1.0 else f"crops {lo:.0%}-{hi:.0%}"
        return f"{self.augment}: {crops}, {'flips' if self.hflip else 'no flips'}, {self.interpolation}"

    @classmethod
    def classic(cls, img_size: int, batch_size: int, workers: int | str, seed: int = 0,
                norm: tuple[tuple, tuple] | None = None, interpolation: str = "bilinear") -> InputPlan:
        """The CPU path with torchvision's standard crops and flips, Pillow, and `workers` sized by
        `decide_workers` (`workers_why` says why where /dev/shm held them back), for a loader outside
        training (prune's fine-tuning); `norm` and `interpolation`: pretrained weights' own (None: ImageNet's
        statistics)."""
        n, why = decide_workers(workers, batch_size, img_size)
        return cls(img_size, batch_size, False, AUTO_DECODER, AUTO_DECODER, n, seed=seed, norm=norm,
                   interpolation=interpolation, workers_why=why)


@dataclass(frozen=True)
class InputOptions:
    """The input options as given: --decoder, --gpu-augment, --cache, --cache-mode, --cache-dir, --workers,
    --bad-images, --augment, --hflip, --crop-scale, --decode-overlap, and the run's --seed and --epochs."""

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
    decode_overlap: str = "auto"
    seed: int = 0
    epochs: int | None = None

    @classmethod
    def of(cls, cfg: Any) -> InputOptions:
        """The fields of this class that `cfg` (a TrainConfig, BenchDataConfig, ...) has."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})

    def gpu_path(self, device: Any) -> bool:
        """Whether batches are augmented on the device (`fastpath`) rather than by torchvision transforms
        in the workers (`loaders`). --cache on and a GPU decoder imply it; 'auto' is on for CUDA."""
        if self.cache_on() or self.decoder in GPU_DECODERS or self.gpu_augment == "on":
            return True
        return self.gpu_augment == "auto" and torch.device(device).type == "cuda"

    def cache_on(self) -> bool:
        """--cache given as on (or true), not auto."""
        return self.cache is True or self.cache == "on"

    def decide(self, located: Located, device: Any, batch_size: int, img_size: int, local_world_size: int = 1,
               norm: tuple[tuple, tuple] | None = None, interpolation: str = "bilinear") -> InputPlan:
        """The input plan for `located` data on `device` (`local_world_size` processes share the node).

        Workers: the number given, or 'auto' (CPUs and /dev/shm, shared by the node's processes:
        `decide_workers`; `workers_why` says why where /dev/shm held them back). Where
        augmentation runs: `gpu_path`. The cache: `decide_cache` (a small dataset is decoded once) and
        `decide_cache_mode`. The decoder: `resolve_decoder` (GPU decoders only when batches are augmented
        on a GPU and not cached), checked to run here (`gpu_unavailable`), and the best CPU decoder for
        what the GPU cannot decode. `norm`: the (mean, std) pretrained weights were trained with
        (dlenv.model.pretrained), else ImageNet's; `interpolation`: their resampling, else bilinear.
        Raises UserError for an unknown or missing decoder, or a GPU decoder that cannot run on `device`.
        """
        device = torch.device(device)
        if located.layout is None:  # synthetic batches are made on the device: nothing to decode or augment
            return InputPlan(img_size, batch_size, True, SYNTHETIC, SYNTHETIC, 0, seed=self.seed, epochs=self.epochs)
        on_device = self.gpu_path(device)
        size = decode.stored_size(img_size)
        # the device path's workers ship uint8 stored squares, the CPU path's float32 crops
        # a number given is per process: the node's processes each start that many, all through one /dev/shm
        workers, workers_why = decide_workers(self.workers, batch_size, img_size,
                                              sample_bytes=shipped_bytes(img_size, True) if on_device else None,
                                              share=1 if self.workers == "auto" else local_world_size)
        if self.workers == "auto":  # the processes of a node share its CPUs
            workers = workers_per_process(workers, local_world_size)
        paths = [p for p, _ in located.layout.train]
        splits = (located.layout.train, located.layout.val)
        cache, cache_why = decide_cache(self, located.layout, on_device, size, device)
        mode = decide_cache_mode(self, local_world_size, splits, size, device) if cache else "off"
        if mode == "gpu":  # filled once, with nothing training beside it: the GPU's decoder where it has one
            decoder = fill_decoder(self.decoder, paths, size, device, batch_size)
        else:
            decoder = resolve_decoder(self.decoder, paths, size, gpu=device if on_device and not cache else None,
                                      batch=batch_size, workers=workers)
        backends: tuple[str, ...] = ()
        if decoder in GPU_DECODERS and (not cache or mode == "gpu"):
            why = gpu_unavailable(decoder, device)
            if why:
                raise UserError(f"--decoder {decoder}: {why}; use --decoder auto")
            backends = engine_backends(device) if decoder == "nvimgcodec" else ()
        cpu_decoder = decoder if decoder not in GPU_DECODERS else pick_decoder(paths, size)
        overlap, overlap_why = decide_overlap(self.decode_overlap, decoder, device, cache)
        preset, scale, ratio, augment_why = decide_augment(self, located.demo, located.classes)
        hflip, hflip_why = decide_hflip(self.hflip, located.classes, preset)
        return InputPlan(img_size, batch_size, on_device, decoder, cpu_decoder, workers, cache_mode=mode,
                         cache_dir=self.cache_dir, bad_images=self.bad_images, train_scale=scale, train_ratio=ratio,
                         hflip=hflip, hflip_why=hflip_why, augment=preset, norm=norm, cache_why=cache_why,
                         interpolation=interpolation, gpu_backends=backends, seed=self.seed, epochs=self.epochs,
                         overlap=overlap, overlap_why=overlap_why, workers_why=workers_why,
                         augment_why=augment_why)


def workers_per_process(workers: int, local_world_size: int) -> int:
    """DataLoader workers for each of `local_world_size` processes of a node sharing its CPUs."""
    return max(1, workers // max(1, local_world_size)) if workers else 0


# ---------------------------------------------------------------------------------------------------
# Augmentation.


def decide_augment(opts: InputOptions, demo: bool, classes: Sequence[str] = ()
                   ) -> tuple[str, tuple[float, float], tuple[float, float], str]:
    """(preset, crop area range, crop aspect range, why) for --augment and --crop-scale.

    auto is standard (what works for photos), light for the demo data (its shapes fill most of a small
    image, and a short run learns faster from gentler crops), and light with CHARACTER_CROPS where the
    classes look like characters (the flips' rule, dlenv.data.report.character_classes): a crop of a few
    percent of a digit is no digit. --crop-scale overrides the preset's range."""
    chars = character_classes(list(classes)) if opts.augment == "auto" and not demo else ""
    if opts.augment != "auto":
        preset, why = opts.augment, f"--augment {opts.augment}"
    elif demo:
        preset, why = "light", "auto: light, the demo's shapes fill most of a small image"
    elif chars:
        preset, why = "light", (f"auto: light crops {CHARACTER_CROPS[0][0]:.0%}-100%, aspect near 1, the classes look "
                                f"like characters ({chars}) and a small crop of one is none (--augment standard "
                                "for photo crops)")
    else:
        preset, why = "standard", "auto: standard, photo crops (RandomResizedCrop's range)"
    scale, ratio = CHARACTER_CROPS if chars else AUGMENT_PRESETS[preset]
    if opts.crop_scale != "auto":
        scale = tuple(opts.crop_scale)
        why = f"{why}; --crop-scale {scale[0]:g} {scale[1]:g}"
    return preset, scale, ratio, why


def decide_hflip(choice: bool | str, classes: list[str], preset: str) -> tuple[bool, str]:
    """(flip training images left-right?, why) for --hflip `choice` ('auto', 'on', 'off'; True/False from a
    config.yaml written before auto) on data of these `classes` with --augment `preset`.

    auto follows the dataset report's rule (dlenv.data.report.character_classes): no flips where most
    class names are single characters, whose mirror image is another class or none; flips elsewhere.
    --augment none never flips: it trains on the whole image as validation sees it."""

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


# ---------------------------------------------------------------------------------------------------
# The cache.


def decide_cache(opts: InputOptions, layout: Any, on_device: bool, size: int,
                 device: Any = "cpu") -> tuple[bool, str]:
    """(decode once?, the line that says why: only when 'auto' chose it). 'on'/'off' as given. 'auto': on
    for the device path (the cache feeds GPU augmentation) when the user named no GPU decoder and the
    decoded dataset fits the GPU (`gpu_cache_room`: then it is kept there, whatever the cores), or
    AUTO_CACHE_SHARE of available memory and AUTO_CACHE_MAX_BYTES."""

    if opts.cache_on():
        return True, ""
    if opts.cache in (False, "off") or not on_device or opts.decoder in GPU_DECODERS:
        return False, ""
    n = len(layout.train) + len(layout.val)
    need = cache.nbytes(n, size)
    if opts.cache_mode in ("auto", "gpu") and gpucache.gpu_cache_room(need, device):
        share = need / gpucache.gpu_memory(device)[0]
        return True, (f"{n:,} images take {need / 2**20:,.0f} MiB decoded, {share:.1%} of the GPU's memory: no "
                      "decoding, copying or CPU threads per batch (--cache off decodes every epoch instead)")
    if need > AUTO_CACHE_MAX_BYTES or need > AUTO_CACHE_SHARE * cache.available_memory():
        return False, ""
    return True, (f"{n:,} images take {need / 2**20:,.0f} MiB decoded, a small share of free memory "
                  "(--cache off decodes every epoch instead)")


def decide_cache_mode(opts: InputOptions, local_world_size: int, splits: Sequence[Sequence[tuple[str, int]]],
                      size: int, device: Any = "cpu") -> str:
    """'gpu', 'ram' or 'disk' for --cache-mode: as given (gpu only on a CUDA device), or for 'auto' gpu where
    the decoded images of all `splits` (train, val) fit `device` (`gpu_cache_room`: each process keeps its
    own on its own GPU), else disk where several processes share the node (one file in the page cache, not
    a copy in each) or a disk cache of one of the splits already exists under --cache-dir (a damaged one
    too: it is rebuilt where it was), else ram when they take under half the available memory, else disk.
    Raises UserError for another value."""

    if opts.cache_mode == "gpu" and torch.device(device).type != "cuda":
        raise UserError(f"--cache-mode gpu: the device is {torch.device(device).type}, not a CUDA GPU; use "
                        "--cache-mode auto, ram or disk")
    if opts.cache_mode in ("ram", "disk", "gpu"):
        return opts.cache_mode
    if opts.cache_mode != "auto":
        raise UserError(f"--cache-mode {opts.cache_mode!r} is not one of: auto, ram, disk, gpu")
    n = sum(len(split) for split in splits)
    if gpucache.gpu_cache_room(cache.nbytes(n, size), device):
        return "gpu"
    if local_world_size > 1 or any(cache.on_disk(split, size, opts.cache_dir) for split in splits if split):
        return "disk"
    return "ram" if cache.nbytes(n, size) < cache.available_memory() // 2 else "disk"


# ---------------------------------------------------------------------------------------------------
# The decoder.


def resolve_decoder(name: str, paths: Sequence[str] = (), size: int = 258, gpu: Any = None,
                    batch: int = 256, workers: int | None = None) -> str:
    """'auto' -> 'nvimgcodec' where `prefer_engines(paths, gpu, batch, workers)`, else 'nvjpeg' where
    `prefer_nvjpeg(paths, gpu, batch, workers)` (gpu: the CUDA device whose batches are augmented there;
    workers: the DataLoader workers the CPU decoders would get), else the fastest CPU decoder on a few
    of `paths` (`pick_decoder`; AUTO_DECODER without paths); a named one is checked to be importable.

    'nvjpeg' and 'nvimgcodec' are returned as they are (`gpu_unavailable` checks the GPU). Raises UserError
    for an unknown name or a missing library.
    """
    if name == "auto":
        if gpu is not None and prefer_engines(paths, gpu, batch, workers):
            return "nvimgcodec"
        if gpu is not None and prefer_nvjpeg(paths, gpu, batch, workers):
            return "nvjpeg"
        return pick_decoder(paths, size) if paths else AUTO_DECODER
    if name in GPU_DECODERS:
        return name
    if name not in decode.CPU_DECODERS:
        raise UserError(f"--decoder {name!r} is not one of: auto, {', '.join(decode.CPU_DECODERS + GPU_DECODERS)}")
    if name == "cv2":
        optional_import("cv2", "--decoder cv2: OpenCV is not installed (pip install opencv-python-headless); "
                               "use --decoder pil")
    return name


def fill_decoder(name: str, paths: Sequence[str], size: int, device: Any, batch: int = 256) -> str:
    """The decoder that fills a cache in GPU memory: as named, or for 'auto' the JPEG engines, else nvJPEG
    (batches), for files that suit the GPU (`_gpu_decodable`), else `pick_decoder`'s. Nothing trains while the
    cache fills, so the GPU's decoders take no cores or SMs from the model, whatever the cores."""
    if name != "auto":
        return resolve_decoder(name, paths, size)
    if _gpu_decodable(paths, device, batch):
        if hwdecode.has_engines(device):
            return "nvimgcodec"
        if compat.cuda_jpeg_batch_decode() and compat.cuda_jpeg_unavailable(device) is None:
            return "nvjpeg"
    return pick_decoder(paths, size) if paths else AUTO_DECODER


def decide_overlap(choice: str, decoder: str, device: Any, cache: bool) -> tuple[bool, str]:
    """(does the decoding of batch n+1 overlap the augmentation of batch n?, the words that say so or why not).

    `choice` is --decode-overlap: auto (in series), on or off. Overlapping (`fastpath.DeviceLoader`'s
    decoding thread) is possible only where a GPU decoder decodes on CUDA: nothing to overlap on a CPU
    device, from DataLoader workers (processes of their own) or from the cache; nor where torchvision
    decodes one image per call (before 0.19: `compat.cuda_jpeg_overlap_unavailable`). auto keeps decoding
    and augmentation in series: overlapped, the step measured slower on an H200 at 2 and 4 cores, the
    second thread's CPU time coming out of the main thread's (docs/input-pipeline.md, "Overlap on few
    cores"); `on` is there to measure it on another machine."""

    if cache or decoder not in GPU_DECODERS or torch.device(device).type != "cuda":
        return False, ""
    why = compat.cuda_jpeg_overlap_unavailable() if decoder == "nvjpeg" else None
    if why:
        return False, f"decoding and augmentation in series ({why})"
    if choice == "on":
        return True, ("overlapped (--decode-overlap on): the GPU decodes the next batch on a stream of its own "
                      "while this one is augmented")
    if choice == "off":
        return False, "decoding and augmentation in series (--decode-overlap off)"
    return False, ("decoding and augmentation in series: overlapping them (--decode-overlap on) measured slower "
                   "on an H200 at 2 and 4 cores (0.80x/0.79x of synthetic against 0.85x; docs/input-pipeline.md)")


def gpu_unavailable(decoder: str, device: Any) -> str | None:
    """Why GPU decoder `decoder` cannot decode on `device` (one line), or None."""

    if torch.device(device).type != "cuda":
        return "the device is not a GPU"
    return compat.cuda_jpeg_unavailable(device) if decoder == "nvjpeg" else hwdecode.unavailable(device)


def engine_backends(device: Any) -> tuple[str, ...]:
    """nvImageCodec's backends on `device`: ENGINE_BACKENDS where it has JPEG engines, else all (())."""

    return ENGINE_BACKENDS if hwdecode.has_engines(device) else ()


def _gpu_decodable(paths: Sequence[str], device: Any, batch: int) -> bool:
    """The files are JPEGs (a sample of 20), the device is CUDA, and a batch of them decoded at full
    size takes under NVJPEG_MEMORY_SHARE of its memory (phone photos of 12 MP are ~0.6 GB each in
    flight: the CPU decoders' reduced-size decoding then costs the GPU nothing)."""
    sample = list(paths)[:: max(1, len(paths) // 20)][:20]
    if torch.device(device).type != "cuda" or not sample or not all(decode.is_jpeg(p) for p in sample):
        return False
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return batch * mean_pixels(sample) * NVJPEG_BYTES_PER_PIXEL < NVJPEG_MEMORY_SHARE * total


def prefer_engines(paths: Sequence[str], device: Any, batch: int = 256, workers: int | None = None) -> bool:
    """Whether 'auto' decodes on the GPU's hardware JPEG engines (nvImageCodec): the CPU decoders would
    get fewer than NVJPEG_BELOW_WORKERS workers (`workers`; None: not considered), the files suit GPU
    decoding (`_gpu_decodable`), nvImageCodec is installed, and its hardware backend decodes on this GPU.

    The engines use neither CPU cores nor the SMs that train, but the thread that hands their batches
    to the model shares the GIL with the training loop: they out-train the CPU decoders where cores are
    few and lose to them from NVJPEG_BELOW_WORKERS (docs/input-pipeline.md, "Few cores per GPU"). Without
    engines (most GPUs outside the A100/H100/H200 class) nvImageCodec would decode on the SMs like nvJPEG:
    the nvJPEG rule decides."""

    if workers is not None and workers >= NVJPEG_BELOW_WORKERS:
        return False
    if not _gpu_decodable(paths, device, batch):
        return False
    return hwdecode.has_engines(device)  # last: it starts the library and decodes a test JPEG


def prefer_nvjpeg(paths: Sequence[str], device: Any, batch: int = 256, workers: int | None = None) -> bool:
    """Whether 'auto' decodes on the GPU's SMs with torchvision's nvJPEG: the CPU decoders would get
    fewer than NVJPEG_BELOW_WORKERS workers (`workers`; None: not considered), the files suit GPU
    decoding (`_gpu_decodable`), and torchvision decodes batches on this CUDA device (0.19+; one image
    per call is slower than the CPU decoders).

    nvJPEG decodes on the SMs the model trains on, so it only wins where CPU cores are scarce
    (scripts/bench_pipeline.py; the numbers: docs/benchmarks.md).
    """

    if workers is not None and workers >= NVJPEG_BELOW_WORKERS:
        return False
    if not _gpu_decodable(paths, device, batch) or not compat.cuda_jpeg_batch_decode():
        return False
    return compat.cuda_jpeg_unavailable(device) is None  # last: it decodes a tiny JPEG on the GPU


def pick_decoder(paths: Sequence[str], size: int, files: int = 6, margin: float = 0.1) -> str:
    """The CPU decoder that makes the stored form of a few of these JPEGs fastest, in this env.

    Each available decoder decodes the same `files` files after one untimed warm-up (library loading).
    AUTO_DECODER stays unless another is faster by more than `margin`: decoders tie on small images,
    and the choice should not flicker with timing noise. Not JPEGs, or unreadable files: AUTO_DECODER.
    """
    sample = [str(p) for p in list(paths)[:: max(1, len(paths) // files)][:files] if decode.is_jpeg(p)]
    if len(sample) < 2:
        return AUTO_DECODER
    times: dict[str, float] = {}
    for name in decode.CPU_DECODERS:
        try:
            resolve_decoder(name)
            decode.decode_stored(sample[0], size, name)
            t = time.perf_counter()
            for path in sample:
                decode.decode_stored(path, size, name)
            times[name] = time.perf_counter() - t
        except Exception:  # a missing library or an odd file: that decoder is simply not a candidate
            continue
    if AUTO_DECODER not in times:
        return min(times, key=times.get) if times else AUTO_DECODER
    best = min(times, key=times.get)
    return best if times[best] < (1 - margin) * times[AUTO_DECODER] else AUTO_DECODER
