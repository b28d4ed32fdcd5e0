"""The CPU's JPEG decoders, and the fixed-size "stored form" the fast input path works on.

Three CPU decoders give the same RGB image (within JPEG rounding): Pillow (`pil`, with JPEG draft
mode: the decoder itself downscales by 2, 4 or 8 when the target is that much smaller), OpenCV
(`cv2`, with IMREAD_REDUCED_* for the same reason) and torchvision.io (`tvio`, libjpeg-turbo through
torch). JPEG decoding on the GPU works on whole batches and lives in `sources`: `nvimgcodec` on the
GPU's hardware JPEG engines (`hwdecode`), `nvjpeg` on its SMs (torchvision.io). Which decoder a run
uses is the input plan's decision (`plan.resolve_decoder`). Files that are not JPEGs, and JPEGs a
backend fails on, go through Pillow's `load_rgb`, which handles every colour mode and raises the real
error for a broken file.

The stored form: the whole frame resized ("squashed") to size x size uint8 RGB, height x width x 3,
plus the decoded width and height. Every image of a dataset has the same shape, so batches are plain
uint8 tensors (4x smaller than float) and the random crop is cut on the GPU: crop boxes are drawn in
the image's own proportions and mapped onto the squashed square (`gpu_aug`), so RandomResizedCrop
still sees the whole frame with its true aspect ratio.
"""

from __future__ import annotations

import contextlib
import os
import struct
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlenv.errors import optional_import
from dlenv.files.safeio import IMAGE_FILE, open_regular

#: the CPU decoders `decode_rgb` and `decode_stored` know
CPU_DECODERS = ("pil", "cv2", "tvio")
#: the stored square is this much larger than the training size, so crops are resampled, not stretched
STORE_MARGIN = 1.15
_JPEG_EXT = (".jpg", ".jpeg", ".jpe", ".jfif")


def stored_size(img_size: int) -> int:
    """Side of the stored square for a training size (224 -> 258)."""
    return int(round(img_size * STORE_MARGIN))


def is_jpeg(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(_JPEG_EXT)


def exif_orientation(data: bytes | bytearray | memoryview) -> int:
    """The EXIF orientation (1-8) in a JPEG's bytes; 1 when there is none or it cannot be read.

    Read from the bytes already in memory (the APP1 segment's first IFD), so deciding whether a photo
    needs turning costs no second open of the file and no decoder. Phones store portrait shots
    sideways with orientation 6 or 8; decoders that ignore it (nvJPEG) train on them lying down.
    """
    view = memoryview(data)[:131072]  # APP1 comes right after the start-of-image marker
    i = bytes(view).find(b"Exif\x00\x00")
    if i < 0:
        return 1
    tiff = i + 6
    order = bytes(view[tiff:tiff + 2])
    endian = {b"II": "<", b"MM": ">"}.get(order)
    if endian is None:
        return 1
    try:
        (ifd,) = struct.unpack_from(endian + "I", view, tiff + 4)
        (entries,) = struct.unpack_from(endian + "H", view, tiff + ifd)
        for k in range(min(entries, 512)):
            # tag, type, count, then a SHORT value left-aligned in the 4-byte value field
            tag, _, _, value = struct.unpack_from(endian + "HHIH", view, tiff + ifd + 2 + 12 * k)
            if tag == 0x0112:
                return value if 1 <= value <= 8 else 1
    except struct.error:  # a truncated or malformed block: keep the image as stored
        return 1
    return 1


def upright(image: Any, orientation: int) -> Any:
    """A (..., H, W) tensor turned the way EXIF `orientation` says, as Pillow's exif_transpose does."""
    import torch

    h, w = image.dim() - 2, image.dim() - 1
    if orientation == 2:
        return image.flip(w)
    if orientation == 3:
        return image.flip((h, w))
    if orientation == 4:
        return image.flip(h)
    if orientation == 5:
        return image.transpose(h, w)
    if orientation == 6:
        return torch.rot90(image, -1, (h, w))
    if orientation == 7:
        return image.transpose(h, w).flip((h, w))
    if orientation == 8:
        return torch.rot90(image, 1, (h, w))
    return image


# ---------------------------------------------------------------------------------------------------
# Any image to 8-bit RGB (Pillow): every path's fallback.


def _to_8bit(im: Any) -> Any:
    """A 16-bit or 32-bit single-channel image scaled (not clipped) into 8-bit 'L'."""
    import numpy as np
    from PIL import Image

    arr = np.asarray(im)
    if im.mode == "F":
        peak = float(arr.max()) if arr.size else 1.0
        scaled = arr * 255.0 if peak <= 1.0 else arr * (255.0 / peak)
    elif im.mode.startswith("I;16") or arr.max(initial=0) > 255:
        # 16-bit data (PNG opens as I;16 or I): 65535 -> 255, keeping the full tonal range.
        scaled = arr.astype(np.float32) / 257.0
    else:
        scaled = arr
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))  # 2-D uint8: mode L


def load_rgb(path: str | os.PathLike, min_size: int | None = None) -> Any:
    """Decode an image file to a PIL Image in 8-bit RGB, fully loaded and closed.

    `min_size`: a JPEG at least twice that size on both sides is decoded at 1/2, 1/4 or 1/8 scale
    (Pillow's draft mode, done inside the decoder and several times faster), never below min_size on
    its shorter side; use it when the image will be downscaled anyway.

    EXIF orientation is applied. Grayscale and CMYK are converted; 16-bit images are scaled to 8
    bits; transparency (RGBA, LA, palette with a transparent colour) is composited on WHITE, the
    way a viewer shows it, rather than dropped, which would expose whatever colour the transparent
    pixels happen to store (often black). Raises whatever PIL raises for a broken file, and
    UserError for a FIFO, device or file over IMAGE_FILE (`safeio`: opened without blocking).
    """
    from PIL import Image, ImageOps

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EXIF and palette warnings are noise for training
        with open_regular(path, "image", IMAGE_FILE) as f, Image.open(f) as im:
            if min_size and im.format == "JPEG":
                im.draft(im.mode, (min_size, min_size))
            im.load()
            # A malformed EXIF block is not a broken image: keep it unrotated.
            with contextlib.suppress(Exception):
                im = ImageOps.exif_transpose(im)
            if im.mode == "P":
                im = im.convert("RGBA" if "transparency" in im.info else "RGB")
            elif im.mode == "PA":
                im = im.convert("RGBA")
            elif im.mode in ("I", "F") or im.mode.startswith("I;16"):
                im = _to_8bit(im)
            if im.mode in ("RGBA", "LA", "La", "RGBa"):
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, rgba).convert("RGB")
            return im.convert("RGB") if im.mode != "RGB" else im.copy()


# ---------------------------------------------------------------------------------------------------
# Decoding a whole image (the CPU path: torchvision transforms on a PIL image).


def _cv2() -> Any:
    """OpenCV; ImportError when it is not installed (callers fall back to Pillow), one line naming it and pip
    check when it is installed but fails to import (dlenv.errors.optional_import)."""
    cv2 = optional_import("cv2")
    if cv2 is None:
        raise ImportError("OpenCV (cv2) is not installed")
    cv2.setNumThreads(1)  # one image per call, many calls in parallel: OpenCV's own threads only contend
    return cv2


#: start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic coded)
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def jpeg_size(data: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame header (as stored, before EXIF turning); None when
    the bytes have no readable frame header.

    Walking the segment lengths to the SOF marker reads a few dozen bytes, where opening the file
    with Pillow only to learn its size cost about a sixth of a decode.
    """
    view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1))
    n, i = len(view), 2
    if n < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    while i + 9 <= n:
        if view[i] != 0xFF:
            return None
        marker = view[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _SOF:
            h = view[i + 5] << 8 | view[i + 6]
            w = view[i + 7] << 8 | view[i + 8]
            return (w, h) if w and h else None
        if marker == 0xD9 or marker == 0xDA:  # end of image, or scan data before any frame header
            return None
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            i += 2
            continue
        i += 2 + (view[i + 2] << 8 | view[i + 3])
    return None


def _cv2_bgr(path: str, min_side: int | None) -> np.ndarray | None:
    """OpenCV decode to BGR (EXIF orientation applied) at the largest 1/2, 1/4 or 1/8 reduction that
    keeps min_side; None on failure. The file is read once: the size comes from its own header."""
    cv2 = _cv2()
    with open_regular(path, "image", IMAGE_FILE) as f:
        data = np.fromfile(f, np.uint8)
    flag = cv2.IMREAD_COLOR
    size = jpeg_size(data) if min_side else None
    if size:
        short = min(size)
        for factor, reduced in ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4),
                                (2, cv2.IMREAD_REDUCED_COLOR_2)):
            if short // factor >= min_side:
                flag = reduced
                break
    bgr = cv2.imdecode(data, flag) if data.size else None
    if bgr is None or bgr.ndim != 3:
        return None
    return bgr


def _cv2_rgb(path: str, min_side: int | None) -> np.ndarray | None:
    """`_cv2_bgr` as RGB."""
    bgr = _cv2_bgr(path, min_side)
    return None if bgr is None else _cv2().cvtColor(bgr, _cv2().COLOR_BGR2RGB)


def _tvio_rgb(path: str) -> Any:
    """torchvision.io decode to a (3, H, W) uint8 tensor; None on failure, or for a rotated photo
    when this torchvision cannot apply EXIF orientation (Pillow then decodes it)."""
    import torch

    from dlenv import compat

    with open_regular(path, "image", IMAGE_FILE) as f:
        raw = bytearray(f.read())
    if not raw:
        return None
    data = torch.frombuffer(raw, dtype=torch.uint8)
    if not compat.decode_jpeg_applies_exif() and exif_orientation(data.numpy().data) != 1:
        return None
    try:
        return compat.decode_jpeg(data)
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
        bgr = _cv2_bgr(path, size)
        if bgr is not None:  # squared first: the channel swap then touches the small image only
            h, w = bgr.shape[:2]
            return _cv2().cvtColor(to_square(bgr, size), _cv2().COLOR_BGR2RGB), (w, h)
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


def mean_pixels(paths: Sequence[str]) -> float:
    """Mean width x height of these images, from their headers (no decoding); unreadable ones skipped."""
    from PIL import Image

    sizes = []
    for p in paths:
        try:
            with open_regular(p, "image", IMAGE_FILE) as f, Image.open(f) as im:
                sizes.append(im.size[0] * im.size[1])
        except Exception:  # a broken file is the loaders' business, not this estimate's
            continue
    return sum(sizes) / len(sizes) if sizes else 0.0
