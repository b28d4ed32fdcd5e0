"""The device input path: uint8 batches to the GPU, cropped, flipped and normalized there.

The CPU path (`loaders.build_loaders`) decodes, crops, resizes, converts to float and normalizes
every image in DataLoader workers, and ships float32 batches through shared memory. Here the host only
produces the stored form of `decode` (uint8, 4x smaller), or the GPU decodes it, in one of the `sources`
(DataLoader workers, the decoded-once cache, nvJPEG, nvImageCodec), picked by the input plan.

A background thread takes each host batch, copies it to the GPU on a side CUDA stream and augments
it there (`gpu_aug`), keeping a few batches ready; the training loop receives (images, targets)
already on the device, in its memory format and AMP dtype, and only waits when that thread falls
behind. Crops depend on (seed, epoch, position in the epoch) only, so runs and resumes repeat.
On a CPU device the same code runs on CPU tensors. `dlenv.data.pipeline` builds the loaders the
input plan (`dlenv.data.plan`) describes.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dlenv.data.gpu_aug import GpuAugment
from dlenv.data.sources import Source

#: augmented batches kept ready on the device
DEPTH = 3


class _End:
    pass


_SIDE_STREAMS: dict[torch.device, Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device) -> Any:
    """The one CUDA stream that uploads and augments batches on `device`, for every loader and epoch.

    The caching allocator keeps the blocks freed on a stream for that stream only. A new stream per
    pass (train and val, every epoch) stranded each pass's blocks in a pool no later pass could use,
    and PyTorch hands out streams from a ring of 32, so reserved memory grew until the ring came
    round (about 16 epochs of train + val; docs/benchmarks.md, "GPU memory over a long run"). One stream
    per device keeps the pool and reuses it.
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

    def __init__(self, source: Source, augment: GpuAugment, device: torch.device, batch_size: int,
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
