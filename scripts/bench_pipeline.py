#!/usr/bin/env python3
"""Input-pipeline variants against the model's own speed, on a generated photo-like JPEG dataset.

For each variant: the loader's images/s alone (decode, augment, to the GPU; no model), then ResNet-50
--amp trained through the real trainer (`dlenv.train.train`) for two full epochs, reporting the
second epoch's training images/s and data-wait share (the first one starts workers, fills caches and
tunes cuDNN). The yardstick is the same training on synthetic data already in GPU memory.

Variants: classic (torchvision transforms in DataLoader workers, float batches) with Pillow, OpenCV
and torchvision.io decoding; gpu-augment (uint8 stored-form batches from workers, crop/flip/normalize
on the GPU); nvjpeg (torchvision.io.decode_jpeg on the GPU, where this torchvision has it); cache-ram
and cache-disk (decoded once, then only copied); nvimgcodec (nvImageCodec on the GPU's hardware JPEG
engines); default-compiled (the default with torch.compile, against synthetic-compiled). Worker counts
are the trainer's defaults (auto).

    python3 scripts/bench_pipeline.py --out /tmp/out             # about 5-6 minutes on an H200, 16 CPUs
    python3 scripts/bench_pipeline.py --only synthetic,cache-ram --train-images 5000
    python3 scripts/bench_pipeline.py --cores 4,8,16 --only default,gpu-augment,nvimgcodec --train-images 12000

Writes bench_pipeline.csv and bench_pipeline.md to --out.
"""

from __future__ import annotations

import argparse
import csv
import gc
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

from dlenv import compat, config  # noqa: E402
from dlenv.bench.data import measure_loader  # noqa: E402
from dlenv.data import hwdecode, pipeline  # noqa: E402
from dlenv.data.decode import stored_size  # noqa: E402
from dlenv.data.loaders import resolve_workers, usable_cpus  # noqa: E402
from dlenv.data.plan import InputOptions, pick_decoder  # noqa: E402

#: name -> train options (synthetic data has no loader to measure alone)
VARIANTS = {
    "synthetic": {"synthetic": True},
    "default": {},  # every input option at auto: what `invoke train --amp` does on this machine
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
    "cache-disk": {"cache": True, "cache_mode": "disk"},
}
COLUMNS = ["variant", "decoder", "loader_img_s", "train_img_s", "data_wait", "ratio_to_synthetic",
           "epoch1_img_s", "seconds"]


def loader_rate(opts: dict, located: pipeline.Located, batch: int, img: int, batches: int, cache_dir: str,
                dev: torch.device) -> tuple[float, str]:
    """(images/s of the training loader alone, decoder used), decided and built as the trainer does."""
    layout = located.layout
    train_only = type(layout)(layout.root, layout.classes, layout.train, [])
    plan = InputOptions(cache_dir=cache_dir, **opts).decide(located, dev, batch, img)
    fmt = torch.channels_last if dev.type == "cuda" else torch.contiguous_format
    loader = pipeline.make_loaders(train_only, plan, dev, dtype=torch.bfloat16, memory_format=fmt,
                                   say=lambda m: None)[0]
    rate = measure_loader(loader, batches, dev, warmup=3)
    del loader
    gc.collect()
    return rate, plan.cpu_decoder if plan.cache else plan.decoder


def train_rate(opts: dict, data: str, model: str, batch: int, img: int, steps: int | None, project: str,
               cache_dir: str, device: str) -> dict:
    """Train `model` --amp for 2 epochs; the second epoch's row of results.csv (and the first's img/s)."""
    from dlenv.train import train

    cfg = config.build(config.TrainConfig, data=None if opts.get("synthetic") else data, model=model,
                       amp=True, batch_size=batch, img_size=img, epochs=2, max_steps=steps, project=project,
                       name="run", cache_dir=cache_dir, device=device, **opts)
    summary = train(cfg)
    with open(Path(summary["run_dir"]) / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"epoch1": float(rows[0]["img_per_s"]), "img_s": float(rows[1]["img_per_s"]),
            "data_wait": float(rows[1]["data_wait"])}


def table(rows: list[dict], info: str) -> str:
    out = [info, "", "| variant | decoder | loader img/s | train img/s | data wait | x synthetic |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        loader = f"{r['loader_img_s']:,.0f}" if r["loader_img_s"] else "-"
        wait = f"{r['data_wait']:.1%}" if r["data_wait"] is not None else "-"
        train = f"{r['train_img_s']:,.0f}" if r["train_img_s"] else "-"
        ratio = f"{r['ratio_to_synthetic']:.2f}" if r["ratio_to_synthetic"] else "-"
        out.append(f"| {r['variant']} | {r['decoder']} | {loader} | {train} | {wait} | {ratio} |")
    return "\n".join(out)


def per_core_count(a: argparse.Namespace, argv: list[str]) -> int:
    """Run the bench once per --cores count, each in its own process held to that many cores (the first
    ones of this process's affinity), into --out/cores<N>; print the tables one after another."""
    import subprocess

    counts = [int(c) for c in a.cores.split(",") if c.strip()]
    have = len(os.sched_getaffinity(0))
    rest, skip = [], False
    for arg in argv:  # this command line without --cores and --out
        if skip:
            skip = False
        elif arg in ("--cores", "--out"):
            skip = True
        elif not arg.startswith(("--cores=", "--out=")):
            rest.append(arg)
    tables, rc = [], 0
    for n in counts:
        if n > have:
            print(f"--cores {n}: this process may use {have} CPUs; skipped", flush=True)
            continue
        out = a.out / f"cores{n}"
        rc |= subprocess.call([sys.executable, __file__, *rest, "--pin", str(n), "--out", str(out)])
        if (out / "bench_pipeline.md").is_file():
            tables.append(f"### {n} cores\n\n" + (out / "bench_pipeline.md").read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_pipeline_cores.md").write_text("\n".join(tables))
    print("\n".join(tables))
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
    p.add_argument("--loader-batches", type=int, default=20, help="batches timed per loader measurement")
    p.add_argument("--only", default=",".join(v for v in VARIANTS if not v.startswith("gpu-augment-")
                                              and "compiled" not in v and v != "default-nocache"),
                   help="comma-separated variants (the gpu-augment-* levers and the compiled runs only when named)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script itself")
    p.add_argument("--loader-only", action="store_true", help="measure the loaders alone, no training runs")
    p.add_argument("--cores", default="", help="comma-separated CPU counts (e.g. 4,8,16): the whole bench once "
                                               "per count, in a process held to that many cores (as taskset)")
    p.add_argument("--pin", type=int, default=0, help=argparse.SUPPRESS)  # one count of --cores, in the child
    a = p.parse_args(argv)
    if a.cores:
        return per_core_count(a, sys.argv[1:] if argv is None else argv)
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
    info = (f"{gpu}, PyTorch {torch.__version__}, {usable_cpus()} CPUs, "
            f"workers auto = {resolve_workers('auto', a.batch_size, a.img_size)}; {a.model} --amp, batch "
            f"{a.batch_size}, {a.img_size} px; {len(layout.train):,} JPEGs 500x375; second epoch of two")
    print(info, flush=True)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    if a.loader_only:
        names = [n for n in names if n != "synthetic"]
    else:
        if "synthetic" not in names:
            names.insert(0, "synthetic")
        if any("compiled" in n for n in names) and "synthetic-compiled" not in names:
            names.insert(1, "synthetic-compiled")
    rows, synthetic, yardstick = [], None, {}
    # gpu-augment is the best CPU decoder feeding GPU augmentation ('auto' itself picks nvJPEG on CUDA)
    cpu_best = pick_decoder([p for p, _ in layout.train], stored_size(a.img_size))
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
        t0 = time.perf_counter()
        if opts.get("synthetic"):
            loader, decoder = None, "-"
        elif "compile" in opts:  # the loader is the uncompiled variant's: only the training differs
            loader, decoder = None, InputOptions(cache_dir=cache_dir).decide(located, dev, a.batch_size,
                                                                             a.img_size).decoder
        else:
            loader, decoder = loader_rate(opts, located, a.batch_size, a.img_size, a.loader_batches, cache_dir, dev)
        if a.loader_only:
            rows.append({"variant": name, "decoder": decoder, "loader_img_s": loader, "train_img_s": None,
                         "data_wait": None, "ratio_to_synthetic": None, "epoch1_img_s": None,
                         "seconds": time.perf_counter() - t0})
            print(f"{name}: loader {loader:,.0f} img/s ({time.perf_counter() - t0:.0f} s)", flush=True)
            continue
        run = train_rate(opts, str(a.data), a.model, a.batch_size, a.img_size, a.steps, str(work / name),
                         cache_dir, a.device)
        compiled = "compile" in opts
        if opts.get("synthetic"):
            yardstick[compiled] = run["img_s"]
        synthetic = yardstick.get(compiled) or run["img_s"]
        rows.append({"variant": name, "decoder": decoder, "loader_img_s": loader, "train_img_s": run["img_s"],
                     "data_wait": None if opts.get("synthetic") else run["data_wait"],
                     "ratio_to_synthetic": run["img_s"] / synthetic, "epoch1_img_s": run["epoch1"],
                     "seconds": time.perf_counter() - t0})
        print(f"{name}: loader {f'{loader:,.0f} img/s' if loader else '-'}, train {run['img_s']:,.0f} img/s, data wait "
              f"{run['data_wait']:.1%}, x{run['img_s'] / synthetic:.2f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    md = table(rows, info)
    print("\n" + md)
    with open(a.out / "bench_pipeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (a.out / "bench_pipeline.md").write_text(md + "\n")
    target = [r for r in rows if (r["ratio_to_synthetic"] or 0) >= 0.9 and (r["data_wait"] or 0) <= 0.10
              and not r["variant"].startswith("synthetic")]
    print(f"\nmeets the target (>= 0.9x synthetic, data wait <= 10%): "
          f"{', '.join(r['variant'] for r in target) or 'none'}; total {time.perf_counter() - t_start:.0f} s")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
