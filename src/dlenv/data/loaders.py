"""Images to batches on the CPU path: torchvision transforms in DataLoader workers, the dataset and its
DataLoaders, with as many workers as dlenv.data.workers decided. The device path (`fastpath`, `sources`)
uses the dataset and the loaders too.

Every image comes out as 3-channel 8-bit RGB whatever it was on disk (`decode.load_rgb`). A file that fails
to decode is handled by `ImageDataset` and the loaders built here without ever showing a DataLoader
worker traceback: the worker hands a small marker back with the batch, and the main process either
logs the path once and carries on with the substitute `badimages.first_readable` names
(`bad_images="skip"`) or raises `BadImageError`, one line naming the file (`bad_images="error"`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dlenv.data.badimages import SKIPPED_SHOWN, BadImageError, KnownBad, first_readable, note_skipped, skipped_line
from dlenv.data.decode import decode_rgb, load_rgb
from dlenv.data.sampler import ResumableSampler, SeededDraws, lone_last
from dlenv.data.workers import PREFETCH_FACTOR, decide_workers
from dlenv.errors import UserError, shm_full
from dlenv.model.pretrained import IMAGENET_MEAN, IMAGENET_STD

log = logging.getLogger("dlenv.data")


# ---------------------------------------------------------------------------------------------------
# Transforms.


def build_transforms(img_size: int, train: bool, scale: tuple[float, float] = (0.08, 1.0),
                     ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: bool = True,
                     norm: tuple[tuple, tuple] | None = None, interpolation: str = "bilinear",
                     crop: bool = True) -> Callable:
    """torchvision transforms: train = RandomResizedCrop(img_size, scale, ratio) + horizontal flip (if
    `hflip`); eval = Resize(img_size * 256/224) + CenterCrop(img_size), or without `crop` the whole image
    resized to img_size x img_size (a script's `Resize((N, N))`, val/predict --resize full); both resize with
    `interpolation` ('bilinear', 'bicubic' or 'nearest': pretrained weights' own) and end in ToTensor +
    Normalize by `norm` (mean, std): pretrained weights' own, else ImageNet's."""
    from torchvision import transforms as T

    mean, std = norm or (IMAGENET_MEAN, IMAGENET_STD)
    mode = T.InterpolationMode(interpolation)
    if train:
        head = [T.RandomResizedCrop(img_size, scale=scale, ratio=ratio, interpolation=mode)]
        head += [T.RandomHorizontalFlip()] if hflip else []
    elif not crop:
        head = [T.Resize((img_size, img_size), interpolation=mode)]
    else:
        head = [T.Resize(_eval_resize(img_size), interpolation=mode), T.CenterCrop(img_size)]
    return T.Compose([*head, T.ToTensor(), T.Normalize(mean, std)])


# ---------------------------------------------------------------------------------------------------
# The dataset, and how a bad file travels from a worker to the main process.


class _Item(tuple):
    """(image, label) that also carries the bad files skipped to produce it."""

    bad: list[tuple[str, str]]


class _Fatal:
    """Stands in for a sample (and then a batch) when a bad file must stop the run."""

    def __init__(self, *args: str):
        self.args = args  # BadImageError's arguments


class _Flagged:
    """A batch plus the bad files skipped while making it; unwrapped in the main process."""

    def __init__(self, batch: Any, bad: list[tuple[str, str]]):
        self.batch, self.bad = batch, bad

    def pin_memory(self) -> _Flagged:  # DataLoader's pin thread calls this on unknown objects
        pinned = [b.pin_memory() if isinstance(b, torch.Tensor) else b for b in self.batch]
        return _Flagged(type(self.batch)(pinned), self.bad)


class ImageDataset(Dataset):
    """(path, label) samples -> (transform(load(path)), label); `load` is `load_rgb` unless given.

    bad_images="skip": a file that fails to decode is logged once per process with its path and the
    sample `badimages.first_readable` names is returned instead. bad_images="error": BadImageError names
    the file. Inside loaders from this module, both are
    reported from the main process instead (once per path across all workers; no worker traceback).
    """

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable | None = None,
                 bad_images: str = "skip", load: Callable[[str], Any] = load_rgb):
        if bad_images not in ("skip", "error"):
            raise UserError(f"bad_images {bad_images!r} is not one of: skip, error")
        self.samples = list(samples)
        self.transform = transform
        self.load = load  # path -> decoded image; picklable (a module function or a partial of one)
        self.bad_images = bad_images
        #: set by this module's loaders: hand bad files to the main process instead of raising/logging
        self.report_in_main = False
        self._known_bad = KnownBad()
        self._logged: dict[str, str] = {}
        self._seed: int | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, index: int) -> Any:
        path, label = self.samples[index]
        img = self.load(path)
        if self.transform is None:
            return img, label
        if self._seed is None:
            return self.transform(img), label
        with _drawn_from(self._seed):
            return self.transform(img), label

    def __getitem__(self, index: int) -> Any:
        # a Draw (dlenv.data.sampler.SeededDraws) carries its augmentation's seed; a substitute for a bad
        # file is drawn from the same seed, so it too is the same in a resumed run
        self._seed = getattr(index, "seed", None)
        try:
            _, item, met = first_readable(index, self.samples, self._load, self._known_bad, self.bad_images)
        except BadImageError as e:
            return self._fail(e.path, e.reason, e.hint)
        if not met:
            return item
        return self._substituted(item, [(self.samples[i][0], self._known_bad[i]) for i in met])

    def _substituted(self, item: tuple, bad: list[tuple[str, str]]) -> Any:
        if not self.report_in_main:
            for path, reason in bad:
                note_skipped(self._logged, path, reason)
            return item
        out = _Item(item)
        out.bad = bad
        return out

    def _fail(self, *args: str) -> Any:
        if self.report_in_main:
            return _Fatal(*args)
        raise BadImageError(*args)


@contextlib.contextmanager
def _drawn_from(seed: int):
    """Draw the block's random numbers (torchvision's transforms draw from torch's CPU generator) from
    `seed`, and give the process's own stream back at its end: in the main process (--workers 0) the
    model's dropout draws from it too, and it must not depend on the augmentation."""
    state = torch.default_generator.get_state()
    torch.default_generator.manual_seed(seed)  # the CPU generator only: a GPU's stream is not touched
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


def _collate(items: list[Any]) -> Any:
    """default_collate, except that bad-file markers are lifted from the items onto the batch."""
    from torch.utils.data import default_collate

    fatal = next((it for it in items if isinstance(it, _Fatal)), None)
    if fatal is not None:
        return fatal
    bad = [b for it in items if isinstance(it, _Item) for b in it.bad]
    batch = default_collate([tuple(it) for it in items])
    return _Flagged(batch, bad) if bad else batch


class SafeLoader(DataLoader):
    """A DataLoader that turns bad-file markers into one log line per path (`bad_paths` keeps them,
    path -> reason) or a BadImageError raised in the main process.

    Its worker processes are shut down when a pass fails (and `close()` shuts persistent ones down at
    the end of a run), never left to the garbage collector: an iterator found in a reference cycle is
    finalised after its queues, so the workers never get the word to stop and torch waits 5 s for each
    before it kills it (two workers: 10 s at some later allocation, in the middle of something else).
    """

    def __init__(self, dataset: ImageDataset, **kwargs: Any):
        dataset.report_in_main = True
        # Each pass that starts workers draws their base seed from the loader's generator, or without one
        # from the process's own stream, which the model's dropout draws from too: a resumed run starts its
        # persistent val workers at another point than the uninterrupted run did, and every later random
        # number of the run would shift by that one draw. A generator of its own keeps the run's stream.
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(0)
        if kwargs.get("num_workers", 0) > 0:  # every SafeLoader's workers, copies made elsewhere too
            kwargs["worker_init_fn"] = partial(_worker_start, kwargs.get("worker_init_fn"))
        super().__init__(dataset, collate_fn=_collate, **kwargs)
        self.bad_paths: dict[str, str] = {}
        self._summed = 0

    def __iter__(self):
        # DataLoader's iterator (and its worker processes) made now, in the caller's thread; only the
        # checking below is deferred to the first batch. The stop signals wait while the workers are
        # forked: a worker takes them from its first instruction to its _worker_start, where it learns to
        # leave them to the main process (torch's own SIGTERM handler, set before that, would end it)
        with _stop_signals_held():
            batches = super().__iter__()
        return self._checked(batches)

    def _checked(self, batches: Any) -> Any:
        try:
            for batch in batches:
                if isinstance(batch, _Fatal):
                    raise BadImageError(*batch.args)
                if isinstance(batch, _Flagged):
                    for path, reason in batch.bad:
                        note_skipped(self.bad_paths, path, reason)
                    batch = batch.batch
                yield batch
            if len(self.bad_paths) > SKIPPED_SHOWN and len(self.bad_paths) != self._summed:
                self._summed = len(self.bad_paths)  # the pass's one line for all it skipped
                log.warning("%s", skipped_line(self.bad_paths))
        except GeneratorExit:  # a pass left early: its own workers stop; persistent ones serve the next pass
            if not self.persistent_workers:
                _shut_down(batches)
            raise
        except BaseException:  # a bad image, a worker's error, Ctrl-C: the workers stop now, not at a GC
            _shut_down(batches)
            if self._iterator is batches:
                self._iterator = None  # a later pass starts new workers
            raise

    def close(self) -> None:
        """Shut the persistent workers down now (the end of a run); a later pass starts new ones."""
        if self._iterator is not None:
            _shut_down(self._iterator)
            self._iterator = None


def _shut_down(batches: Any) -> None:
    """Stop the worker processes of a DataLoader iterator (there are none without workers)."""
    stop = getattr(batches, "_shutdown_workers", None)  # torch's own: tells each worker to exit, joins it
    if stop is not None:
        stop()


# ---------------------------------------------------------------------------------------------------
# Workers and loaders.

#: what stops a run (Ctrl-C, docker stop / systemd / scancel / timeout, the terminal closing): the main
#: process alone decides on these; its DataLoader workers leave them to it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stop_signals_held():
    """Hold the stop signals back in this thread (the one that forks the workers) for the block; any
    that arrived meanwhile are delivered at its end. The workers start with them held too."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _leave_stop_signals_to_the_main_process() -> None:
    """In a DataLoader worker: the stop signals sent to the whole process group (a terminal's Ctrl-C or
    hangup, `timeout`, `kill -- -PGID`) or to every process of a cgroup (systemd, Slurm) no longer end it.

    The main process finishes its optimizer step, saves last.pth and shuts its workers down itself;
    a worker that died of the same signal first would only make torch raise "DataLoader worker is killed
    by signal" in the middle of that save. SIGINT and SIGHUP are ignored. SIGTERM stays held, and a
    thread takes each one and ends the worker only when the parent sent it: that is how torch and
    multiprocessing stop a worker that does not exit when told to (torch's own handler, replaced here,
    makes the same distinction). A worker whose main process died anyway exits by torch's watchdog.
    """
    import threading

    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # this thread, and every thread it starts
    parent = os.getppid()

    def from_parent_only() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=from_parent_only, name="dlenv-sigterm", daemon=True).start()
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # one that is pending since the fork is dropped, too
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGHUP])


def _worker_start(then: Callable[[int], None] | None, worker_id: int) -> None:
    """In each DataLoader worker, before `then`: the stop signals are left to the main process
    (`_leave_stop_signals_to_the_main_process`), and a worker that runs out of /dev/shm dies quietly by
    SIGBUS, and the main process says so in one line (`errors.environment_fault`).

    Out of shared memory, a worker either touches a page of a tensor tmpfs cannot back (SIGBUS: torch's
    handler prints its own ERROR line first, hence the default action) or fails to pickle the batch
    into a new segment (ENOSPC), which multiprocessing's feeder thread prints as a traceback and then
    drops the batch: the main process would wait for it forever. Both now end the worker the same way;
    its core dump, of no use to anyone, is switched off.
    """
    import multiprocessing.queues
    import resource


    _leave_stop_signals_to_the_main_process()
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    signal.signal(signal.SIGBUS, signal.SIG_DFL)
    printed = multiprocessing.queues.Queue._on_queue_feeder_error

    def on_feeder_error(e: BaseException, obj: Any) -> None:
        if shm_full(e):
            os.kill(os.getpid(), signal.SIGBUS)
        printed(e, obj)

    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(on_feeder_error)
    if then is not None:
        then(worker_id)


def make_loader(dataset: ImageDataset, batch_size: int, workers: int, pin_memory: bool | None,
                persistent: bool, **kwargs: Any) -> SafeLoader:
    """A SafeLoader with dlenv's settings: pinned memory where CUDA is (pin_memory None), workers that
    prefetch PREFETCH_FACTOR batches each and, if `persistent`, live across epochs."""
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {"persistent_workers": persistent, "prefetch_factor": PREFETCH_FACTOR}
    if "batch_sampler" not in kwargs:  # a batch sampler makes the batches itself
        extra["batch_size"] = batch_size
    return SafeLoader(dataset, num_workers=workers, pin_memory=pin_memory, **extra, **kwargs)


def build_loaders(layout: Any, plan: Any, train_sampler: Any = None, pin_memory: bool | None = None,
                  drop_last: bool = False) -> tuple[SafeLoader, SafeLoader | None]:
    """(train_loader, val_loader) for a folder.Layout on the CPU path as `plan` (a dlenv.data.plan.InputPlan)
    says: its size, batch, workers (a number), crops, flips, CPU decoder, normalization and resampling
    (`build_transforms`); val_loader is None when the layout has no val.

    Train shuffles with a generator seeded by the plan's seed unless `train_sampler` is given (then the
    sampler decides the order, and a ResumableSampler's indices seed each sample's augmentation:
    sampler.SeededDraws); val keeps sample order. Memory is pinned when CUDA is available
    (pin_memory=None); workers persist across epochs. Each loader's `bad_paths` collects skipped files.
    """
    size, batch = plan.img_size, plan.batch_size
    gen = torch.Generator()
    gen.manual_seed(plan.seed)  # also seeds each worker's RNG: the augmentation of a loader with no sampler
    augment = build_transforms(size, True, plan.train_scale, plan.train_ratio, plan.hflip, plan.norm,
                               plan.interpolation)
    train_ds = ImageDataset(layout.train, augment, plan.bad_images, _decode_fn(plan.cpu_decoder, None))
    # no sampler: the loader leaves out a last batch of one (BatchNorm cannot train on it), as
    # ResumableSampler(batch_size=) does
    drop_last = drop_last or (train_sampler is None and lone_last(len(train_ds), batch))
    # a sampler's indices carry their augmentation's seed (sampler.SeededDraws), so each sample's crop and
    # flip depend on (seed, epoch, index) only, not on the worker or what it drew before: a resume, another
    # number of workers or ranks draws the same
    draws = SeededDraws(train_sampler) if isinstance(train_sampler, ResumableSampler) else train_sampler
    train = make_loader(train_ds, batch, plan.workers, pin_memory, True, shuffle=train_sampler is None,
                        sampler=draws, generator=gen, drop_last=drop_last)
    if not layout.val:
        return train, None
    val_ds = ImageDataset(layout.val, build_transforms(size, False, norm=plan.norm, interpolation=plan.interpolation),
                          plan.bad_images, _decode_fn(plan.cpu_decoder, _eval_resize(size)))
    return train, make_loader(val_ds, batch, plan.workers, pin_memory, True, shuffle=False)


def build_eval_loader(samples: Sequence[tuple[str, int]], img_size: int, batch_size: int,
                      workers: int | str, bad_images: str = "skip", norm: tuple[tuple, tuple] | None = None,
                      interpolation: str = "bilinear", crop: bool = True) -> SafeLoader:
    """A loader over eval transforms in sample order, for one pass (the i-th prediction is the i-th
    sample's), decoded by Pillow, with `workers` sized here (`decide_workers`: val, predict and prune give
    the option as is; a reduction is logged, as these verbs have no plan to say it). A skipped bad file's
    slot holds its substitute; `loader.bad_paths` lists those files after the pass, so their predictions
    can be dropped. `crop` as build_transforms'."""
    n, why = decide_workers(workers, batch_size, img_size)
    if why:
        log.warning("%s", why)
    transform = build_transforms(img_size, False, norm=norm, interpolation=interpolation, crop=crop)
    ds = ImageDataset(samples, transform, bad_images, _decode_fn("pil", _eval_resize(img_size) if crop else img_size))
    return make_loader(ds, batch_size, n, None, False, shuffle=False)


def _eval_resize(img_size: int) -> int:
    """The shorter side eval resizes to before its centre crop (build_transforms)."""
    return int(img_size * 256 / 224)


def _decode_fn(decoder: str, min_side: int | None) -> Callable[[str], Any]:
    """A picklable path -> RGB image function for ImageDataset. `min_side`: the image is only ever
    downscaled to at least this shorter side, so JPEGs may be decoded at reduced scale."""
    if decoder == "pil" and min_side is None:
        return load_rgb
    return partial(decode_rgb, decoder=decoder, min_side=min_side)
