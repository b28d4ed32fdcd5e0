"""The sources of the device path's batches, behind one small protocol, picked by the input plan's name.

A source is an iterable of host batches with a length (batches per epoch), `upload(batch, device)` that
turns one into (images, sizes, labels) on the device: (B, S, S, 3) uint8 stored squares (the whole frame
squashed, `decode`), (B, 2) int32 decoded width and height, (B,) int64 labels; `bad_paths` ({path: reason}
of the files it skipped), and optionally `close()`. `fastpath.DeviceLoader` augments what it uploads.

- `workers` (`WorkerSource`): DataLoader worker processes decode JPEGs (Pillow, OpenCV or torchvision.io);
- `cache` (`CacheSource`): rows copied out of a dataset decoded once (`cache`), no decoding at all; with
  --cache-mode gpu (`DeviceCacheSource`) rows gathered on the GPU from one decoded into its memory (`gpucache`);
- `nvjpeg` (`NvjpegSource`): threads only read file bytes; torchvision.io.decode_jpeg decodes the batch on
  the GPU's SMs;
- `nvimgcodec` (`NvimgcodecSource`): nvImageCodec decodes it on the GPU's hardware JPEG engines (`hwdecode`).

`SOURCES` maps `InputPlan.source` to the function that makes each from a split's samples and the plan.
Every source follows the one bad-image rule (`badimages.first_readable`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from dlenv import compat
from dlenv.data import hwdecode
from dlenv.data.badimages import KnownBad, bad_image_reason, first_readable, note_skipped
from dlenv.data.cache import DecodedCache, build_cache
from dlenv.data.decode import decode_stored, exif_orientation, is_jpeg, load_rgb, stored_size, upright
from dlenv.data.gpucache import build_device_cache
from dlenv.data.loaders import ImageDataset, make_loader
from dlenv.errors import UserError
from dlenv.files.safeio import IMAGE_FILE, open_regular
from dlenv.options.cpus import usable_cpus

#: nvImageCodec's CPU threads (parsing, and its CPU fallback)
NVIMGCODEC_THREADS = 2
#: threads that read the nvJPEG source's file bytes, one batch ahead
NVJPEG_READERS = 8


class Source(Protocol):
    """What `fastpath.DeviceLoader` reads: see the module docstring."""

    bad_paths: dict[str, str]

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def upload(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def stored_tensors(item: tuple[np.ndarray, tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_stored's (array, (w, h)) -> (uint8 tensor, int32 tensor), for DataLoader collation."""
    arr, wh = item
    return torch.from_numpy(arr), torch.tensor(wh, dtype=torch.int32)


def chunks(indices: list[int], size: int) -> Iterator[list[int]]:
    for k in range(0, len(indices), size):
        yield indices[k:k + size]


class SampledSource:
    """Batches of indices from a sampler (a ResumableSampler's epoch and start are honoured)."""

    def __init__(self, n: int, sampler: Any, batch_size: int):
        self.n, self.sampler, self.batch_size = n, sampler, batch_size

    def indices(self) -> list[int]:
        return list(self.sampler) if self.sampler is not None else list(range(self.n))

    def __len__(self) -> int:
        total = len(self.sampler) if self.sampler is not None else self.n
        return -(-total // self.batch_size)


class CacheSource(SampledSource):
    """Host batches gathered from a DecodedCache into pinned memory (on CUDA); a bad file's row and label are
    its substitute's (`DecodedCache.source`)."""

    def __init__(self, cache: DecodedCache, sampler: Any, batch_size: int, pin: bool):
        super().__init__(len(cache), sampler, batch_size)
        self.cache, self.pin = cache, pin
        self.images = torch.from_numpy(cache.images)
        self.sizes = torch.from_numpy(np.ascontiguousarray(cache.sizes))
        self.labels = torch.from_numpy(cache.labels)
        self.source = torch.from_numpy(cache.source)
        self.bad_paths = dict(cache.bad)

    def __iter__(self) -> Iterator[tuple]:
        for chunk in chunks(self.indices(), self.batch_size):
            rows = self.source[torch.tensor(chunk, dtype=torch.long)]
            out = torch.empty((len(chunk), *self.images.shape[1:]), dtype=torch.uint8, pin_memory=self.pin)
            torch.index_select(self.images, 0, rows, out=out)  # threaded copy, without the GIL
            yield out, self.sizes[rows], self.labels[rows]

    def upload(self, batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, sizes, labels = batch
        return images.to(device, non_blocking=True), sizes, labels.to(device, non_blocking=True)


class DeviceCacheSource(SampledSource):
    """Batches gathered on the GPU from a dataset decoded into its memory (`gpucache.DeviceCache`): each pass
    uploads its order once, and a batch is then two `index_select`s on the loader's stream, its sizes a CPU
    index for the crops. A bad file's row already holds its substitute's pixels and label."""

    def __init__(self, cache: Any, sampler: Any, batch_size: int):
        super().__init__(len(cache), sampler, batch_size)
        self.cache = cache
        self.bad_paths = dict(cache.bad)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.tensor(self.indices(), dtype=torch.long)
        on_device = order.to(self.cache.images.device)  # in the loader's thread and stream, once a pass
        for k in range(0, len(order), self.batch_size):
            yield order[k:k + self.batch_size], on_device[k:k + self.batch_size]

    def upload(self, batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, rows_on_device = batch
        cache = self.cache
        return (cache.images.index_select(0, rows_on_device), cache.sizes[rows],
                cache.labels.index_select(0, rows_on_device))


class EpochStream:
    """Batches of indices for one epoch after another of a ResumableSampler, from (epoch, start) on.

    A DataLoader over it (as its batch_sampler) never reaches the end of an epoch, so its workers go
    on decoding the next epoch's first batches while the current one finishes and validation runs.
    Over a DataLoader per epoch they sat idle there and the next epoch started from empty queues, the
    first batch a whole batch of one worker's decoding (docs/input-pipeline.md has what that cost).
    The order of each epoch is the sampler's own. `last_epoch`: the run's last (0-based); the stream
    ends after it, so the workers do not decode an epoch nobody trains on during the final validation
    (None: no end).
    """

    def __init__(self, sampler: Any, batch_size: int, last_epoch: int | None = None):
        self.sampler = copy.copy(sampler)  # its own epoch and start: the trainer's sampler is not touched
        self.batch_size, self.last_epoch = batch_size, last_epoch
        self.epoch, self.start = 0, 0

    def begin(self, epoch: int, start: int) -> None:
        """Where the next iter() starts."""
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.start
        # asked for an epoch past the last (a caller other than the trainer): no end then
        last = self.last_epoch if self.last_epoch is not None and epoch <= self.last_epoch else None
        while last is None or epoch <= last:
            self.sampler.set_epoch(epoch, start)
            indices = list(self.sampler)
            if not indices and start == 0:  # an empty epoch: no later one has any either
                return
            yield from chunks(indices, self.batch_size)
            epoch, start = epoch + 1, 0


class WorkerSource:
    """Host batches of stored-form images decoded by DataLoader workers from `dataset`.

    With a ResumableSampler and workers, the workers follow an EpochStream (to `last_epoch`, the
    run's last): each pass takes the sampler's current epoch and start, and when that is where the
    previous pass left the stream (the next epoch, from its start), it carries on with batches the
    workers already prepared; anywhere else (a resume, a pass cut short) the stream starts again there.
    """

    def __init__(self, dataset: Any, sampler: Any, batch_size: int, workers: int, pin: bool,
                 last_epoch: int | None = None):

        self.sampler, self.batch_size = sampler, batch_size
        streams = workers > 0 and hasattr(sampler, "set_epoch") and hasattr(sampler, "per_rank")
        self.stream = EpochStream(sampler, batch_size, last_epoch) if streams else None
        if self.stream is not None:
            self.loader = make_loader(dataset, batch_size, workers, pin, True, batch_sampler=self.stream)
        else:
            self.loader = make_loader(dataset, batch_size, workers, pin, True, shuffle=False, sampler=sampler)
        self._batches: Iterator | None = None  # the stream's batches, shared by consecutive passes
        self._next: tuple[int, int] | None = None  # (epoch, start) the stream yields next

    @property
    def bad_paths(self) -> dict[str, str]:
        return self.loader.bad_paths

    def __len__(self) -> int:
        if self.stream is None:
            return len(self.loader)
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[tuple]:
        # iter() of the loader here, in the caller's thread: worker processes are forked from there,
        # not from the producer thread (forking a thread other than the main one can copy a held lock)
        if self.stream is None:
            return ((images, sizes, labels) for (images, sizes), labels in iter(self.loader))
        at = (int(self.sampler.epoch), int(self.sampler.start))
        if self._batches is None or self._next != at:
            self.stream.begin(*at)
            self._batches = iter(self.loader)
        self._next = None  # unknown until this pass has taken all its batches
        return self._pass(len(self), at[0])

    def _pass(self, n: int, epoch: int) -> Iterator[tuple]:
        for _ in range(n):
            (images, sizes), labels = next(self._batches)
            yield images, sizes, labels
        self._next = (epoch + 1, 0)

    def upload(self, batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, sizes, labels = batch
        return images.to(device, non_blocking=True), sizes, labels.to(device, non_blocking=True)

    def close(self) -> None:
        """Shut the workers down now (the end of a run; see loaders.SafeLoader)."""
        self.loader.close()
        self._batches = None


# ---------------------------------------------------------------------------------------------------
# Decoded on the GPU.


def _read(path: str) -> tuple[torch.Tensor, int]:
    """A file's bytes as a uint8 tensor, and its EXIF orientation (1 for not-JPEGs). A FIFO or device
    is refused without blocking (`safeio`), as a UserError the batch reports as a bad image."""
    with open_regular(path, "image", IMAGE_FILE) as f:
        raw = bytearray(f.read())
    if not raw:  # torch.frombuffer refuses an empty buffer; the decoders then name the empty file
        return torch.empty(0, dtype=torch.uint8), 1
    return torch.frombuffer(raw, dtype=torch.uint8), exif_orientation(raw) if is_jpeg(path) else 1


class _GpuSource(SampledSource):
    """What the GPU decoders share: the samples, and the bad-image rule applied to a decoded batch."""

    #: the decoded images' layout: False (3, H, W) as torchvision decodes, True (H, W, 3) as nvImageCodec
    channels_last = False

    def __init__(self, samples: Sequence[tuple[str, int]], sampler: Any, batch_size: int, size: int,
                 bad_images: str):
        super().__init__(len(samples), sampler, batch_size)
        self.samples, self.size, self.bad_images = list(samples), size, bad_images
        self.bad_paths: dict[str, str] = {}
        self._known_bad = KnownBad()

    def _pillow(self, index: int, device: torch.device) -> torch.Tensor:
        arr = torch.from_numpy(np.array(load_rgb(self.samples[index][0])))  # np.array: writable, for torch
        return (arr if self.channels_last else arr.permute(2, 0, 1)).to(device)

    def _finish(self, chunk: list[int], images: list[torch.Tensor | None], decode_one: Callable[[int], torch.Tensor],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's gaps (None) decoded one by one with `decode_one(k)`; a file that fails there too is
        replaced, image and label, as `badimages.first_readable` says (a substitute in the batch is taken as
        decoded, one outside it is decoded by Pillow). Returns (squashed images, sizes, labels on `device`)."""
        failed = []
        for k, img in enumerate(images):
            if img is None and chunk[k] not in self._known_bad:
                try:
                    images[k] = decode_one(k)
                except Exception as e:  # the file is what's wrong
                    self._known_bad[chunk[k]] = bad_image_reason(e)
            if images[k] is None:
                failed.append(k)
        at = {i: k for k, i in enumerate(chunk) if images[k] is not None}
        labels = [self.samples[i][1] for i in chunk]

        def load(j: int) -> torch.Tensor:
            return images[at[j]] if j in at else self._pillow(j, device)

        for k in failed:
            j, images[k], met = first_readable(chunk[k], self.samples, load, self._known_bad, self.bad_images)
            labels[k] = self.samples[j][1]
            for i in met:
                note_skipped(self.bad_paths, self.samples[i][0], self._known_bad[i])
        h, w = (0, 1) if self.channels_last else (1, 2)
        sizes = torch.tensor([[img.shape[w], img.shape[h]] for img in images], dtype=torch.int32)
        out = squash(images, self.size, channels_last=self.channels_last)
        return out, sizes, torch.tensor(labels, dtype=torch.long).to(device, non_blocking=True)


class NvjpegSource(_GpuSource):
    """Host batches of file bytes (read by threads, one batch ahead); decoded on the GPU in `upload`.

    A file nvJPEG cannot decode (or that is not a JPEG) is decoded by Pillow instead; one Pillow
    cannot decode either follows the bad-image rule. nvJPEG ignores EXIF orientation: the orientation
    read with the bytes turns its output upright on the GPU, as Pillow's decode on the other paths is.
    """

    def __iter__(self) -> Iterator[tuple]:
        with ThreadPoolExecutor(NVJPEG_READERS) as pool:
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
            pass  # one bad file fails the whole batch call: the gaps are decoded one by one
        return self._finish(chunk, images, lambda k: self._one(paths[k], data[k], turns[k], device), device)

    def _decode_batch(self, data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """(3, H, W) uint8 images on `device` (None where one could not be decoded); RuntimeError where the
        whole call failed."""

        if compat.cuda_jpeg_batch_decode():
            return compat.decode_jpeg(data, device=device)
        return [compat.decode_jpeg(d, device=device) for d in data]

    @staticmethod
    def turns_needed(device: Any) -> bool:
        """Whether decode_jpeg's output still needs EXIF orientation applied: always on CUDA (nvJPEG
        ignores it), on the CPU where this torchvision cannot apply it (before 0.17)."""

        return torch.device(device).type == "cuda" or not compat.decode_jpeg_applies_exif()

    @staticmethod
    def _one(path: str, data: Any, orientation: int, device: torch.device) -> torch.Tensor:

        if isinstance(data, torch.Tensor) and is_jpeg(path):
            with contextlib.suppress(RuntimeError):
                img = compat.decode_jpeg(data, device=device)
                return upright(img, orientation) if NvjpegSource.turns_needed(device) else img
        if isinstance(data, BaseException):
            raise data
        arr = np.asarray(load_rgb(path))
        return torch.from_numpy(arr).permute(2, 0, 1).to(device)


class NvimgcodecSource(_GpuSource):
    """Batches decoded by nvImageCodec (dlenv.data.hwdecode) with the plan's `backends` (on the GPU's
    hardware JPEG engines where it has them, which leaves CPU cores and SMs alone). The library reads the
    files itself (they were listed as regular files) and applies EXIF orientation.

    Why so few Python calls per batch: the thread that prepares batches shares the GIL with the training
    loop, and each call that releases it (a torch op, a file read) waits for the loop to let it go
    again. Reading a batch's files in Python threads and turning each image into a view cost about a
    thousand such waits a batch, and the engines then fed the model a fraction of what they decode alone
    (docs/input-pipeline.md, "Few cores per GPU"). Here a batch is one read call, one stack per image size
    and the resize.

    A file the library cannot decode (or that is not a JPEG) is decoded by Pillow, and one Pillow cannot
    decode either follows the bad-image rule, as on the other paths. The decoder is made here, in the
    process's main thread, so its start-up output stays off the console.
    """

    channels_last = True

    def __init__(self, samples: Sequence[tuple[str, int]], sampler: Any, batch_size: int, size: int,
                 bad_images: str, device: Any, backends: Sequence[str] = ()):

        super().__init__(samples, sampler, batch_size, size, bad_images)
        self.decoder = hwdecode.HwJpegDecoder(device, threads=NVIMGCODEC_THREADS, backends=backends)

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
            pass  # the whole call failed: the gaps are decoded one by one
        return self._finish(chunk, images, lambda k: self._pillow(chunk[k], device), device)


def squash(images: list[torch.Tensor], size: int, channels_last: bool = False) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------------
# The table: InputPlan.source -> the source of one split.


def _cache(samples: Sequence[tuple[str, int]], sampler: Any, plan: Any, device: torch.device,
           say: Callable[[str], None]) -> Source:

    if plan.cache_mode == "gpu":  # filled by the GPU decoder's own source where the plan names one
        on_gpu = build_device_cache(samples, stored_size(plan.img_size), plan, device, usable_cpus(), say,
                                    GPU_SOURCES.get(plan.decoder))
        return DeviceCacheSource(on_gpu, sampler, plan.batch_size)
    # decoding threads of this process: every core helps, /dev/shm plays no part
    decoded = build_cache(samples, stored_size(plan.img_size), plan.cpu_decoder, plan.cache_mode, plan.cache_dir,
                          usable_cpus(), plan.bad_images, say)
    return CacheSource(decoded, sampler, plan.batch_size, device.type == "cuda")


def _workers(samples: Sequence[tuple[str, int]], sampler: Any, plan: Any, device: torch.device,
             say: Callable[[str], None]) -> Source:

    load = partial(decode_stored, size=stored_size(plan.img_size), decoder=plan.cpu_decoder)
    ds = ImageDataset(samples, stored_tensors, plan.bad_images, load=load)
    return WorkerSource(ds, sampler, plan.batch_size, plan.workers, device.type == "cuda",
                        last_epoch=plan.epochs - 1 if plan.epochs else None)


def _nvjpeg(samples: Sequence[tuple[str, int]], sampler: Any, plan: Any, device: torch.device,
            say: Callable[[str], None]) -> Source:

    return NvjpegSource(samples, sampler, plan.batch_size, stored_size(plan.img_size), plan.bad_images)


def _nvimgcodec(samples: Sequence[tuple[str, int]], sampler: Any, plan: Any, device: torch.device,
                say: Callable[[str], None]) -> Source:

    return NvimgcodecSource(samples, sampler, plan.batch_size, stored_size(plan.img_size), plan.bad_images, device,
                            plan.gpu_backends)


#: the GPU decoders' sources, which also fill a cache in GPU memory (`gpucache`)
GPU_SOURCES: dict[str, Callable[..., Source]] = {"nvjpeg": _nvjpeg, "nvimgcodec": _nvimgcodec}
#: InputPlan.source -> (samples, sampler, plan, device, say) -> the Source of one split (`say`: where the
#: cache says what it decodes)
SOURCES: dict[str, Callable[..., Source]] = {"cache": _cache, "workers": _workers, "nvjpeg": _nvjpeg,
                                              "nvimgcodec": _nvimgcodec}
