"""Batch sources that decode JPEGs on the GPU, for fastpath.DeviceLoader: nvJPEG through torchvision
(`NvjpegSource`, on the SMs) and nvImageCodec on the hardware JPEG engines (`NvimgcodecSource`). Each
hands `upload` a batch as (B, size, size, 3) uint8 stored squares on the device, with the decoded sizes
and labels, like the other sources of `fastpath`; files they cannot decode go to Pillow.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dlenv.data.badimages import note_skipped
from dlenv.data.decode import exif_orientation, is_jpeg, load_rgb, upright
from dlenv.data.fastpath import SampledSource, chunks
from dlenv.data.loaders import BadImageError, bad_image_reason
from dlenv.errors import UserError
from dlenv.safeio import IMAGE_FILE, open_regular

log = logging.getLogger("dlenv.data")


def _read(path: str) -> tuple[torch.Tensor, int]:
    """A file's bytes as a uint8 tensor, and its EXIF orientation (1 for not-JPEGs). A FIFO or device
    is refused without blocking (`safeio`), as a UserError the batch reports as a bad image."""
    with open_regular(path, "image", IMAGE_FILE) as f:
        raw = bytearray(f.read())
    if not raw:  # torch.frombuffer refuses an empty buffer; the decoders then name the empty file
        return torch.empty(0, dtype=torch.uint8), 1
    return torch.frombuffer(raw, dtype=torch.uint8), exif_orientation(raw) if is_jpeg(path) else 1


class NvjpegSource(SampledSource):
    """Host batches of file bytes (read by threads, one batch ahead); decoded on the GPU in `upload`.

    A file nvJPEG cannot decode (or that is not a JPEG) is decoded by Pillow instead; one Pillow
    cannot decode either is replaced by another image of the batch (logged once) or stops the run,
    as bad_images says. nvJPEG ignores EXIF orientation: the orientation read with the bytes turns
    its output upright on the GPU, as Pillow's decode on the other paths is.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], sampler: Any, batch_size: int, size: int,
                 bad_images: str, threads: int = 8):
        super().__init__(len(samples), sampler, batch_size)
        self.samples, self.size, self.bad_images = list(samples), size, bad_images
        self.threads = threads
        self.bad_paths: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple]:
        with ThreadPoolExecutor(self.threads) as pool:
            pending = None
            for chunk in chunks(self.indices(), self.batch_size):
                reads = [pool.submit(_read, self.samples[i][0]) for i in chunk]
                if pending is not None:
                    yield self._collect(*pending)
                pending = (chunk, reads)
            if pending is not None:
                yield self._collect(*pending)

    def _collect(self, chunk: list[int], reads: list) -> tuple:
        data, turns = [], []
        for f in reads:
            try:
                raw, orientation = f.result()
            except (OSError, UserError) as e:
                raw, orientation = e, 1
            data.append(raw)
            turns.append(orientation)
        return chunk, data, turns

    def upload(self, batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chunk, data, turns = batch
        paths = [self.samples[i][0] for i in chunk]
        images: list[torch.Tensor | None] = [None] * len(chunk)
        gpu = [k for k, (p, d) in enumerate(zip(paths, data, strict=True))
               if is_jpeg(p) and isinstance(d, torch.Tensor)]
        turn = self.turns_needed(device)
        try:
            decoded = self._decode_batch([data[k] for k in gpu], device)
            for k, img in zip(gpu, decoded, strict=True):
                images[k] = upright(img, turns[k]) if turn and img is not None else img
        except RuntimeError:
            pass  # one bad file fails the whole batch call: the loop below decodes one by one
        _fill_in(images, paths, lambda k: self._one(paths[k], data[k], turns[k], device), self.bad_images,
                 self.bad_paths)
        sizes = torch.tensor([[img.shape[2], img.shape[1]] for img in images], dtype=torch.int32)
        labels = torch.tensor([self.samples[i][1] for i in chunk], dtype=torch.long)
        return _squash(images, self.size), sizes, labels.to(device, non_blocking=True)

    def _decode_batch(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """(3, H, W) uint8 images on `device` (None where one could not be decoded); RuntimeError where the
        whole call failed."""
        from dlenv import compat

        if compat.cuda_jpeg_batch_decode():
            return compat.decode_jpeg(data, device=device)
        return [compat.decode_jpeg(d, device=device) for d in data]

    @staticmethod
    def turns_needed(device: Any) -> bool:
        """Whether decode_jpeg's output still needs EXIF orientation applied: always on CUDA (nvJPEG
        ignores it), on the CPU where this torchvision cannot apply it (before 0.17)."""
        from dlenv import compat

        return torch.device(device).type == "cuda" or not compat.decode_jpeg_applies_exif()

    @staticmethod
    def _one(path: str, data: Any, orientation: int, device: torch.device) -> torch.Tensor:
        from dlenv import compat

        if isinstance(data, torch.Tensor) and is_jpeg(path):
            with contextlib.suppress(RuntimeError):
                img = compat.decode_jpeg(data, device=device)
                return upright(img, orientation) if NvjpegSource.turns_needed(device) else img
        if isinstance(data, BaseException):
            raise data
        arr = np.asarray(load_rgb(path))
        return torch.from_numpy(arr).permute(2, 0, 1).to(device)


class NvimgcodecSource(SampledSource):
    """Batches decoded by nvImageCodec (dlenv.data.hwdecode) on the GPU's hardware JPEG engines where it
    has them, which leaves CPU cores and SMs alone. The library reads the files itself (they were
    listed as regular files) and applies EXIF orientation.

    Why so few Python calls per batch: the thread that prepares batches shares the GIL with the training
    loop, and each call that releases it (a torch op, a file read) waits for the loop to let it go
    again. Reading 256 files in Python threads and turning 256 images into views cost about a thousand
    such waits a batch: beside ResNet-50 the engines then fed 4,000 img/s of the 15,000+ they decode
    alone (H200). Here a batch is one read call, one stack per image size and the resize.

    A file the library cannot decode (or that is not a JPEG) is decoded by Pillow, and one Pillow
    cannot decode either is replaced or stops the run as bad_images says, as on the other paths. The
    decoder is made here, in the process's main thread, so its start-up output stays off the console.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], sampler: Any, batch_size: int, size: int,
                 bad_images: str, device: Any, decode_threads: int = 2):
        from dlenv.data.hwdecode import HwJpegDecoder, has_engines

        super().__init__(len(samples), sampler, batch_size)
        self.samples, self.size, self.bad_images = list(samples), size, bad_images
        self.bad_paths: dict[str, str] = {}
        # with engines, only they and the CPU decode: nvImageCodec would otherwise hand part of each batch
        # to its CUDA decoder, on the SMs the model trains on
        backends = ("HW_GPU_ONLY", "CPU_ONLY") if has_engines(device) else ()
        self.decoder = HwJpegDecoder(device, threads=decode_threads, backends=backends)

    def __iter__(self) -> Iterator[list[int]]:
        return chunks(self.indices(), self.batch_size)

    def upload(self, chunk: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        paths = [self.samples[i][0] for i in chunk]
        jpegs = [k for k, p in enumerate(paths) if is_jpeg(p)]
        images: list[torch.Tensor | None] = [None] * len(chunk)  # (H, W, 3) uint8 on the device
        try:
            for k, img in zip(jpegs, self.decoder.read([paths[k] for k in jpegs]), strict=True):
                images[k] = img
        except RuntimeError:
            pass  # the whole call failed: the loop below decodes one by one
        _fill_in(images, paths, lambda k: torch.from_numpy(np.array(load_rgb(paths[k]))).to(device),
                 self.bad_images, self.bad_paths)  # np.array: a writable copy for torch
        sizes = torch.tensor([[img.shape[1], img.shape[0]] for img in images], dtype=torch.int32)
        labels = torch.tensor([self.samples[i][1] for i in chunk], dtype=torch.long)
        return _squash(images, self.size, channels_last=True), sizes, labels.to(device, non_blocking=True)


def _fill_in(images: list[torch.Tensor | None], paths: list[str], decode_one: Callable[[int], torch.Tensor],
             bad_images: str, bad_paths: dict[str, str]) -> None:
    """Decode the batch's gaps (None) one by one with `decode_one(k)`; a file that fails there too is
    replaced by the next readable image of the batch and logged once (recorded in `bad_paths`), or,
    with bad_images 'error' or nothing readable, raises BadImageError naming it."""
    bad: list[tuple[int, str]] = []
    for k, img in enumerate(images):
        if img is None:
            try:
                images[k] = decode_one(k)
            except Exception as e:  # the file is what's wrong
                bad.append((k, bad_image_reason(e)))
    good = [k for k in range(len(images)) if images[k] is not None]
    for k, reason in bad:
        if bad_images == "error" or not good:
            raise BadImageError(paths[k], reason)
        note_skipped(bad_paths, paths[k], reason)
        images[k] = images[next((g for g in good if g > k), good[0])]  # the next readable one


def _squash(images: list[torch.Tensor], size: int, channels_last: bool = False) -> torch.Tensor:
    """(3, H, W) uint8 images of any sizes ((H, W, 3) with `channels_last`) -> (B, size, size, 3) uint8,
    antialiased; one resize per distinct input size (datasets of one camera resize in a single call)."""
    out = torch.empty((len(images), size, size, 3), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, img in enumerate(images):
        groups.setdefault(tuple(img.shape), []).append(k)
    for ks in groups.values():
        x = torch.stack([images[k] for k in ks])
        x = (x.permute(0, 3, 1, 2) if channels_last else x).float()
        y = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out[ks] = y.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return out
