"""The options of `dlenv bench-memory`, declared once (dlenv.options.config registers the command; the CLI and the
invoke tasks are generated from this class as from config.py's). No torch here: `dlenv --help` and
`invoke --list` import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlenv.options.declare import (
    BATCH_MAX,
    BATCH_WHY,
    CLASSES_MAX,
    CLASSES_WHY,
    DEVICE_HELP,
    IMG_SIZE_MAX,
    IMG_WHY,
    image_channels,
    opt,
)
from dlenv.options.values import auto_int, parse_float


@dataclass(frozen=True)
class BenchMemoryConfig:
    """Options of `bench-memory`."""

    model: str = opt("resnet50", "a torchvision or timm/ name, or your own FILE.py:factory (measured as it is)")
    batch_size: int = opt(64, "batch size", min=1, max=BATCH_MAX, why=BATCH_WHY)
    img_size: int = opt(224, "image size", min=16, max=IMG_SIZE_MAX, why=IMG_WHY)
    channels: int = image_channels()
    num_classes: int | None = opt(None, "classes of head and targets: auto (your model's own output width, by one "
                                        "forward, built with its factory's own default class count; a named model "
                                        "gets 1000) or N", parse=auto_int, min=1, max=CLASSES_MAX,
                                why=CLASSES_WHY)
    steps: int = opt(10, "training steps measured per configuration", min=2)
    warmup: int = opt(3, "untimed steps before the timed ones (cuDNN autotuning, allocator warm-up)", min=0)
    channels_last: bool = opt(True, "also measure channels_last variants of convolutional models")
    max_batch: bool = opt(False, "also find the largest batch that fits each configuration")
    allocator: bool = opt(True, "also compare the allocator settings this PyTorch offers")
    alloc_steps: int = opt(20, "steps of the shape-changing workload per allocator setting", min=2)
    gpu_memory_gib: float | None = opt(None, "measure as if the GPU had only this many GiB (caps PyTorch's "
                                             "allocator), to see what fits a smaller card", parse=parse_float, min=0.25)
    amp_dtype: str = opt("auto", "AMP dtype", choices=("auto", "fp16", "bf16"))
    device: str = opt("auto", DEVICE_HELP)
    out: str = opt("runs/bench-memory", "output folder for the table, CSV and chart")
