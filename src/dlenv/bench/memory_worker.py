"""Inside a bench-memory worker process: one configuration measured, written as JSON for the parent.

`python -m dlenv.bench.memory_worker --worker SPEC --result FILE` (dlenv.bench.memory.run_worker
starts it) builds the seeded model of SPEC and runs the trainer's own step (dlenv.engine.step.train_step)
on one seeded batch: `measure` times warm-up + N steps and reads the peaks, `measure_max_batch`
searches the largest batch that fits (dlenv.engine.autobatch), `measure_checkpoint_search` the fewest
checkpointed blocks that fit the batch (the auto-ratio row), `measure_allocator` trains on a batch and
image size that change every step under the PYTORCH_CUDA_ALLOC_CONF the parent set. A CUDA
out-of-memory is a result ("oom"), not a crash; a UserError goes back to the parent as one; any other
exception is one line for the table ("error", naming the line of the user's model file), its traceback on
stderr, which the parent keeps in the output folder's log.

The model is measured as it is: a spec without num_classes (bench-memory's auto) builds a factory of your
own with its own default class count (`usermodel.default_classes`; 1000 where it has none) and takes the class count
from the model's own output (one forward of two images, `dlenv.model.usermodel.output_classes`), so a factory
that fixes its head (kuangliu's `ResNet18()`: 10 classes) trains on targets in its range.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from dlenv.bench.memory import GIB, NO_SEARCH_ON_CPU, NUM_CLASSES, SEED, fragmentation_schedule
from dlenv.cluster.devices import resolve_device
from dlenv.compat import is_oom
from dlenv.engine.autobatch import search_max_batch
from dlenv.engine.checkpointsearch import fewest_checkpoint_blocks
from dlenv.engine.precision import Precision, resolve_precision
from dlenv.engine.step import Parts, train_step
from dlenv.engine.stepprobe import make_train_step_probe
from dlenv.errors import UserError, first_line, host_memory_short
from dlenv.model import usermodel
from dlenv.model.checkpointing import apply_checkpointing
from dlenv.model.models import build_model, is_convolutional


def _parts(model: Any, mode: str, dev: torch.device, fmt: torch.memory_format) -> Parts:
    """The trainer's step around `model`: SGD with momentum, one Precision for `mode`."""

    return Parts.plain(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), Precision(mode, dev), fmt)


def _build(spec: dict[str, Any]) -> Any:
    """The spec's model, seeded (the same initial weights in every configuration), and its class count
    written into the spec: the one asked for, or with none asked the model's own (see the docstring)."""

    asked = spec.get("num_classes")
    if asked is None:  # the factory's own note ("its output must already have N classes") does not apply
        logging.getLogger(usermodel.__name__).setLevel(logging.ERROR)
    torch.manual_seed(spec.get("seed", SEED))
    # none asked: a factory of your own builds its own default (MobileNetV2(num_classes=10)), not ImageNet's
    own_default = usermodel.default_classes(spec["model"]) if asked is None and usermodel.is_reference(
        spec["model"]) else None
    model = build_model(spec["model"], asked or own_default or NUM_CLASSES)
    own = usermodel.output_classes(model, spec["model"], spec["img_size"], _channels(spec))
    if asked is not None and own != asked:
        raise UserError(f"--model {spec['model']} gives {own} classes, not --num-classes {asked}; leave "
                        "--num-classes out to measure the model's own head")
    spec["num_classes"] = own
    return model


def _channels(spec: dict[str, Any]) -> int:
    return int(spec.get("channels") or 3)


def _setup(spec: dict[str, Any], checkpoint: bool = True):
    """Device, model (seeded, checkpointed as the spec asks unless `checkpoint` is False, channels_last as
    asked) and precision mode for a spec; the spec's num_classes is set (`_build`)."""

    dev = resolve_device(spec["device"])
    if spec.get("gpu_memory_gib") and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["gpu_memory_gib"] * GIB / total), index)
    model = _build(spec)
    conv = bool(is_convolutional(model))
    if checkpoint and spec.get("checkpoint"):  # True: every block; a number: that ratio (the auto-ratio row's answer)
        apply_checkpointing(model, ratio=1.0 if spec["checkpoint"] is True else float(spec["checkpoint"]))
    fmt = torch.channels_last if spec.get("channels_last") else torch.contiguous_format
    model = model.to(dev, memory_format=fmt).train()
    mode = resolve_precision(True, spec.get("amp_dtype", "auto"), dev) if spec.get("amp") else "fp32"
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as training does: the fastest kernels for fixed shapes
    return dev, model, conv, mode, fmt


def _env_info(dev, spec: dict[str, Any]) -> dict[str, Any]:
    info = {"device": dev.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "num_classes": spec["num_classes"]}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["gpu_total_gib"] = torch.cuda.get_device_properties(dev).total_memory / GIB
        if spec.get("gpu_memory_gib"):
            info["gpu_capped_gib"] = min(spec["gpu_memory_gib"], info["gpu_total_gib"])
    return info


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peaks(dev) -> tuple[float | None, float | None]:
    if dev.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(dev) / GIB, torch.cuda.max_memory_reserved(dev) / GIB


def _oom_as_status(run: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Call run(); a CUDA or host out-of-memory becomes status "oom" in `out` (a result, not a crash)."""
    try:
        run()
    except Exception as e:
        host = host_memory_short(e)
        if host is None and not is_oom(e):
            raise
        out.update(status="oom", error=f"out of host memory (RAM): {host}" if host else first_line(e, named=False))
    return out


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's warmup + timed training steps on one seeded batch (run inside a worker).

    Returns status ("ok" or "oom"), peak allocated/reserved GiB over the timed steps (None on CPU),
    images/s, the loss at the first and the last step, and steps the GradScaler skipped.
    """
    dev, model, conv, mode, fmt = _setup(spec)
    out = dict(_env_info(dev, spec), convolutional=conv, precision=mode, status="ok")
    b, s = spec["batch_size"], spec["img_size"]
    gen = torch.Generator().manual_seed(spec.get("seed", SEED) + 1)  # the same batch everywhere
    x_cpu = torch.randn(b, _channels(spec), s, s, generator=gen)
    y_cpu = torch.randint(0, spec["num_classes"], (b,), generator=gen)
    warmup, steps = spec["warmup"], spec["steps"]

    def run() -> None:
        x = x_cpu.to(dev).contiguous(memory_format=fmt)
        y = y_cpu.to(dev)
        parts = _parts(model, mode, dev, fmt)
        skipped, first, loss = 0, None, None
        for i in range(warmup + steps):
            if i == warmup:
                _sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
            loss, stepped = train_step(parts, x, y)
            print(f"step {i + 1}/{warmup + steps}: loss {float(loss):.4f}", file=sys.stderr, flush=True)
            skipped += 0 if stepped else 1
            if first is None:
                first = loss
        _sync(dev)
        seconds = time.perf_counter() - t0
        alloc, reserved = _peaks(dev)
        out.update(peak_alloc_gib=alloc, peak_reserved_gib=reserved, img_per_s=b * steps / seconds,
                   loss_first=float(first), loss_last=float(loss), skipped_steps=skipped)

    return _oom_as_status(run, out)


def _factory(spec: dict[str, Any]):
    """A model factory for the probes: the spec's seeded model, built afresh."""

    def factory():
        torch.manual_seed(spec.get("seed", SEED))
        return build_model(spec["model"], spec["num_classes"])

    return factory


def measure_max_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """The largest batch whose real training steps fit this configuration (run inside a worker; CUDA only)."""

    dev, model, conv, mode, fmt = _setup(spec)
    out = dict(_env_info(dev, spec), convolutional=conv, precision=mode, status="ok")
    if dev.type != "cuda":
        return dict(out, max_batch=None)
    del model
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    factory = _factory(spec)
    probe = make_train_step_probe(factory, mode, spec.get("checkpoint", False), spec["img_size"],
                                  spec["num_classes"], dev,
                                  channels_last=bool(spec.get("channels_last")))
    res = search_max_batch(probe, start=spec["batch_size"], tolerance=spec.get("tolerance", 0.01),
                           what=f"{spec['model']} at {spec['img_size']} px")
    probe.close()
    # what the search's out-of-memory tries left behind once the probe is closed: none of it should stay
    held = (torch.cuda.memory_allocated(dev) - before) / 2**20
    return dict(out, max_batch=res.largest_fit, max_batch_tries=len(res.tries), max_batch_s=res.seconds,
                held_after_mib=round(held, 1))


def measure_checkpoint_search(spec: dict[str, Any]) -> dict[str, Any]:
    """The fewest of the model's repeated blocks to checkpoint for the spec's batch to fit (in a worker).

    Runs `dlenv.engine.checkpointsearch.fewest_checkpoint_blocks` at the spec's precision: status "ok" with
    ckpt_blocks, ckpt_n_blocks, ckpt_ratio, ckpt_fits_all, ckpt_tries and ckpt_search_s; status
    "skipped" with the reason on a CPU.
    """

    dev, model, conv, mode, fmt = _setup(spec, checkpoint=False)
    out = dict(_env_info(dev, spec), convolutional=conv, precision=mode, status="ok")
    if dev.type != "cuda":
        return dict(out, status="skipped", error=NO_SEARCH_ON_CPU)
    del model  # the search trains a probe model of its own
    torch.cuda.empty_cache()
    res = fewest_checkpoint_blocks(_factory(spec), mode, spec["img_size"], spec["num_classes"],
                                   dev, spec["batch_size"], channels_last=bool(spec.get("channels_last")))
    return dict(out, ckpt_blocks=res.blocks, ckpt_n_blocks=res.n_blocks, ckpt_ratio=res.ratio,
                ckpt_fits_all=res.fits_all, ckpt_tries=res.tries, ckpt_search_s=res.seconds)


def measure_allocator(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak allocated/reserved, fragmentation and images/s on a shape-changing workload (in a worker).

    The worker's PYTORCH_CUDA_ALLOC_CONF is the setting under test; the workload is the same seeded
    schedule of batch and image sizes for every setting.
    """
    dev, model, conv, mode, fmt = _setup(spec)
    out = dict(_env_info(dev, spec), precision=mode, status="ok")
    schedule = fragmentation_schedule(spec["batch_size"], spec["img_size"], spec["steps"])
    parts = _parts(model, mode, dev, fmt)
    gen = torch.Generator().manual_seed(spec.get("seed", SEED) + 2)

    def run() -> None:
        images = 0
        _sync(dev)
        t0 = time.perf_counter()
        for b, s in schedule:
            x = torch.randn(b, _channels(spec), s, s, generator=gen).to(dev).contiguous(memory_format=fmt)
            y = torch.randint(0, spec["num_classes"], (b,), generator=gen).to(dev)
            train_step(parts, x, y)
            images += b
        _sync(dev)
        alloc, reserved = _peaks(dev)
        out.update(peak_alloc_gib=alloc, peak_reserved_gib=reserved,
                   fragmentation=(1 - alloc / reserved) if reserved else None,
                   img_per_s=images / (time.perf_counter() - t0))

    return _oom_as_status(run, out)


def _where(e: BaseException, model: Any) -> str:
    """' at line N of FILE' for the deepest frame of `e` in the user's model file, or ''."""

    if not (isinstance(model, str) and usermodel.is_reference(model)):
        return ""
    ref = usermodel.parse_reference(model)
    return usermodel.where(e, ref.path() if ref.is_file else None)


_MODES = {"measure": measure, "max_batch": measure_max_batch, "ckpt_search": measure_checkpoint_search,
          "allocator": measure_allocator}


def _worker_main(argv: list[str]) -> int:
    """Entry of `python -m dlenv.bench.memory_worker --worker SPEC --result FILE`: run one spec, write
    JSON to FILE."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dlenv.bench.memory_worker", allow_abbrev=False)
    p.add_argument("--worker", required=True, help="JSON spec of one measurement")
    p.add_argument("--result", required=True, help="file to write the JSON result to")
    a = p.parse_args(argv)
    spec = json.loads(a.worker)
    try:
        result = _MODES[spec.get("mode", "measure")](spec)
    except UserError as e:
        result = {"status": "user_error", "error": str(e)}
    except Exception as e:  # one line for the table; the traceback goes to the parent's log
        traceback.print_exc()
        result = {"status": "error", "error": first_line(e) + _where(e, spec.get("model"))}
    Path(a.result).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
