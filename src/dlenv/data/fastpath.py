"""The device input path: uint8 batches to the GPU, cropped, flipped and normalized there.

The CPU path (`loaders.build_loaders`) decodes, crops, resizes, converts to float and normalizes
every image in DataLoader workers, and ships float32 batches through shared memory. Here the CPU
only produces the stored form of `decode` (uint8, 4x smaller), from one of four sources:

- `workers`: DataLoader worker processes decode JPEGs (Pillow, OpenCV or torchvision.io);
- `cache`: rows copied out of a dataset decoded once (`cache`), no decoding at all;
- `nvjpeg`: worker threads only read file bytes; torchvision.io.decode_jpeg decodes the batch on the GPU;
- `nvimgcodec`: the same, decoded by nvImageCodec on the GPU's hardware JPEG engines (`hwdecode`).

The last two, which decode on the GPU, live in `gpudecode`.

A background thread takes each host batch, copies it to the GPU on a side CUDA stream and augments
it there (`gpu_aug`), keeping a few batches ready; the training loop receives (images, targets)
already on the device, in its memory format and AMP dtype, and only waits when that thread falls
behind. Crops depend on (seed, epoch, position in the epoch) only, so runs and resumes repeat.
On a CPU device the same code runs on CPU tensors. `dlenv.data.pipeline` decides which source and
builds the loaders.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dlenv.data.cache import DecodedCache
from dlenv.data.gpu_aug import GpuAugment

#: augmented batches kept ready on the device
DEPTH = 3


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
    """Host batches gathered from a DecodedCache into pinned memory (on CUDA)."""

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
            idx = torch.tensor(chunk, dtype=torch.long)
            rows = self.source[idx]
            out = torch.empty((len(chunk), *self.images.shape[1:]), dtype=torch.uint8, pin_memory=self.pin)
            torch.index_select(self.images, 0, rows, out=out)  # threaded copy, without the GIL
            yield out, self.sizes[rows], self.labels[idx]

    def upload(self, batch: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, sizes, labels = batch
        return images.to(device, non_blocking=True), sizes, labels.to(device, non_blocking=True)


class EpochStream:
    """Batches of indices for one epoch after another of a ResumableSampler, from (epoch, start) on.

    A DataLoader over it (as its batch_sampler) never reaches the end of an epoch, so its workers go
    on decoding the next epoch's first batches while the current one finishes and validation runs.
    Over a DataLoader per epoch they sat idle there and the next epoch started from empty queues: the
    first batch took one worker's whole batch of decoding (about 0.5 s at 256 JPEGs), a tenth of
    an H200's ResNet-50 epoch over 20,000 images. The order of each epoch is the sampler's own.
    `last_epoch`: the run's last (0-based); the stream ends after it, so the workers do not decode an
    epoch nobody trains on during the final validation (None: no end).
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
        from dlenv.data.loaders import make_loader

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
# The device-side loader.


class _End:
    pass


_SIDE_STREAMS: dict[torch.device, Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """The one CUDA stream that uploads and augments batches on `device`, for every loader and epoch.

    The caching allocator keeps the blocks freed on a stream for that stream only. A new stream per
    pass (train and val, every epoch) stranded each pass's blocks in a pool no later pass could use,
    and PyTorch hands out streams from a ring of 32, so reserved memory grew until the ring came
    round (about 16 epochs of train + val): 0.9 -> 6.9 GiB on a small-image dataset. One stream per
    device keeps the pool and reuses it.
    """
    if device.index is None:  # "cuda" and "cuda:0" are one stream
        device = torch.device("cuda", torch.cuda.current_device())
    with _SIDE_STREAMS_LOCK:
        if device not in _SIDE_STREAMS:
            # high priority: its few small kernels a batch would otherwise queue behind the model's for SMs
            _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
        return _SIDE_STREAMS[device]


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class DeviceLoader:
    """An iterable of (images, targets) already on `device`, augmented; `len()` batches per epoch.

    `sampler`: read at the start of each pass for its `epoch` and `start` (a ResumableSampler), which
    with `seed` and the batch's position fix the random crops. `bad_paths` lists skipped files.
    """

    def __init__(self, source: Any, augment: GpuAugment, device: torch.device, batch_size: int,
                 sampler: Any = None, seed: int = 0, depth: int = DEPTH):
        self.source, self.augment, self.device = source, augment, torch.device(device)
        self.batch_size, self.sampler, self.seed, self.depth = batch_size, sampler, seed, depth

    @property
    def bad_paths(self) -> dict[str, str]:
        return self.source.bad_paths

    def __len__(self) -> int:
        return len(self.source)

    def close(self) -> None:
        """Shut down the source's worker processes, where it has any (the end of a run)."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def batch_seed(self, epoch: int, position: int) -> int:
        """The augmentation seed of the batch that starts at `position` of `epoch`."""
        return ((self.seed * 1_000_003 + epoch) * 1_000_000_007 + position) % 2**63

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = int(getattr(self.sampler, "epoch", 0))
        start = int(getattr(self.sampler, "start", 0))
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        batches = iter(self.source)
        worker = threading.Thread(target=self._produce, args=(batches, q, stop, epoch, start), daemon=True,
                                  name="dlenv-device-loader")
        worker.start()
        cuda = self.device.type == "cuda"
        try:
            while True:
                item = q.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failed):
                    raise item.exc
                images, targets, ready = item
                if cuda:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(ready)  # the GPU waits for the side stream; the CPU does not
                    images.record_stream(current)
                    targets.record_stream(current)
                yield images, targets
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting to put, then let it finish
                with contextlib.suppress(queue.Empty):
                    q.get_nowait()
                worker.join(0.05)

    def _produce(self, batches: Iterator, q: queue.Queue, stop: threading.Event, epoch: int, start: int) -> None:
        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        cuda = self.device.type == "cuda"
        stream = side_stream(self.device) if cuda else None
        position = start
        on_device = torch.cuda.device(self.device) if cuda else contextlib.nullcontext()
        try:
            with on_device, torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), torch.no_grad():
                for batch in batches:
                    images, sizes, labels = self.source.upload(batch, self.device)
                    out = self.augment(images, sizes, self.batch_seed(epoch, position))
                    position += out.shape[0]
                    ready = None
                    if cuda:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                    if not put((out, labels, ready)):
                        return
            put(_End())
        except BaseException as e:  # handed to the training loop's thread, raised there
            put(_Failed(e))
