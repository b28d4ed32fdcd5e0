"""The device input path: uint8 batches to the GPU, cropped, flipped and normalized there.

The CPU path (`loaders.build_loaders`) decodes, crops, resizes, converts to float and normalizes
every image in DataLoader workers, and ships float32 batches through shared memory. Here the host only
produces the stored form of `decode` (uint8, 4x smaller), or the GPU decodes it, in one of the `sources`
(DataLoader workers, the decoded-once cache, nvJPEG, nvImageCodec), picked by the input plan.

A background thread takes each host batch, copies it to the GPU on a side CUDA stream and augments
it there (`gpu_aug`), keeping a few batches ready; the training loop receives (images, targets)
already on the device, in its memory format and AMP dtype, and only waits when that thread falls
behind. Crops depend on (seed, epoch, position in the epoch) only, so runs and resumes repeat.

Overlapped (`InputPlan.overlap`, where a GPU decoder decodes): a second thread decodes batch n+1 on a
stream of its own (`decode_stream`) while the first augments batch n, DECODE_AHEAD decoded batches
between them; the augmenting stream waits for each on an event, the host never does. One thread doing
both in series cost more than a step on 4 cores (docs/input-pipeline.md, "Overlap on few cores"); the
decoders wait for the GPU and their library threads without the GIL, so the augmentation runs meanwhile.
The batches, their order and the bad-image rule are the serial path's: only the threads differ.
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
#: decoded batches kept ready for the augmentation when the two overlap (`InputPlan.overlap`)
DECODE_AHEAD = 2


class _End:
    pass


_SIDE_STREAMS: dict[tuple[torch.device, str], Any] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device, role: str = "augment") -> Any:
    """The one CUDA stream of `role` on `device`, for every loader and epoch: 'augment' uploads and augments
    batches, 'decode' decodes them a batch ahead where the two overlap.

    The caching allocator keeps the blocks freed on a stream for that stream only. A new stream per
    pass (train and val, every epoch) stranded each pass's blocks in a pool no later pass could use,
    and PyTorch hands out streams from a ring of 32, so reserved memory grew until the ring came
    round (about 16 epochs of train + val; docs/benchmarks.md, "GPU memory over a long run"). One stream
    per device and role keeps each pool and reuses it.
    """
    device = torch.device(device)
    if device.index is None:  # "cuda" and "cuda:0" are one stream
        device = torch.device("cuda", torch.cuda.current_device())
    with _SIDE_STREAMS_LOCK:
        if (device, role) not in _SIDE_STREAMS:
            # augment: high priority, its few small kernels a batch would otherwise queue behind the model's
            # for SMs; decode: normal, it works a batch ahead and need not pre-empt the model
            _SIDE_STREAMS[device, role] = torch.cuda.Stream(device, priority=-1 if role == "augment" else 0)
        return _SIDE_STREAMS[device, role]


def decode_stream(device: torch.device) -> Any:
    """The one CUDA stream that decodes batches on `device` while the augment stream works on the last."""
    return side_stream(device, "decode")


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put `item` unless the consumer has gone (`stop`); False then."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _drain(q: queue.Queue, thread: threading.Thread) -> None:
    """Unblock `thread` waiting to put into `q`, and let it finish."""
    while thread.is_alive():
        with contextlib.suppress(queue.Empty):
            q.get_nowait()
        thread.join(0.05)


class DeviceLoader:
    """An iterable of (images, targets) already on `device`, augmented; `len()` batches per epoch.

    `sampler`: read at the start of each pass for its `epoch` and `start` (a ResumableSampler), which
    with `seed` and the batch's position fix the random crops. `bad_paths` lists skipped files.
    `overlap`: the source's upload (a GPU decoder's decode) runs in a thread of its own, DECODE_AHEAD
    batches ahead of the augmentation (see the module docstring); the batches are the same.
    """

    def __init__(self, source: Source, augment: GpuAugment, device: torch.device, batch_size: int,
                 sampler: Any = None, seed: int = 0, overlap: bool = False):
        self.source, self.augment, self.device = source, augment, torch.device(device)
        self.batch_size, self.sampler, self.seed, self.overlap = batch_size, sampler, seed, overlap

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
        q: queue.Queue = queue.Queue(maxsize=DEPTH)
        stop = threading.Event()
        batches = iter(self.source)  # here: a WorkerSource forks its workers from this thread
        threads: list[tuple[threading.Thread, queue.Queue]] = []
        if self.overlap:
            decoded: queue.Queue = queue.Queue(maxsize=DECODE_AHEAD)
            threads.append((threading.Thread(target=self._decode, args=(batches, decoded, stop), daemon=True,
                                             name="dlenv-device-decoder"), decoded))
            uploads = self._decoded(decoded, stop)
        else:
            uploads = self._uploads(batches)
        threads.append((threading.Thread(target=self._produce, args=(uploads, q, stop, epoch, start), daemon=True,
                                         name="dlenv-device-loader"), q))
        for thread, _ in threads:
            thread.start()
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
            for thread, into in reversed(threads):  # the augmenting thread first: it may wait on the decoder
                _drain(into, thread)
            # the source's pass, left where the threads stopped: its own threads (nvJPEG's file readers) end
            # now, not when a traceback that holds this frame lets it go
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _uploads(self, batches: Iterator) -> Iterator[tuple[tuple, Any]]:
        """Serial: each host batch uploaded (decoded) in the augmenting thread; no event to wait for."""
        for batch in batches:
            yield self.source.upload(batch, self.device), None

    def _decode(self, batches: Iterator, decoded: queue.Queue, stop: threading.Event) -> None:
        """Overlapped: upload (decode) each host batch on the decode stream, with the event that marks it done."""
        cuda = self.device.type == "cuda"
        stream = decode_stream(self.device) if cuda else None
        on_device = torch.cuda.device(self.device) if cuda else contextlib.nullcontext()
        try:
            with on_device, torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), torch.no_grad():
                for batch in batches:
                    uploaded = self.source.upload(batch, self.device)
                    done = None
                    if cuda:
                        done = torch.cuda.Event()
                        done.record(stream)
                    if not _put(decoded, (uploaded, done), stop):
                        return
            _put(decoded, _End(), stop)
        except BaseException as e:  # handed to the augmenting thread, and on to the training loop's
            _put(decoded, _Failed(e), stop)

    @staticmethod
    def _decoded(decoded: queue.Queue, stop: threading.Event) -> Iterator[tuple[tuple, Any]]:
        """The decoding thread's batches, in its order; its failure raised here."""
        while not stop.is_set():
            try:
                item = decoded.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, _End):
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item

    def _produce(self, uploads: Iterator, q: queue.Queue, stop: threading.Event, epoch: int, start: int) -> None:
        cuda = self.device.type == "cuda"
        stream = side_stream(self.device) if cuda else None
        position = start
        on_device = torch.cuda.device(self.device) if cuda else contextlib.nullcontext()
        try:
            with on_device, torch.cuda.stream(stream) if cuda else contextlib.nullcontext(), torch.no_grad():
                for (images, sizes, labels), done in uploads:
                    if done is not None:  # decoded on the decode stream: this stream waits, the host does not
                        stream.wait_event(done)
                        images.record_stream(stream)  # its block is not reused before the crops have read it
                    out = self.augment(images, sizes, self.batch_seed(epoch, position))
                    position += out.shape[0]
                    ready = None
                    if cuda:
                        ready = torch.cuda.Event()
                        ready.record(stream)
                    if not _put(q, (out, labels, ready), stop):
                        return
            _put(q, _End(), stop)
        except BaseException as e:  # handed to the training loop's thread, raised there
            _put(q, _Failed(e), stop)
