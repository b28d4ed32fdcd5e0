"""JPEG decoding backends, and the fixed-size "stored form" the fast input path works on.

Three CPU decoders give the same RGB image (within JPEG rounding): Pillow (`pil`, with JPEG draft
mode: the decoder itself downscales by 2, 4 or 8 when the target is that much smaller), OpenCV
(`cv2`, with IMREAD_REDUCED_* for the same reason) and torchvision.io (`tvio`, libjpeg-turbo through
torch). JPEG decoding on the GPU (`nvjpeg`) works on whole batches and lives in `fastpath`. Files
that are not JPEGs, and JPEGs a backend fails on, go through Pillow's `load_rgb`, which handles every
colour mode and raises the real error for a broken file.

The stored form: the whole frame resized ("squashed") to size x size uint8 RGB, height x width x 3,
plus the decoded width and height. Every image of a dataset has the same shape, so batches are plain
uint8 tensors (4x smaller than float) and the random crop is cut on the GPU: crop boxes are drawn in
the image's own proportions and mapped onto the squashed square (`gpu_aug`), so RandomResizedCrop
still sees the whole frame with its true aspect ratio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlenv.data.loaders import load_rgb
from dlenv.errors import UserError

#: CPU decoders, and the one 'auto' picks: measured fastest per core in scripts/bench_pipeline.py.
CPU_DECODERS = ("pil", "cv2", "tvio")
AUTO_DECODER = "pil"
#: the stored square is this much larger than the training size, so crops are resampled, not stretched
STORE_MARGIN = 1.15
_JPEG_EXT = (".jpg", ".jpeg", ".jpe", ".jfif")


def stored_size(img_size: int) -> int:
    """Side of the stored square for a training size (224 -> 258)."""
    return int(round(img_size * STORE_MARGIN))


def is_jpeg(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(_JPEG_EXT)


def resolve_decoder(name: str, paths: Sequence[str] = (), size: int = 258, gpu: Any = None) -> str:
    """'auto' -> 'nvjpeg' where `gpu` (a CUDA device whose batches are augmented there) can batch-decode
    JPEGs and `paths` are JPEGs, else the fastest CPU decoder on a few of `paths` (`pick_decoder`;
    AUTO_DECODER without paths); a named one is checked to be importable.

    'nvjpeg' is returned as is (`fastpath` checks the GPU). Raises UserError for an unknown name or a
    missing library.
    """
    if name == "auto":
        if gpu is not None and prefer_nvjpeg(paths, gpu):
            return "nvjpeg"
        return pick_decoder(paths, size) if paths else AUTO_DECODER
    if name == "nvjpeg":
        return name
    if name not in CPU_DECODERS:
        raise UserError(f"--decoder {name!r} is not one of: auto, {', '.join(CPU_DECODERS)}, nvjpeg")
    if name == "cv2":
        try:
            import cv2  # noqa: F401
        except ImportError:
            raise UserError("--decoder cv2: OpenCV is not installed (pip install opencv-python-headless); "
                            "use --decoder pil") from None
    return name


def prefer_nvjpeg(paths: Sequence[str], device: Any) -> bool:
    """Whether 'auto' decodes on the GPU: the files are JPEGs, and torchvision decodes batches of them
    on this CUDA device (0.19+; one image per call is slower than the CPU decoders). On an H200 with 16
    CPUs it trained ResNet-50 --amp at 3,536 img/s against 3,203 with the best CPU decoder
    (scripts/bench_pipeline.py, docs/data.md): fewer cores per GPU only widen the gap."""
    import torch

    from dlenv import compat

    sample = list(paths)[:: max(1, len(paths) // 20)][:20]
    if torch.device(device).type != "cuda" or not sample or not all(is_jpeg(p) for p in sample):
        return False
    return compat.cuda_jpeg_batch_decode() and compat.cuda_jpeg_unavailable(device) is None


def pick_decoder(paths: Sequence[str], size: int, files: int = 6, margin: float = 0.1) -> str:
    """The CPU decoder that makes the stored form of a few of these JPEGs fastest, in this env.

    Each available decoder decodes the same `files` files after one untimed warm-up (library loading).
    AUTO_DECODER stays unless another is faster by more than `margin`: decoders tie on small images,
    and the choice should not flicker with timing noise. Not JPEGs, or unreadable files: AUTO_DECODER.
    """
    sample = [str(p) for p in list(paths)[:: max(1, len(paths) // files)][:files] if is_jpeg(p)]
    if len(sample) < 2:
        return AUTO_DECODER
    times: dict[str, float] = {}
    for name in CPU_DECODERS:
        try:
            resolve_decoder(name)
            decode_stored(sample[0], size, name)
            t = time.perf_counter()
            for path in sample:
                decode_stored(path, size, name)
            times[name] = time.perf_counter() - t
        except Exception:  # a missing library or an odd file: that decoder is simply not a candidate
            continue
    if AUTO_DECODER not in times:
        return min(times, key=times.get) if times else AUTO_DECODER
    best = min(times, key=times.get)
    return best if times[best] < (1 - margin) * times[AUTO_DECODER] else AUTO_DECODER


# ---------------------------------------------------------------------------------------------------
# Decoding a whole image (the classic path: torchvision transforms on a PIL image).


def _cv2() -> Any:
    import cv2

    cv2.setNumThreads(1)  # one image per call, many calls in parallel: OpenCV's own threads only contend
    return cv2


def _cv2_rgb(path: str, min_side: int | None) -> np.ndarray | None:
    """OpenCV decode to RGB at the largest 1/2, 1/4 or 1/8 reduction that keeps min_side; None on failure."""
    cv2 = _cv2()
    flag = cv2.IMREAD_COLOR
    if min_side:
        from PIL import Image

        with Image.open(path) as im:
            short = min(im.size)
        for factor, reduced in ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4),
                                (2, cv2.IMREAD_REDUCED_COLOR_2)):
            if short // factor >= min_side:
                flag = reduced
                break
    bgr = cv2.imread(path, flag)
    if bgr is None or bgr.ndim != 3:
        return None
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _tvio_rgb(path: str) -> Any:
    """torchvision.io decode to a (3, H, W) uint8 tensor; None on failure, or for a rotated photo
    when this torchvision cannot apply EXIF orientation (Pillow then decodes it)."""
    import torchvision.io

    from dlenv import compat

    if not compat.decode_jpeg_applies_exif():
        from PIL import Image

        with Image.open(path) as im:
            if im.getexif().get(0x0112, 1) != 1:
                return None
    try:
        return compat.decode_jpeg(torchvision.io.read_file(path))
    except RuntimeError:
        return None


def decode_rgb(path: str | os.PathLike, decoder: str = "pil", min_side: int | None = None) -> Any:
    """Decode to a PIL RGB image with `decoder` ('pil', 'cv2' or 'tvio').

    `min_side`: the image may come back downscaled (never below min_side on its shorter side) where
    the decoder can do that cheaply. Raises what Pillow raises for a broken file.
    """
    from PIL import Image

    path = str(path)
    if decoder != "pil" and is_jpeg(path):
        if decoder == "cv2":
            rgb = _cv2_rgb(path, min_side)
            if rgb is not None:
                return Image.fromarray(rgb)
        elif decoder == "tvio":
            t = _tvio_rgb(path)
            if t is not None:
                return Image.fromarray(t.permute(1, 2, 0).numpy())
    return load_rgb(path, min_size=min_side)


# ---------------------------------------------------------------------------------------------------
# The stored form.


def decode_stored(path: str | os.PathLike, size: int, decoder: str = "pil") -> tuple[np.ndarray, tuple[int, int]]:
    """(size x size x 3 uint8 RGB of the whole frame, (width, height) as decoded).

    The width and height may be a 1/2, 1/4 or 1/8 reduction of the file's (draft decoding); only
    their ratio is used. Raises what Pillow raises for a broken file.
    """
    path = str(path)
    rgb = None
    if decoder == "tvio" and is_jpeg(path):
        t = _tvio_rgb(path)
        if t is not None:
            rgb = np.ascontiguousarray(t.permute(1, 2, 0).numpy())
    elif decoder == "cv2" and is_jpeg(path):
        rgb = _cv2_rgb(path, size)
    if rgb is None:
        rgb = np.asarray(load_rgb(path, min_size=size))
    h, w = rgb.shape[:2]
    return to_square(rgb, size), (w, h)


def to_square(rgb: np.ndarray, size: int) -> np.ndarray:
    """H x W x 3 uint8 -> size x size x 3 uint8, the whole frame (aspect ratio not kept).

    OpenCV's bilinear resize is 5-10x faster than Pillow's antialiased one; down to half size it
    already averages 2x2 pixels, so area averaging (slower) is only used for larger reductions.
    """
    try:
        cv2 = _cv2()
    except ImportError:
        from PIL import Image

        return np.asarray(Image.fromarray(rgb).resize((size, size), Image.BILINEAR))
    h, w = rgb.shape[:2]
    interp = cv2.INTER_AREA if max(w, h) > 2 * size else cv2.INTER_LINEAR
    return cv2.resize(rgb, (size, size), interpolation=interp)
