"""--cache-mode gpu: a dataset decoded once into the GPU's own memory, each batch a gather there.

The host caches (`cache`: ram, disk) still cost the CPU every batch: a gather of 256 rows (51 MB at 224 px)
into pinned memory and its copy to the GPU, in a thread whose cores and interpreter lock the training loop
needs too. Kept on the GPU, a batch is two `index_select`s on the loader's stream; the CPU only draws the
crops. That is what keeps a GPU fed from 2 cores (docs/input-pipeline.md, "Decoded once into GPU memory").

The cache is filled before the first epoch by the input plan's decoder (`plan.fill_decoder`): the GPU's
JPEG engines (nvImageCodec) or nvJPEG where they decode these files, whole batches in sample order through
the same sources that decode while training (`sources.NvimgcodecSource`, `sources.NvjpegSource`), else the
CPU decoder in one thread per core, a chunk at a time through host memory. Nothing trains meanwhile, so the
GPU's decoders take nothing from the model. Bad files follow the one rule (`badimages.first_readable`): a
row that failed holds its substitute's pixels, size and label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlenv.data.badimages import bad_image_reason, skipped_line
from dlenv.data.cache import _substitutes, nbytes
from dlenv.data.decode import decode_stored
from dlenv.errors import UserError

log = logging.getLogger("dlenv.data")

#: images decoded on the CPU per chunk before it is copied to the GPU (about 200 MB of host memory at 224 px)
CPU_CHUNK = 1024
#: the share of the GPU's free memory a cache may take when it is asked for (--cache-mode gpu)
MAX_FREE_SHARE = 0.9
#: --cache auto (dlenv.data.plan) keeps a dataset decoded in GPU memory (--cache-mode gpu) when its decoded
#: form takes at most this share of the GPU's memory (5 GiB of an 80 GB H100: 25,000 images at 224 px) and
#: at most half of what is free. Each batch is then a gather on the GPU: no decoding, no copy and no thread
#: on the CPU beyond the crops' drawing, which is what keeps a GPU fed from 2 cores (docs/input-pipeline.md,
#: "Decoded once into GPU memory").
GPU_CACHE_SHARE = 1 / 16


def gpu_memory(device: Any) -> tuple[int, int]:
    """(total, free) bytes of `device`'s memory; (0, 0) for a device that is no CUDA GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0, 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total), int(free)


def gpu_cache_room(need: int, device: Any) -> bool:
    """Whether `need` bytes of decoded images fit GPU_CACHE_SHARE of `device`'s memory and half of its free
    memory (False off CUDA)."""
    total, free = gpu_memory(device)
    return 0 < need <= min(GPU_CACHE_SHARE * total, free / 2)


@dataclass
class DeviceCache:
    """A decoded dataset on a CUDA device: `images` (N, S, S, 3) uint8 and `labels` (N,) int64 there, `sizes`
    (N, 2) int32 decoded width and height on the CPU (the crops are drawn there)."""

    images: torch.Tensor
    sizes: torch.Tensor
    labels: torch.Tensor
    bad: dict[str, str] = field(default_factory=dict)  # path -> reason, for files that failed
    seconds: float = 0.0                                 # the fill's

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def build_device_cache(samples: Sequence[tuple[str, int]], size: int, plan: Any, device: Any, workers: int,
                       say: Callable[[str], None] = print, gpu_source: Callable[..., Any] | None = None
                       ) -> DeviceCache:
    """Decode `samples` once to size x size uint8 squares in `device`'s memory: with `gpu_source` (the
    sources' maker for `plan.decoder`, a GPU decoder: (samples, sampler, plan, device, say) -> source) where
    given, else `plan.cpu_decoder` in `workers` threads. Raises UserError for an empty dataset or one that
    does not fit the GPU's free memory, BadImageError as `plan.bad_images` says."""
    n = len(samples)
    device = torch.device(device)
    if n == 0:
        raise UserError("--cache: the dataset has no images")
    need = nbytes(n, size)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None  # a CPU device: the tests'
    if free is not None and need > MAX_FREE_SHARE * free:
        raise UserError(f"--cache-mode gpu: {n:,} images at {size} px take {need / 2**30:.1f} GiB but {device} has "
                        f"{free / 2**30:.1f} GiB free; use --cache-mode ram or disk")
    decoder = plan.decoder if gpu_source is not None else plan.cpu_decoder
    say(f"--cache: decoding {n:,} images once to {size}x{size} uint8 in {device}'s memory ({need / 2**30:.1f} GiB, "
        f"{decoder})")
    t0 = time.perf_counter()
    images = torch.empty((n, size, size, 3), dtype=torch.uint8, device=device)
    sizes = torch.zeros((n, 2), dtype=torch.int32)
    labels = torch.tensor([int(y) for _, y in samples], dtype=torch.long)
    if gpu_source is not None:
        bad = _fill_gpu(images, sizes, labels, gpu_source(samples, None, plan, device, lambda line: None), device)
    else:
        bad = _fill_cpu(images, sizes, labels, samples, size, decoder, workers, plan.bad_images)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the loaders read it on streams of their own
    seconds = time.perf_counter() - t0
    say(f"--cache: {n:,} images decoded in {seconds:.1f} s ({device}, {n / max(seconds, 1e-9):,.0f} img/s)")
    if bad:  # one line, however many
        log.warning("%s", skipped_line(bad))
    return DeviceCache(images, sizes, labels.to(device), bad, seconds)


def _fill_gpu(images: torch.Tensor, sizes: torch.Tensor, labels: torch.Tensor, source: Any,
              device: torch.device) -> dict[str, str]:
    """The batches of a GPU decoder's `source` (over every sample, in order) into the rows; the source has
    already put each bad file's substitute (pixels and label) in its place."""
    at = 0
    for batch in source:
        out, wh, y = source.upload(batch, device)
        k = out.shape[0]
        images[at:at + k] = out
        sizes[at:at + k] = wh
        labels[at:at + k] = y.cpu()
        at += k
    return dict(source.bad_paths)


def _fill_cpu(images: torch.Tensor, sizes: torch.Tensor, labels: torch.Tensor, samples: Sequence[tuple[str, int]],
              size: int, decoder: str, workers: int, bad_images: str) -> dict[str, str]:
    """`decoder` in `workers` threads, CPU_CHUNK images at a time through host memory, then each bad row
    replaced by its substitute's (`cache._substitutes`, which raises for bad_images='error')."""
    failed: dict[int, str] = {}
    chunk = np.empty((min(CPU_CHUNK, len(samples)), size, size, 3), np.uint8)
    wh = np.zeros((len(chunk), 2), np.int32)

    def work(i: int, start: int) -> None:
        try:
            chunk[i - start], wh[i - start] = decode_stored(samples[i][0], size, decoder)
        except Exception as e:  # any decoder error: the file is what's wrong
            failed[i] = bad_image_reason(e)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for start in range(0, len(samples), len(chunk)):
            stop = min(start + len(chunk), len(samples))
            list(pool.map(lambda i, s=start: work(i, s), range(start, stop)))
            images[start:stop].copy_(torch.from_numpy(chunk[:stop - start]))
            sizes[start:stop] = torch.from_numpy(wh[:stop - start])
    source = _substitutes(failed, samples, bad_images)
    for i in sorted(failed):
        j = int(source[i])
        images[i], sizes[i], labels[i] = images[j], sizes[j], labels[j]
    return {samples[i][0]: r for i, r in sorted(failed.items())}
