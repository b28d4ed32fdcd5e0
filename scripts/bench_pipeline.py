#!/usr/bin/env python3
"""Input-pipeline variants against the model's own speed, on a generated photo-like JPEG dataset.

For each variant: the loader's images/s alone (decode, augment, to the GPU; no model), then ResNet-50
--amp trained through the real trainer (`dlenv.train.train`) for --epochs epochs (compiled rows:
--compiled-epochs), reporting the last epoch's training images/s and data-wait share (the first one starts
workers, fills caches and tunes cuDNN). The yardstick is the same training on synthetic data already in GPU
memory, with as many batches per epoch as the JPEGs give. Every epoch of every run is also kept: its img/s,
data wait, peak reserved GPU memory, the held CPUs' busy share, and what torch.compile compiled in it
(`compat.compile_counters`), so a run whose early epochs are slow says whether it compiled then.

Variants: classic (torchvision transforms in DataLoader workers, float batches) with Pillow, OpenCV
and torchvision.io decoding; gpu-augment (uint8 stored-form batches from workers, crop/flip/normalize
on the GPU); nvjpeg (torchvision.io.decode_jpeg on the GPU, where this torchvision has it); cache-ram
and cache-disk (decoded once, then only copied); cache-gpu (decoded once into GPU memory, then gathered
there); nvimgcodec (nvImageCodec on the GPU's hardware JPEG engines); default (every input option at
auto); default-nocache (the default with --cache off: what auto did before it kept a dataset that fits
in GPU memory); default-serial and default-overlap (the same with --decode-overlap off and on: a GPU
decoder's decoding and the augmentation in series, or overlapped in two threads); default-long (the
default for --long-epochs: GPU memory over a long run); default-compiled (the default with
torch.compile, against synthetic-compiled). The start column is the seconds from the trainer's call to
its first step: model, plan, loaders and a cache's fill.
Worker counts are the trainer's defaults (auto).

    python3 scripts/bench_pipeline.py --out /tmp/out             # about 5-6 minutes on an H200, 16 CPUs
    python3 scripts/bench_pipeline.py --only synthetic,cache-ram --train-images 5000
    python3 scripts/bench_pipeline.py --cores 4,8,16 --only default,gpu-augment,nvimgcodec --train-images 12000

--cores runs the bench once per CPU count, each in a process held to that many cores (as taskset), after
generating the data once with every core; --where NAME=2,4 keeps a variant to those counts, --budget stops
starting rows that would not finish in time. Issue 49's rows in one call: the command in
docs/input-pipeline.md, "Overlap on few cores".

Writes bench_pipeline.csv, bench_pipeline_epochs.csv and bench_pipeline.md to --out (per count: --out/cores<N>,
and the tables of all counts together in bench_pipeline_cores.md).
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import benchhost  # noqa: E402
import torch  # noqa: E402

from dlenv import compat  # noqa: E402
from dlenv.bench.data import measure_loader  # noqa: E402
from dlenv.data import hwdecode, pipeline  # noqa: E402
from dlenv.data.decode import stored_size  # noqa: E402
from dlenv.data.plan import InputOptions, pick_decoder  # noqa: E402
from dlenv.data.workers import decide_workers  # noqa: E402
from dlenv.options import config  # noqa: E402
from dlenv.options.cpus import usable_cpus  # noqa: E402

#: name -> train options (synthetic data has no loader to measure alone)
VARIANTS = {
    "synthetic": {"synthetic": True},
    "default": {},  # every input option at auto: what `invoke train --amp` does on this machine
    "default-serial": {"decode_overlap": "off"},  # a GPU decoder's decoding and the augmentation in series
    "default-overlap": {"decode_overlap": "on"},  # ... overlapped, in two threads (auto: off, measured slower)
    "default-long": {},  # the same for --long-epochs (LONG): GPU memory over a long run
    "default-nocache": {"cache": "off"},  # the same where --cache auto would decode a small dataset once
    "classic-pil": {"gpu_augment": "off", "decoder": "pil"},
    "classic-cv2": {"gpu_augment": "off", "decoder": "cv2"},
    "classic-tvio": {"gpu_augment": "off", "decoder": "tvio"},
    "gpu-augment": {"gpu_augment": "on"},
    # the default path's levers (issue 17 part 4): the decoder inside the workers, and more workers
    "gpu-augment-cv2": {"gpu_augment": "on", "decoder": "cv2"},
    "gpu-augment-tvio": {"gpu_augment": "on", "decoder": "tvio"},
    "gpu-augment-12w": {"gpu_augment": "on", "workers": 12},  # auto's count at 16 cores until 2026-12
    "gpu-augment-16w": {"gpu_augment": "on", "workers": 16},
    "nvjpeg": {"decoder": "nvjpeg"},
    "nvimgcodec": {"decoder": "nvimgcodec"},  # the GPU's hardware JPEG engines (dlenv.data.hwdecode)
    # a long run compiles by itself (--compile auto): the same with torch.compile, against its own yardstick
    "synthetic-compiled": {"synthetic": True, "compile": "on"},
    "default-compiled": {"compile": "on"},
    "cache-ram": {"cache": True, "cache_mode": "ram"},
    "cache-gpu": {"cache": True, "cache_mode": "gpu"},
    "cache-disk": {"cache": True, "cache_mode": "disk"},
}
#: the default with --decode-overlap off and on: run only when named
OVERLAP_AB = {"default-serial", "default-overlap"}
#: variants trained for --long-epochs
LONG = {"default-long"}
#: issue 55's targets: x synthetic at this many cores (the compiled 16-core row too)
TARGETS = {2: 0.95, 4: 0.97, 8: 0.98, 16: 0.98}
COLUMNS = ["cores", "variant", "decoder", "cache", "overlap", "loader_img_s", "train_img_s", "data_wait",
           "ratio_to_synthetic", "top1", "start_s", "epoch1_img_s", "epochs", "reserved_e2_gib", "reserved_last_gib",
           "seconds"]
EPOCH_COLUMNS = ["cores", "variant", "epoch", "img_s", "data_wait", "reserved_gib", "top1", "frames", "graphs",
                 "cache_misses", "cpu_busy"]


def loader_rate(opts: dict, located: pipeline.Located, batch: int, img: int, batches: int, cache_dir: str,
                dev: torch.device) -> float:
    """Images/s of the training loader alone, decided and built as the trainer does."""
    layout = located.layout
    train_only = type(layout)(layout.root, layout.classes, layout.train, [])
    plan = InputOptions(cache_dir=cache_dir, **opts).decide(located, dev, batch, img)
    fmt = torch.channels_last if dev.type == "cuda" else torch.contiguous_format
    loader = pipeline.make_loaders(train_only, plan, dev, dtype=torch.bfloat16, memory_format=fmt,
                                   say=lambda m: None)[0]
    rate = measure_loader(loader, batches, dev, warmup=3)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del loader
    gc.collect()
    return rate


class EpochWatch:
    """Readings at a run's start, at the first step of each later epoch (the trainer's on_step) and at its end:
    torch.compile's counters and the held CPUs' clock ticks. `deltas()`: per epoch, what compiled in it and the
    CPUs' busy share (each epoch's span includes its validation)."""

    def __init__(self) -> None:
        self.epoch, self.marks = 0, []
        self.t0, self.first_step = time.perf_counter(), None  # the start: model, plan, loaders, a cache's fill
        self.mark()

    def mark(self) -> None:
        self.marks.append((compat.compile_counters(), *benchhost.cpu_jiffies()))

    def __call__(self, state: object) -> None:
        if self.first_step is None:
            self.first_step = time.perf_counter() - self.t0
        epoch = int(getattr(state, "epoch", 0))
        if epoch > self.epoch:
            self.epoch = epoch
            self.mark()

    def deltas(self) -> list[dict]:
        out = []
        for (c0, b0, t0), (c1, b1, t1) in zip(self.marks, self.marks[1:], strict=False):
            out.append({**{k: c1[k] - c0[k] for k in c1}, "cpu_busy": (b1 - b0) / (t1 - t0) if t1 > t0 else None})
        return out


def train_rate(opts: dict, data: str, a: argparse.Namespace, epochs: int, steps: int | None,
               project: str, cache_dir: str) -> dict:
    """Train a.model --amp for `epochs` epochs: the last epoch's img/s and data wait, the first's img/s, and a
    row per epoch (results.csv's with EpochWatch's readings)."""
    from dlenv.train import train

    # eager unless the variant compiles: a long run's --compile auto would compile the default-long row
    opts = {"compile": "off", **opts}
    cfg = config.build(config.TrainConfig, data=None if opts.get("synthetic") else data, model=a.model,
                       amp=True, batch_size=a.batch_size, img_size=a.img_size, epochs=epochs, max_steps=steps,
                       project=project, name="run", cache_dir=cache_dir, device=a.device, **opts)
    watch = EpochWatch()
    summary = train(cfg, on_step=watch)
    watch.mark()
    with open(Path(summary["run_dir"]) / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    per_epoch = []
    deltas = watch.deltas()
    deltas += [{}] * (len(rows) - len(deltas))  # a run cut short has fewer readings than rows
    for k, (row, d) in enumerate(zip(rows, deltas[:len(rows)], strict=True)):
        per_epoch.append({"epoch": k + 1, "img_s": float(row["img_per_s"]), "data_wait": float(row["data_wait"]),
                          "reserved_gib": float(row["mem_reserved_gib"] or 0), "top1": float(row["top1"] or 0), **d})
    last = per_epoch[-1]
    return {"epoch1": per_epoch[0]["img_s"], "img_s": last["img_s"], "data_wait": last["data_wait"],
            "epochs": per_epoch, "start_s": watch.first_step, "top1": last["top1"]}


def _f(v: object, fmt: str) -> str:
    return "-" if v is None or v == "" else format(float(v), fmt)


def table(rows: list[dict], info: str) -> str:
    """The markdown table of `rows` (COLUMNS), with `info` above it."""
    out = [info, "", "| cores | variant | decoder | cache | overlap | loader img/s | train img/s | data wait | "
                     "x synthetic | target | top-1 % | start s | epoch 1 img/s | reserved GiB, epoch 2 -> last |",
           "| ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        cores = int(r["cores"]) if r["cores"] not in (None, "") else None
        target = TARGETS.get(cores) if cores and not str(r["variant"]).startswith("synthetic") else None
        epochs = int(r["epochs"] or 0)
        mem = (f"{_f(r['reserved_e2_gib'], '.2f')} -> {_f(r['reserved_last_gib'], '.2f')} ({epochs} epochs)"
               if epochs >= 2 else "-")
        out.append(f"| {cores or '-'} | {r['variant']} | {r['decoder']} | {r.get('cache') or '-'} | {r['overlap']} | "
                   f"{_f(r['loader_img_s'], ',.0f')} | {_f(r['train_img_s'], ',.0f')} | {_f(r['data_wait'], '.1%')} | "
                   f"{_f(r['ratio_to_synthetic'], '.3f')} | {_f(target, '.2f')} | {_f(r.get('top1'), '.1f')} | "
                   f"{_f(r.get('start_s'), '.1f')} | "
                   f"{_f(r.get('epoch1_img_s'), ',.0f')} | {mem} |")
    return "\n".join(out)


def epoch_table(rows: list[dict]) -> str:
    """Per epoch of a run: where its speed and memory went, and what compiled in it."""
    out = ["| cores | variant | epoch | img/s | data wait | reserved GiB | frames compiled | graphs | "
           "Inductor cache misses | held CPUs busy |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['cores']} | {r['variant']} | {r['epoch']} | {_f(r['img_s'], ',.0f')} | "
                   f"{_f(r['data_wait'], '.1%')} | {_f(r['reserved_gib'], '.2f')} | {r.get('frames', '-')} | "
                   f"{r.get('graphs', '-')} | {r.get('cache_misses', '-')} | {_f(r.get('cpu_busy'), '.0%')} |")
    return "\n".join(out)


def shown_epochs(rows: list[dict], runs: list[dict]) -> list[dict]:
    """The per-epoch rows worth a table (the CSV has every run's): the compiled and the long runs."""
    keep = {(str(r["cores"]), r["variant"]) for r in runs if "compiled" in r["variant"] or r["variant"] in LONG}
    return [r for r in rows if (str(r["cores"]), r["variant"]) in keep]


def _write(out: Path, rows: list[dict], epochs: list[dict], info: str) -> None:
    """The tables so far (rewritten after every row: a call cut short keeps what it measured)."""
    with open(out / "bench_pipeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(out / "bench_pipeline_epochs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, EPOCH_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(epochs)
    shown = shown_epochs(epochs, rows)
    (out / "bench_pipeline.md").write_text(table(rows, info) + ("\n\n" + epoch_table(shown) if shown else "") + "\n")


def variants_at(names: list[str], where: list[str], cores: int) -> list[str]:
    """The variants of `names` that run at `cores` CPUs: each --where NAME=C1,C2 keeps NAME to those counts."""
    only: dict[str, set[int]] = {}
    for spec in where:
        name, _, counts = spec.partition("=")
        if name.strip() not in VARIANTS or not counts.strip():
            raise SystemExit(f"bench_pipeline: --where {spec!r}: expected NAME=CORES[,CORES] with NAME one of the "
                             "variants")
        only[name.strip()] = {int(c) for c in counts.split(",") if c.strip()}
    return [n for n in names if n not in only or cores in only[n]]


def need_s(name: str, a: argparse.Namespace) -> float:
    """A generous guess of a row's seconds on an H200, for --budget: compiling costs most, then long runs."""
    if "compiled" in name:
        return 90
    return 15 + 5 * (a.long_epochs if name in LONG else a.epochs)


def per_core_count(a: argparse.Namespace, argv: list[str], names: list[str]) -> int:
    """Run the bench once per --cores count, each in its own process held to that many cores (the first
    ones of this process's affinity), into --out/cores<N>; print the tables of all counts together."""
    import subprocess

    import make_jpeg_dataset

    t0 = time.time()
    deadline = t0 + a.budget if a.budget else 0
    counts = [int(c) for c in a.cores.split(",") if c.strip()]
    have = len(os.sched_getaffinity(0))
    # the data once, with every core: a child held to 2 cores would take minutes to write it
    make_jpeg_dataset.generate(a.data, a.train_images, a.val_images, 10, 500, 375, 0, usable_cpus())
    rest, skip = [], False
    for arg in argv:  # this command line without --cores, --out, --only, --where and --budget
        if skip:
            skip = False
        elif arg in ("--cores", "--out", "--only", "--where", "--budget"):
            skip = True
        elif not arg.startswith(("--cores=", "--out=", "--only=", "--where=", "--budget=")):
            rest.append(arg)
    rc = 0
    for n in counts:
        mine = variants_at(names, a.where, n)
        if n > have:
            print(f"--cores {n}: this process may use {have} CPUs; skipped", flush=True)
            continue
        if deadline and time.time() > deadline - 40:
            print(f"--cores {n}: skipped, --budget {a.budget:.0f} s nearly spent", flush=True)
            continue
        if not mine:
            continue
        extra = ["--deadline", f"{deadline:.0f}"] if deadline else []
        rc |= subprocess.call([sys.executable, __file__, *rest, "--only", ",".join(mine), "--pin", str(n),
                               "--out", str(a.out / f"cores{n}"), *extra])
    runs, epochs, info = [], [], ""
    for n in sorted(counts):
        folder = a.out / f"cores{n}"
        if (folder / "bench_pipeline.csv").is_file():
            with open(folder / "bench_pipeline.csv", newline="") as f:
                runs += list(csv.DictReader(f))
            with open(folder / "bench_pipeline_epochs.csv", newline="") as f:
                epochs += list(csv.DictReader(f))
            info = info or (folder / "bench_pipeline.md").read_text().splitlines()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    head = (f"{', '.join(info.split(', ')[:4])}; cores as the rows say (taskset), workers auto; {a.model} --amp, batch "
            f"{a.batch_size}, {a.img_size} px; {a.train_images:,} JPEGs 500x375; last epoch of --epochs {a.epochs} "
            f"(compiled: {a.compiled_epochs}; default-long: {a.long_epochs}); total {time.time() - t0:.0f} s")
    shown = shown_epochs(epochs, runs)
    md = table(runs, head) + ("\n\n" + epoch_table(shown) if shown else "")
    (a.out / "bench_pipeline_cores.md").write_text(md + "\n")
    print("\n" + md)
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."), help="folder for bench_pipeline.csv/.md")
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "dlenv-jpegs",
                   help="where the JPEG dataset is generated (kept and reused)")
    p.add_argument("--train-images", type=int, default=20_000)
    p.add_argument("--val-images", type=int, default=1_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=None, help="batches per epoch (default: whole epochs)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of each training run; the last one is reported")
    p.add_argument("--compiled-epochs", type=int, default=4, help="epochs of the compiled runs")
    p.add_argument("--long-epochs", type=int, default=20, help="epochs of default-long (memory over a long run)")
    p.add_argument("--loader-batches", type=int, default=20,
                   help="batches timed per loader measurement (0: no loader-alone measurement)")
    p.add_argument("--only", default=",".join(v for v in VARIANTS if not v.startswith("gpu-augment-")
                                              and "compiled" not in v and v not in OVERLAP_AB | LONG
                                              and v != "default-nocache"),
                   help="comma-separated variants (the gpu-augment-* levers, default-serial, default-overlap, "
                        "default-long and the compiled runs only when named)")
    p.add_argument("--where", action="append", default=[], metavar="NAME=CORES",
                   help="with --cores: run variant NAME only at these CPU counts (comma-separated); repeatable")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script itself")
    p.add_argument("--loader-only", action="store_true", help="measure the loaders alone, no training runs")
    p.add_argument("--cores", default="", help="comma-separated CPU counts (e.g. 4,8,16): the whole bench once "
                                               "per count, in a process held to that many cores (as taskset)")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole call: rows that would end "
                                                           "after it are not started (0: no limit)")
    p.add_argument("--pin", type=int, default=0, help=argparse.SUPPRESS)  # one count of --cores, in the child
    p.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)  # --budget's end, in the child
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"bench_pipeline: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if a.cores:
        return per_core_count(a, sys.argv[1:] if argv is None else argv, names)
    deadline = a.deadline or (time.time() + a.budget if a.budget else 0)
    benchhost.hold_cores(a.pin)
    dev = benchhost.device_or_none(a.device, "bench_pipeline")
    if dev is None:
        return 2
    import make_jpeg_dataset

    t_start = time.perf_counter()
    make_jpeg_dataset.generate(a.data, a.train_images, a.val_images, 10, 500, 375, 0, usable_cpus())
    located = pipeline.locate(str(a.data))
    layout = located.layout
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    cache_dir = str(work / "cache")
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    import torchvision

    nvimgcodec = getattr(hwdecode.module()[0], "__version__", None)
    info = (f"{gpu}, PyTorch {torch.__version__}, torchvision {torchvision.__version__}, "
            f"nvImageCodec {nvimgcodec or 'not installed'}, {usable_cpus()} CPUs, "
            f"workers auto = {decide_workers('auto', a.batch_size, a.img_size)[0]}; {a.model} --amp, batch "
            f"{a.batch_size}, {a.img_size} px; {len(layout.train):,} JPEGs 500x375; last epoch of {a.epochs}")
    print(info, flush=True)
    if a.loader_only:
        names = [n for n in names if n != "synthetic"]
    else:
        if "synthetic" not in names:
            names.insert(0, "synthetic")
        if any("compiled" in n for n in names) and "synthetic-compiled" not in names:
            names.insert(1, "synthetic-compiled")
    rows, epochs_rows, yardstick = [], [], {}
    # gpu-augment is the best CPU decoder feeding GPU augmentation ('auto' itself picks nvJPEG on CUDA)
    cpu_best = pick_decoder([p for p, _ in layout.train], stored_size(a.img_size))
    # a synthetic epoch as long as a JPEG one (without --steps it would be the trainer's 100 batches)
    synthetic_steps = a.steps or math.ceil(len(layout.train) / a.batch_size)
    for name in names:
        opts = VARIANTS[name]
        if name == "gpu-augment":
            opts = {**opts, "decoder": cpu_best}
        if name == "nvjpeg" and compat.cuda_jpeg_unavailable(dev):
            print(f"{name}: skipped ({compat.cuda_jpeg_unavailable(dev)})", flush=True)
            continue
        if name == "nvimgcodec" and hwdecode.unavailable(dev):
            print(f"{name}: skipped ({hwdecode.unavailable(dev)})", flush=True)
            continue
        if deadline and time.time() + need_s(name, a) > deadline:
            print(f"{name}: skipped, --budget nearly spent", flush=True)
            continue
        t0 = time.perf_counter()
        decoder, overlap, kept, loader = "-", "-", "-", None
        if not opts.get("synthetic"):
            plan = InputOptions(cache_dir=cache_dir, **opts).decide(located, dev, a.batch_size, a.img_size)
            decoder = plan.cpu_decoder if plan.cache and plan.cache_mode != "gpu" else plan.decoder
            overlap, kept = str(plan.overlap).lower(), plan.cache_mode
            if "compile" not in opts and a.loader_batches:  # a compiled row's loader is its eager twin's
                loader = loader_rate(opts, located, a.batch_size, a.img_size, a.loader_batches, cache_dir, dev)
        if a.loader_only:
            rows.append({"cores": a.pin or usable_cpus(), "variant": name, "decoder": decoder, "cache": kept,
                         "overlap": overlap, "loader_img_s": loader, "seconds": time.perf_counter() - t0})
            print(f"{name}: loader {loader or 0:,.0f} img/s ({time.perf_counter() - t0:.0f} s)", flush=True)
            _write(a.out, rows, epochs_rows, info)
            continue
        compiled = "compile" in opts
        epochs = a.compiled_epochs if compiled else a.long_epochs if name in LONG else a.epochs
        run = train_rate(opts, str(a.data), a, epochs, synthetic_steps if opts.get("synthetic") else a.steps,
                         str(work / name), cache_dir)
        if opts.get("synthetic"):
            yardstick[compiled] = run["img_s"]
        synthetic = yardstick.get(compiled) or run["img_s"]
        reserved = [e["reserved_gib"] for e in run["epochs"]]
        rows.append({"cores": a.pin or usable_cpus(), "variant": name, "decoder": decoder, "cache": kept,
                     "overlap": overlap, "loader_img_s": loader, "train_img_s": run["img_s"], "start_s": run["start_s"],
                     "top1": None if opts.get("synthetic") else run["top1"],
                     "data_wait": None if opts.get("synthetic") else run["data_wait"],
                     "ratio_to_synthetic": run["img_s"] / synthetic, "epoch1_img_s": run["epoch1"],
                     "epochs": len(run["epochs"]), "reserved_e2_gib": reserved[1] if len(reserved) > 1 else None,
                     "reserved_last_gib": reserved[-1], "seconds": time.perf_counter() - t0})
        epochs_rows += [{"cores": a.pin or usable_cpus(), "variant": name, **e} for e in run["epochs"]]
        print(f"{name}: loader {f'{loader:,.0f} img/s' if loader else '-'}, train {run['img_s']:,.0f} img/s, data wait "
              f"{run['data_wait']:.1%}, x{run['img_s'] / synthetic:.3f}, per epoch "
              f"{', '.join(f'{e:,.0f}' for e in (x['img_s'] for x in run['epochs']))} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        _write(a.out, rows, epochs_rows, info)
    _write(a.out, rows, epochs_rows, info)
    print("\n" + (a.out / "bench_pipeline.md").read_text())
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
