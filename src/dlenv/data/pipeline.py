"""Where the data is, and the loaders and data an input plan describes: the pipeline builds, it does not decide.

    located = locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)            # folder, demo or synthetic
    plan = InputOptions.of(cfg).decide(located, device, batch, img_size)          # dlenv.data.plan
    data = build(located, plan, device, dist)                                     # the loaders

`build` gives the trainer its `Data`: this rank's share of the training set and its shard of validation,
from `make_loaders`, which builds the (train, val) loaders the plan says: the device path (`fastpath`
over the plan's source from `sources.SOURCES`: uint8 batches augmented on the device) or the CPU path
(`loaders`: torchvision transforms in the workers). bench-data measures variants of the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv.cluster import distributed
from dlenv.data import imagesize
from dlenv.data.demo import ensure_demo_data, is_demo_folder
from dlenv.data.fastpath import DeviceLoader
from dlenv.data.folder import find_layout
from dlenv.data.gpu_aug import Crops, GpuAugment
from dlenv.data.loaders import build_loaders
from dlenv.data.sampler import ResumableSampler
from dlenv.data.sources import SOURCES
from dlenv.data.synthetic import SyntheticLoader
from dlenv.errors import UserError, need_folder

#: micro-batches per epoch of --synthetic data without --max-steps
SYNTHETIC_BATCHES = 100
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

        return self.source == "demo" or (self.layout is not None and is_demo_folder(self.layout.root))

    @property
    def img_size(self) -> int:
        """The training size when --img-size is auto: see `auto_img_size`."""
        return auto_img_size(self)[0]


def auto_img_size(located: Located) -> tuple[int, str]:
    """(--img-size auto's size, the reason): the median shorter side of up to 200 training images (headers
    only), capped at AUTO_IMG_SIZE_CAP for speed; 224 for synthetic data or when no header can be read."""

    if located.layout is None or not located.layout.train:
        return 224, "the default for synthetic data"
    found = imagesize.typical_side([p for p, _ in located.layout.train])
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

    if data is None:

        root, source = ensure_demo_data(), "demo"
    else:
        root, source = Path(data), str(data)
        need_folder(root, "--data", "pass a folder of class folders (or with train/ and val/), or unpack an "
                    "archive with `invoke unpack`")
    layout = find_layout(root, val_split, seed)
    if not layout.train or not layout.classes:
        raise UserError(f"--data {root}: no training images in class folders found")
    return Located(layout, list(layout.classes), source)


# ---------------------------------------------------------------------------------------------------
# Building what the plan says.


def make_loaders(layout: Any, plan: Any, device: Any, *, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format, train_sampler: Any = None,
                 val_sampler: Any = None, say: Callable[[str], None] = print) -> tuple[Any, Any]:
    """(train, val) loaders of a folder.Layout as `plan` (a dlenv.data.plan.InputPlan) says; val is None when
    the layout has no val.

    Train goes in `train_sampler` order (default: a ResumableSampler seeded by the plan's seed). On the
    device path batches arrive on `device`, in `memory_format` and `dtype`, and val goes in `val_sampler`
    order (default: sample order). Raises UserError for a cache that does not fit.
    """
    device = torch.device(device)
    if not plan.on_device:

        return build_loaders(layout, plan, train_sampler, pin_memory=device.type == "cuda")

    make_source = SOURCES[plan.source]
    splits = [(layout.train, train_sampler, True)] + ([(layout.val, val_sampler, False)] if layout.val else [])
    out = []
    crops = Crops(plan.train_scale, plan.train_ratio, plan.hflip)
    for samples, sampler, train in splits:
        augment = GpuAugment(plan.img_size, train, dtype, memory_format, crops, plan.norm, plan.interpolation)
        if train and sampler is None:
            sampler = ResumableSampler(len(samples), seed=plan.seed, batch_size=plan.batch_size)
        source = make_source(samples, sampler, plan, device, say)
        out.append(DeviceLoader(source, augment, device, plan.batch_size, sampler, plan.seed,
                                overlap=plan.overlap))
    return out[0], (out[1] if len(out) > 1 else None)


@dataclass
class Data:
    """What the trainer iterates: train and val batches, the resumable sampler, and the plan they follow."""

    train: Any                  # iterable of (images, targets)
    val: Any                    # iterable, or None
    sampler: Any                # ResumableSampler, or None for synthetic data
    classes: list[str]
    source: str                 # what to print and store: folder path, "demo", "synthetic"
    plan: Any                   # the dlenv.data.plan.InputPlan


def build(located: Located, plan: Any, device: Any, dist: Any, *, dtype: torch.dtype = torch.float32,
          memory_format: torch.memory_format = torch.contiguous_format, max_steps: int | None = None,
          say: Callable[[str], None] = print) -> Data:
    """The training and validation batches of this process (`dist`: a distributed.DistInfo) as `plan` (a
    dlenv.data.plan.InputPlan) says, in the model's `dtype` and `memory_format`.

    Synthetic data (`located.layout` None) is made on the device: `max_steps` batches per epoch
    (SYNTHETIC_BATCHES without it). A real
    dataset trains on this rank's share of a resumable sampler and validates on its own shard, without
    padding (the trainer's validation sums the shards); `say` prints what the cache decodes.
    """

    device = torch.device(device)
    seed = plan.seed
    if located.layout is None:

        n, b, size, k = max_steps or SYNTHETIC_BATCHES, plan.batch_size, plan.img_size, len(located.classes)
        train = SyntheticLoader(b, size, k, device, n, memory_format, seed)
        val = SyntheticLoader(b, size, k, device, 2, memory_format, seed + 1)
        return Data(train, val, None, located.classes, located.source, plan)
    layout = located.layout
    sampler = ResumableSampler(len(layout.train), seed=seed, rank=dist.rank, world_size=dist.world_size,
                               batch_size=plan.batch_size)
    sharded = layout.val and dist.world_size > 1
    val_sampler = distributed.EvalShardSampler(len(layout.val), dist.rank, dist.world_size) if sharded else None
    train, val = make_loaders(layout, plan, device, dtype=dtype, memory_format=memory_format, train_sampler=sampler,
                              val_sampler=val_sampler, say=say)
    if not plan.on_device and val is not None:  # the CPU path's loader: a copy that reads this rank's shard
        val = distributed.shard_eval_loader(val, dist.rank, dist.world_size)
    return Data(train, val, sampler, located.classes, located.source, plan)
