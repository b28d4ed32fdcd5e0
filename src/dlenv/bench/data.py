"""`invoke bench-data`: is the input pipeline or the GPU the bottleneck, and what to do about it.

Two numbers decide it. The loader's images/s alone (decode, augment, copy to the device, no model),
at several worker counts; and the model's training images/s on synthetic data already on the device
(no loader at all). Training can only go as fast as the slower of the two; a loader that is not
comfortably faster than the model (HEADROOM) leaves the GPU waiting. The trainer says the same thing
during a run when the data-wait share of an epoch passes a limit (dlenv.train.console.data_wait_advice).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

#: the loader must deliver this many times the model's speed: batches arrive unevenly
HEADROOM = 1.1


def prefetched(loader: Any) -> int:
    """How many batches `loader` may hold ready before anyone asks: a DataLoader's workers x
    prefetch_factor, a DeviceLoader's queue plus its source's. Batches made while nobody waited come
    out instantly, so a timing must start after they are drained, or it measures the buffer."""
    n = 0
    workers = getattr(loader, "num_workers", 0) or 0
    if workers:
        n += workers * (getattr(loader, "prefetch_factor", None) or 2)
    n += getattr(loader, "depth", 0) or 0
    for name in ("source", "loader"):
        inner = getattr(loader, name, None)
        if inner is not None and not hasattr(inner, "shape"):  # CacheSource.source is a tensor
            n += prefetched(inner)
    return n


def measure_loader(loader: Iterable, batches: int, device: Any = None, warmup: int = 2) -> float:
    """Images/s of iterating `loader` for `batches` batches after the untimed ones: `warmup` (worker
    start-up) plus what the loader had prefetched meanwhile (`prefetched`), so the rate is the
    steady one. Batches are moved to `device` if given. Passes over the loader again if it is shorter.

    Workers hand over whole batches in waves (12 workers: 12 batches at once, then a wait), so a
    window of few batches lands between waves by chance: at least `prefetched` batches (4 per worker)
    are timed, which keeps that error within about a quarter of a wave per window.
    """
    import torch

    ahead = prefetched(loader)
    warmup += ahead
    batches = max(batches, ahead)

    sampler = getattr(loader, "sampler", None)
    advance = hasattr(sampler, "set_epoch") and hasattr(sampler, "epoch")

    def stream():
        while True:
            n = 0
            for batch in loader:
                n += 1
                yield batch
            if n == 0:
                raise ValueError("the loader gave no batches")
            if advance:  # the next epoch, as a trainer asks for it: workers that run ahead carry on
                sampler.set_epoch(sampler.epoch + 1)

    def sync(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            torch.cuda.synchronize(x.device)

    it = stream()
    last = None
    for _ in range(warmup):
        last = next(it)[0]
    if last is not None:
        sync(last)
    images = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        x = next(it)[0]
        if device is not None:
            x = x.to(device, non_blocking=True)
        images += x.shape[0]
        last = x
    sync(last)
    return images / (time.perf_counter() - t0)


def measure_model(model_name: str, num_classes: int, batch_size: int, img_size: int, device: Any,
                  precision_mode: str, batches: int, warmup: int = 3) -> float:
    """Training images/s of a torchvision model on one random batch kept on `device` (no loader), with
    the trainer's own step (dlenv.engine.step.train_step)."""
    import torch

    from dlenv.engine.precision import Precision
    from dlenv.engine.step import Parts, train_step
    from dlenv.model.models import build_model, is_convolutional

    device = torch.device(device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    model = build_model(model_name, num_classes)
    fmt = torch.channels_last if device.type == "cuda" and is_convolutional(model) else torch.contiguous_format
    model = model.to(device, memory_format=fmt).train()
    parts = Parts.plain(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                        Precision(precision_mode, device), fmt)
    x = torch.randn(batch_size, 3, img_size, img_size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    for _ in range(warmup):
        train_step(parts, x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(batches):
        train_step(parts, x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return batch_size * batches / (time.perf_counter() - t0)


def verdict(loader_rates: dict[str, float], model_rate: float, cache_measured: bool = False,
            on_gpu: bool = True) -> tuple[str, str]:
    """('input' or 'model', a few sentences naming the bottleneck and what to do) from the measurements.

    `loader_rates`: label -> images/s of each loader variant measured.
    """
    best_label = max(loader_rates, key=loader_rates.get)
    best = loader_rates[best_label]
    if best < HEADROOM * model_rate:
        busy = min(best / model_rate, 1.0)
        tips = []
        if not cache_measured:
            tips.append("--cache (decode once, then crop on the GPU: no decoding per epoch)")
        if on_gpu:
            tips.append("--gpu-augment on, or --decoder nvjpeg (decodes on the GPU, taking time from the "
                        "model's steps: it wins with fewer than 8 workers)")
        tips += ["more CPU cores or --workers", "a smaller --img-size, or JPEGs stored at a smaller size"]
        return "input", (f"The input pipeline is the bottleneck: the best loader ({best_label}) gives "
                         f"{best:,.0f} img/s but the model could train at {model_rate:,.0f} img/s, so the "
                         f"GPU would be busy about {busy:.0%} of the time. Try: " + "; ".join(tips) + ".")
    enough = [k for k, v in loader_rates.items() if v >= HEADROOM * model_rate]
    return "model", (f"The model ({'GPU' if on_gpu else 'CPU'}) is the bottleneck, as it should be: the loader "
                     f"gives up to {best:,.0f} img/s, more than the {model_rate:,.0f} img/s the model trains "
                     "at. Fast enough: " + ", ".join(enough) + ".")


def _table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(cfg: Any) -> int:
    """`dlenv bench-data`: print the loader (per worker count) and model speeds and the verdict; 0."""
    import dataclasses

    import torch

    from dlenv.cluster.devices import resolve_device
    from dlenv.data import pipeline
    from dlenv.data.decode import stored_size
    from dlenv.data.plan import (
        InputOptions,
        decide_cache_mode,
        decide_overlap,
        engine_backends,
        prefer_engines,
        prefer_nvjpeg,
    )
    from dlenv.engine.precision import DTYPES, resolve_precision
    from dlenv.options.cpus import usable_cpus

    device = resolve_device(cfg.device)
    located = pipeline.locate(cfg.data)
    # the size training would use: the demo's 64 px unless --img-size says otherwise
    cfg = dataclasses.replace(cfg, img_size=cfg.img_size or located.img_size)
    mode = resolve_precision(cfg.amp, "auto", device)
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    # what training would pick, with the workers it would get; the cache is measured on its own below
    opts = InputOptions.of(cfg)
    plan = dataclasses.replace(opts, cache=False, workers="auto").decide(located, device, cfg.batch_size, cfg.img_size)
    layout = located.layout
    # nvJPEG is measured wherever it could run (auto takes it with few workers only), once: it decodes
    # on the GPU whatever the worker count
    nvjpeg = plan.decoder == "nvjpeg" or (plan.on_device and cfg.decoder == "auto" and prefer_nvjpeg(
        [p for p, _ in layout.train], device, cfg.batch_size))
    # and so are the GPU's JPEG engines, where nvImageCodec finds them
    engines = plan.decoder == "nvimgcodec" or (plan.on_device and cfg.decoder == "auto" and prefer_engines(
        [p for p, _ in layout.train], device, cfg.batch_size))
    train_only = type(layout)(layout.root, layout.classes, layout.train, [])
    cpus = usable_cpus()
    counts = [w for w in cfg.workers if w <= cpus] or [min(cfg.workers)]
    print(f"bench-data: {located.source} ({len(layout.train):,} training images, {len(located.classes)} classes), "
          f"batch {cfg.batch_size}, {cfg.img_size} px, {device}, {mode}, decoder {plan.decoder}, {cpus} CPUs"
          + (f" (skipping worker counts above {cpus})" if len(counts) < len(cfg.workers) else ""))

    def rate(workers: int, **change: Any) -> float:
        # the worker sweep uses the best CPU decoder: nvJPEG is measured on its own
        variant = dataclasses.replace(plan, **{"workers": workers, "decoder": plan.cpu_decoder, **change})
        # decoding overlapped with the augmentation as training would have it: a GPU decoder's only
        overlap, why = decide_overlap(opts.decode_overlap, variant.decoder, device, variant.cache)
        variant = dataclasses.replace(variant, overlap=overlap, overlap_why=why)
        loader = pipeline.make_loaders(train_only, variant, device, dtype=DTYPES[mode], memory_format=fmt)[0]
        return measure_loader(loader, cfg.batches, device)

    path = "gpu-augment" if plan.on_device else "classic"
    rates: dict[str, float] = {}
    for w in counts:
        rates[f"{path}, {w} workers"] = rate(w)
        print(f"  loader {path:<12} {w:>3} workers: {rates[f'{path}, {w} workers']:>9,.0f} img/s", flush=True)
    other = "classic" if plan.on_device else "gpu-augment"
    w = max(counts)
    rates[f"{other}, {w} workers"] = rate(w, on_device=not plan.on_device)
    if nvjpeg:
        rates["gpu-augment, nvjpeg"] = rate(w, on_device=True, decoder="nvjpeg")
    if engines:
        rates["gpu-augment, nvimgcodec"] = rate(w, on_device=True, decoder="nvimgcodec",
                                                gpu_backends=engine_backends(device))
    if cfg.cache:  # kept where training would keep it (--cache-mode)
        kept = decide_cache_mode(opts, 1, (layout.train,), stored_size(cfg.img_size), device)
        rates["cache"] = rate(w, on_device=True, cache_mode=kept)
    model_rate = measure_model(cfg.model, len(located.classes), cfg.batch_size, cfg.img_size, device, mode,
                               cfg.batches)
    rows = [("what", "img/s", "x model")]
    rows += [(f"loader: {k}", f"{v:,.0f}", f"{v / model_rate:.2f}") for k, v in rates.items()]
    rows.append((f"model: {cfg.model} on synthetic data", f"{model_rate:,.0f}", "1.00"))
    print(_table(rows))
    _, message = verdict(rates, model_rate, cfg.cache, device.type == "cuda")
    print(message)
    return 0
