"""The pieces of scripts/profile_feed.py: the trainer's profiling hook, the mirror loop and its feeds, the report.

- `Annotations` wraps the trainer's loop phases and the feed's steps in record_function ranges while
  a profiled window runs, and stamps each batch with the time it left the workers or the cache;
- `StepHook` is `train(cfg, on_step=...)`: it starts and steps torch.profiler over one window and
  times the steps of another;
- `mirror` trains the trainer's step on batches from each feed (`FEEDS`) and modes of compilation;
- `AheadFeed` is the candidate feed: copy and augmentation of batch k+1 issued by the training thread
  on a side stream before step k, with no per-step synchronisation;
- `timeline` and `report` write the numbers as text.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import feed_trace
import torch

FEEDS = ("synthetic", "synthetic-augment", "product-cache", "product-cache-ondevice", "ahead-cache",
         "ahead-cache-inline", "product-workers", "ahead-workers", "product-workers-w10", "ahead-workers-w10")
CHECK_EVERY = 10  # the trainer reads the loss (and waits for the GPU) every 10 micro-batches


def _range(on: bool, label: str) -> Any:
    return torch.profiler.record_function(label) if on else contextlib.nullcontext()


def thread_names() -> dict[int, str]:
    """Native thread id -> Python thread name, for the threads alive now."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


class Annotations:
    """While installed (a context manager), the trainer's phases and the feed's steps are record_function
    ranges whenever `on` is set, and with `collect` set each batch's wait is timed from the moment its
    host batch left the workers or the cache (`latency_ms`). Functions that are not found (renamed by
    a refactor) are listed in `missing` and left alone."""

    def __init__(self):
        self.on = False
        self.collect = False
        self.missing: list[str] = []
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self._local = threading.local()
        self._latency: list[tuple[float, float]] = []
        # id(batch images) -> (host batch left the workers/cache, augmentation issued): a dict, not an
        # attribute on the tensor, so that nothing the compiled model sees changes
        self._stamps: dict[int, tuple[float, float]] = {}

    def __enter__(self) -> Annotations:
        from dlenv.data import gpu_aug, sources
        from dlenv.engine import precision
        from dlenv.train import loop

        timed = self._timed
        self._patch(loop, "forward_backward", timed("phase:forward+backward"))
        self._patch(loop, "optimizer_step", timed("phase:optimizer"))
        tally = getattr(loop, "_Tally", None)
        if tally is None:
            self.missing.append("dlenv.train.loop._Tally")
        else:
            self._patch(tally, "wait_for", self._wait_for)
            self._patch(tally, "check", timed("phase:check (reads the loss: waits for the GPU)"))
            self._patch(tally, "add", timed("phase:tally"))
        self._patch(precision.Precision, "backward", timed("phase:backward"))
        for cls in (sources.CacheSource, sources.WorkerSource, sources.NvimgcodecSource, sources.NvjpegSource):
            self._patch(cls, "upload", self._upload)
            self._patch(cls, "__iter__", self._host_iter)
        self._patch(gpu_aug.GpuAugment, "__call__", self._augment)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.on = self.collect = False
        for owner, attr, orig, own in reversed(self._undo):
            if own:
                setattr(owner, attr, orig)
            else:
                delattr(owner, attr)
        self._undo.clear()

    def latency_ms(self) -> dict[str, float] | None:
        """Medians over the collected batches: host batch -> the step takes it, and ready on the device
        (augmentation issued) -> taken."""
        if not self._latency:
            return None
        host = sorted(x for x, _ in self._latency)
        ready = sorted(y for _, y in self._latency)
        return {"batches": len(host), "host_to_step_median": round(1e3 * host[len(host) // 2], 2),
                "ready_to_step_median": round(1e3 * ready[len(ready) // 2], 2)}

    def _patch(self, owner: Any, attr: str, make: Any) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:
            self.missing.append(f"{getattr(owner, '__qualname__', owner)}.{attr}")
            return
        own = attr in vars(owner)
        setattr(owner, attr, make(orig))
        self._undo.append((owner, attr, orig, own))

    def _timed(self, label: str) -> Any:
        def make(orig: Any) -> Any:
            @functools.wraps(orig)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not self.on:
                    return orig(*args, **kwargs)
                with torch.profiler.record_function(label):
                    return orig(*args, **kwargs)
            return wrapper
        return make

    def _wait_for(self, orig: Any) -> Any:
        def wait_for(tally: Any, batches: Iterator) -> Any:
            with _range(self.on, "phase:next_batch (waits for the loader)"):
                batch = orig(tally, batches)
            stamp = self._stamps.pop(id(batch[0]), None) if batch is not None else None
            if stamp is not None and self.collect:
                now = time.perf_counter()
                self._latency.append((now - stamp[0], now - stamp[1]))
            return batch
        return wait_for

    def _upload(self, orig: Any) -> Any:
        def upload(source: Any, batch: Any, device: Any) -> Any:
            self._local.t_host = time.perf_counter()
            with _range(self.on, "feed:upload (H2D copy, or the GPU's decode)"):
                return orig(source, batch, device)
        return upload

    def _augment(self, orig: Any) -> Any:
        def call(augment: Any, images: torch.Tensor, sizes: torch.Tensor, seed: int = 0) -> torch.Tensor:
            with _range(self.on, "feed:augment"):
                out = orig(augment, images, sizes, seed)
            t_host = getattr(self._local, "t_host", None)
            if augment.train and t_host is not None:
                if len(self._stamps) > 64:  # batches nobody took (a pass cut short): forget them
                    self._stamps.clear()
                self._stamps[id(out)] = (t_host, time.perf_counter())
            return out
        return call

    def _host_iter(self, orig: Any) -> Any:
        def host_iter(source: Any) -> Iterator:
            return self._annotated(orig(source), "feed:host_batch (waits for workers, files or the cache gather)")
        return host_iter

    def _annotated(self, it: Iterator, label: str) -> Iterator:
        while True:
            with _range(self.on, label):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item


class StepHook:
    """on_step for dlenv.train.train: torch.profiler over `prof_steps` steps of epoch `prof_epoch` (from
    its batch `prof_from`), and the times of batches `time_from`..`time_to` of epoch `time_epoch`
    (epochs counted as the trainer's state.epoch: completed epochs)."""

    def __init__(self, prof_epoch: int, prof_from: int, prof_steps: int, time_epoch: int, time_from: int,
                 time_to: int, trace: Path, device: torch.device, stack: bool = False):
        self.prof_epoch, self.prof_from, self.prof_steps = prof_epoch, prof_from, prof_steps
        self.time_epoch, self.time_from, self.time_to = time_epoch, time_from, time_to
        self.trace, self.device, self.stack = trace, device, stack
        self.annotations = Annotations()
        self.times: dict[int, float] = {}
        self.prof: Any = None
        self.ready = self.done = False
        self.names: dict[int, str] = {}

    def __call__(self, state: Any) -> None:
        epoch, k = int(state.epoch), int(state.batch_in_epoch)
        if epoch == self.time_epoch:
            if self.time_from <= k <= self.time_to:
                self.times[k] = time.perf_counter()
            self.annotations.collect = self.time_from <= k < self.time_to
        elif epoch == self.prof_epoch and self.prof_steps:
            if self.prof is None and k == self.prof_from:
                self.prof = profiler(self.device, self.stack, self.prof_steps, self._ready)
                self.annotations.on = True
                self.prof.start()
            elif self.prof is not None and not self.done:
                self.prof.step()
                if self.ready:
                    self._stop()

    def _ready(self, prof: Any) -> None:
        self.names = thread_names()
        prof.export_chrome_trace(str(self.trace))
        self.ready = True

    def _stop(self) -> None:
        self.annotations.on = False
        self.done = True
        self.prof.stop()

    def rate(self, batch: int) -> float | None:
        """Images/s over the timed batches (None when the epoch had too few)."""
        if len(self.times) < 2:
            return None
        first, last = min(self.times), max(self.times)
        return (last - first) * batch / (self.times[last] - self.times[first])

    def summary(self) -> dict | None:
        if self.prof is not None and not self.done:
            self._stop()
        if not self.ready:
            return None
        return feed_trace.summarize(feed_trace.load(self.trace), threading.main_thread().native_id, self.names)


def profiler(device: torch.device, stack: bool, steps: int, on_ready: Any) -> Any:
    """torch.profiler over one window: a warm-up step, then `steps` recorded ones; `on_ready` at the end.
    Every thread's ops are recorded where this torch can (by default only the threads that inherit the
    profiler's state: the one that started it and autograd's), and CUDA's synchronisations too."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, with_stack=stack, record_shapes=False,
                                  schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
                                  on_trace_ready=on_ready, experimental_config=experimental_config())


def experimental_config() -> Any:
    """Kineto's options for all threads and CUDA sync events, as far as this torch has them (None: none)."""
    from torch._C._profiler import _ExperimentalConfig

    for wanted in ({"profile_all_threads": True, "enable_cuda_sync_events": True}, {"profile_all_threads": True},
                   {"enable_cuda_sync_events": True}):
        with contextlib.suppress(TypeError):
            return _ExperimentalConfig(**wanted)
    return None


# ---------------------------------------------------------------------------------------------------
# The candidate feeds.


class ThreadedIter:
    """next() of `it` run by a helper thread, `depth` items ahead (for work that releases the GIL, such
    as the cache's gather into pinned memory)."""

    def __init__(self, it: Iterator, depth: int = 2):
        self.q: queue.Queue = queue.Queue(depth)
        self.thread = threading.Thread(target=self._run, args=(it,), daemon=True, name="feed-host-thread")
        self.thread.start()

    def _run(self, it: Iterator) -> None:
        try:
            for item in it:
                self.q.put((True, item))
            self.q.put((False, None))
        except BaseException as e:  # raised in the consumer
            self.q.put((False, e))

    def __iter__(self) -> Iterator:
        while True:
            more, item = self.q.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item


class AheadFeed:
    """(images, targets) on the device for one pass over `source` (a fastpath source): the copy and the
    augmentation of batch k+1 are issued by the calling (training) thread on `stream` before batch k is
    handed out, and the consumer's stream waits on an event: no thread between the loader and the step,
    no per-step synchronisation of the host. `stream` None: the current stream (no overlap).
    `host_thread`: the source's own iteration runs in a ThreadedIter."""

    def __init__(self, source: Any, augment: Any, device: torch.device, stream: Any, host_thread: bool,
                 seed: Any, epoch: int):
        self.source, self.augment, self.device, self.stream = source, augment, device, stream
        self.host_thread, self.seed, self.epoch = host_thread, seed, epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        host = iter(self.source)
        if self.host_thread:
            host = iter(ThreadedIter(host))
        pending, position = None, 0
        for batch in host:
            issued = self._issue(batch, position)
            position += issued[0].shape[0]
            if pending is not None:
                yield self._take(pending)
            pending = issued
        if pending is not None:
            yield self._take(pending)

    def _issue(self, batch: Any, position: int) -> tuple:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            images, sizes, labels = self.source.upload(batch, self.device)
            out = self.augment(images, sizes, self.seed(self.epoch, position))
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        return out, labels, ready

    def _take(self, item: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        out, labels, ready = item
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            out.record_stream(current)
            labels.record_stream(current)
        return out, labels


class DeviceCacheSource:
    """A CacheSource's decoded rows copied to the device once: a batch is then one index_select there, with
    no host gather, no pinned copy and no CPU threads (the cache here takes 2.4 GB of the GPU's memory)."""

    def __init__(self, source: Any, device: torch.device):
        self.host, self.device = source, device
        self.images = source.images.to(device)
        self.labels = source.labels.to(device)
        self.rows_of, self.sizes = source.source, source.sizes
        self.bad_paths = source.bad_paths

    def __len__(self) -> int:
        return len(self.host)

    def __iter__(self) -> Iterator[torch.Tensor]:
        from dlenv.data.sources import chunks

        for chunk in chunks(self.host.indices(), self.host.batch_size):
            yield self.rows_of[torch.tensor(chunk, dtype=torch.long)]

    def upload(self, rows: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        on = rows.to(device, non_blocking=False)  # 2 KB of indices
        return self.images.index_select(0, on), self.sizes[rows], self.labels.index_select(0, on)


class Sources:
    """The mirror's loaders, built once as the trainer builds them (dlenv.data.pipeline), and a pass of
    batches per feed; each pass is a new epoch of the loader's sampler, and is drained to its end so the
    workers' stream of batches carries on into the next pass."""

    def __init__(self, a: Any, device: torch.device, located: Any, work: Path, dtype: torch.dtype,
                 memory_format: torch.memory_format):
        self.a, self.device, self.located, self.work = a, device, located, work
        self.dtype, self.memory_format = dtype, memory_format
        self.loaders: dict[str, Any] = {}
        self.epochs: dict[str, int] = {}
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    def loader(self, kind: str) -> Any:
        from dlenv.data import pipeline
        from dlenv.data.plan import InputOptions

        if kind not in self.loaders:
            layout = self.located.layout
            train_only = type(layout)(layout.root, layout.classes, layout.train, [])
            count = re.search(r"-w(\d+)$", kind)  # workers-w10: 10 workers
            workers = int(count.group(1)) if count else "auto"
            opts = InputOptions(gpu_augment="on", cache="on" if kind == "cache" else "off", cache_mode="ram",
                                cache_dir=str(self.work / "mirror-cache"), workers=workers)
            plan = opts.decide(self.located, self.device, self.a.batch_size, self.a.img_size)
            print(f"mirror {kind}: {plan.describe(self.device)}", flush=True)
            self.loaders[kind] = pipeline.make_loaders(train_only, plan, self.device, dtype=self.dtype,
                                                       memory_format=self.memory_format, say=print)[0]
        return self.loaders[kind]

    def _next_epoch(self, kind: str) -> Any:
        ld = self.loader(kind)
        epoch = self.epochs.get(kind, 0)
        self.epochs[kind] = epoch + 1
        if ld.sampler is not None:
            ld.sampler.set_epoch(epoch, 0)
        return ld, epoch

    def batches(self, feed: str, n: int) -> Any:
        """An iterable of at least `n` (images, targets) batches for `feed`."""
        a, dev = self.a, self.device
        if feed == "synthetic":
            g = torch.Generator().manual_seed(0)
            x = torch.randn(a.batch_size, 3, a.img_size, a.img_size, generator=g)
            x = x.to(dev).contiguous(memory_format=self.memory_format).to(self.dtype)
            y = torch.randint(0, len(self.located.classes), (a.batch_size,), generator=g).to(dev)
            return itertools.repeat((x, y), n)
        kind = "cache" if "-cache" in feed or feed.endswith("-augment") else "workers"
        count = re.search(r"-w(\d+)$", feed)  # a worker count of its own: product-workers-w10
        if count:
            kind = f"workers-w{count.group(1)}"
        ld, epoch = self._next_epoch(kind)
        seed = getattr(ld, "batch_seed", lambda e, p: p)
        if feed == "synthetic-augment":  # one stored batch on the device, augmented again every step
            images, sizes, labels = ld.source.upload(next(iter(ld.source)), dev)
            return ((ld.augment(images, sizes, seed(epoch, k * a.batch_size)), labels) for k in range(n))
        if feed == "product-cache-ondevice":  # the product's loader thread and side stream, the gather on the GPU
            from dlenv.data.fastpath import DeviceLoader

            if "ondevice" not in self.loaders:
                self.loaders["ondevice"] = DeviceCacheSource(ld.source, dev)
            return DeviceLoader(self.loaders["ondevice"], ld.augment, dev, a.batch_size, ld.sampler, ld.seed)
        if feed.startswith("product-"):
            return ld
        stream = None if feed.endswith("-inline") else self.stream
        return AheadFeed(ld.source, ld.augment, dev, stream, host_thread=kind == "cache", seed=seed, epoch=epoch)

    def close(self) -> None:
        for ld in self.loaders.values():
            close = getattr(ld, "close", None)
            if close is not None:
                close()
        self.loaders.clear()


# ---------------------------------------------------------------------------------------------------
# The mirror loop.


def compiled(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`model` as the trainer compiles it ('default'), with CUDA graphs ('reduce-overhead'), or eager."""
    from dlenv import compat

    if mode == "eager":
        return model
    torch._dynamo.reset()  # the other mode's graphs are not reused
    return compat.compile_model(model) if mode == "default" else compat.compile_model(model, mode=mode)


def measure(parts: Any, batches: Any, warm: int, steps: int, prof_steps: int, trace: Path | None,
            stack: bool) -> dict[str, Any]:
    """Train `warm` steps, then time `steps` (between two device synchronisations), then profile
    `prof_steps` (plus a warm-up step); the rest of the pass is drained untrained."""
    from dlenv.engine.step import train_step

    it = iter(batches)
    cuda = parts.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(parts.device)

    def one(k: int) -> tuple[torch.Tensor, int]:
        images, targets = next(it)
        loss, _ = train_step(parts, images, targets)
        if k % CHECK_EVERY == CHECK_EVERY - 1:
            float(loss)  # the trainer's check reads the loss here, and so waits for the GPU
        return loss, images.shape[0]

    for k in range(warm):
        loss, _ = one(k)
    sync()
    t, images = time.perf_counter(), 0
    for k in range(steps):
        loss, n = one(k)
        images += n
    sync()
    seconds = time.perf_counter() - t
    out: dict[str, Any] = {"img_s": images / seconds, "timed_steps": steps}
    if prof_steps and trace is not None:
        box: dict[str, Any] = {}

        def ready(p: Any) -> None:
            box["names"] = thread_names()
            p.export_chrome_trace(str(trace))

        prof = profiler(parts.device, stack, prof_steps, ready)
        prof.start()
        for k in range(prof_steps + 1):
            loss, _ = one(k)
            prof.step()
        prof.stop()
        if trace.is_file():
            out["profile"] = feed_trace.summarize(feed_trace.load(trace), threading.main_thread().native_id,
                                                  box.get("names", {}))
    out["loss"] = float(loss)
    for _ in it:  # the rest of the pass: the workers' stream ends this epoch where the next pass expects it
        pass
    return out


def mirror(a: Any, dev: torch.device, located: Any, feeds: list[str], modes: list[str], deadline: float,
           work: Path, traces: Path, earlier: list[dict] = ()) -> list[dict]:
    """The candidate table: every feed of `feeds` in every mode (reduce-overhead: only --graph-feeds),
    synthetic first and again last in each mode; `earlier` rows may hold the default mode's synthetic."""
    from torch import nn

    from dlenv.engine.optim import build_optimizer
    from dlenv.engine.precision import Precision
    from dlenv.engine.step import Parts
    from dlenv.model.models import build_model

    cuda = dev.type == "cuda"
    fmt = torch.channels_last if cuda else torch.contiguous_format
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = build_model(a.model, num_classes=len(located.classes)).to(dev, memory_format=fmt)
    optimizer = build_optimizer(model, "adamw", 1e-3, 0.05)
    precision = Precision("bf16" if cuda else "fp32", dev)
    sources = Sources(a, dev, located, work, dtype, fmt)
    profiled = set(a.profile_feeds.split(","))
    graph_feeds = set(a.graph_feeds.split(","))
    # Python frames (with_stack) cost much time to trace and to read: only where asked
    stacks = {("default" if dev.type == "cuda" else "eager", f) for f in a.stack_feeds.split(",") if f}
    n = a.warm + a.steps + a.profile_steps + 1
    rows: list[dict] = []
    try:
        for mode in modes:
            names = [f for f in feeds if mode != "reduce-overhead" or f in graph_feeds]
            if "synthetic" in names:
                names = ["synthetic", *[f for f in names if f != "synthetic"], "synthetic"]
            parts = Parts(compiled(model, mode), model, optimizer, None, precision, nn.CrossEntropyLoss(), None, dev,
                          fmt, None)
            base = None
            for i, feed in enumerate(names):
                label = "synthetic (again)" if feed == "synthetic" and i else feed
                row: dict[str, Any] = {"mode": mode, "feed": label}
                rows.append(row)
                if time.monotonic() > deadline:
                    row["error"] = "skipped: --budget spent"
                    continue
                t0 = time.monotonic()
                prof = a.profile_steps if feed in profiled and label == feed else 0
                try:
                    row.update(measure(parts, sources.batches(feed, n), a.warm, a.steps, prof,
                                       traces / f"mirror-{mode}-{feed}.json", stack=(mode, feed) in stacks))
                except Exception as e:  # reported in its row; the others still run
                    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    print(f"mirror {mode} {label}: failed: {row['error']}", flush=True)
                    continue
                if feed == "synthetic" and base is None:
                    base = row["img_s"]
                row["x_synthetic"] = row["img_s"] / base if base else None
                yard = next((r["img_s"] for r in [*earlier, *rows] if r["mode"] == "default"
                             and r["feed"] == "synthetic" and "img_s" in r), None)
                row["x_synthetic_default"] = row["img_s"] / yard if yard else None
                row["seconds"] = round(time.monotonic() - t0, 1)
                print(f"mirror {mode} {label}: {row['img_s']:,.0f} img/s, x{fmt_ratio(row['x_synthetic'])} "
                      f"(x{fmt_ratio(row['x_synthetic_default'])} of synthetic default), loss {row['loss']:.3f} "
                      f"({row['seconds']:.0f} s)", flush=True)
    finally:
        sources.close()
    return rows


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"

