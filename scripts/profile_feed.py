#!/usr/bin/env python3
"""Where the time of a compiled step goes when real data feeds it, and what would win it back (issue 36).

Part 1, the product (--rows): the real trainer (`dlenv.train.train`, three epochs, ResNet-50 --amp by
default) on the issue's rows: synthetic compiled, compiled `--cache on`, compiled default on JPEGs
(DataLoader workers), and, in a child process held to --cores-eager CPUs, eager on synthetic data and
on JPEGs. In the second epoch a window of --profile-steps steps is traced by torch.profiler (CPU and
CUDA activities, every thread where torch can), with the loop's phases and the feed's steps annotated
from here (the functions are wrapped while the row runs; nothing in src/dlenv changes);
`feed_trace.summarize` reduces each trace. The third epoch's steps 11-41 are timed, unprofiled, from
the trainer's own on_step calls (the loop reads the GPU every 10 steps, so these times are the GPU's).
Rows `*-static`, `default-compiled-graphs` and `default-compiled-dynamic` change only the trainer's
torch.compile call (dynamic=False, which the trainer itself passes since 0f3bfda; mode="reduce-overhead";
dynamic=None, the call before 0f3bfda). The default dataset has no
short last batch (46 x 256); `--train-images 12000` is the issue's set-up, whose short batch makes
torch.compile compile again with a dynamic batch size.

Part 2, the candidates (--feeds, --modes): a mirror of the trainer's step (`dlenv.engine.step.train_step` on
the trainer's model, AdamW and autocast, the loss read every 10 steps as the trainer's check does) fed
in several ways from the same data, each against synthetic data in the same process and mode:

- `synthetic`: one batch already on the device, in the loader's dtype and layout (the same graph);
- `synthetic-augment`: a stored uint8 batch on the device, augmented every step by the training thread:
  the augmentation's cost without copies or other threads;
- `product-cache`, `product-workers`: the product's DeviceLoader (a Python thread uploads and augments
  on a side stream, three batches ahead) over the cache or over the DataLoader workers;
- `product-cache-ondevice`: the same loader with the cache's rows in GPU memory (the gather on the GPU);
- `ahead-cache`, `ahead-workers`: the same sources, but the copy and augmentation of batch k+1 are
  issued by the training thread itself, on a side stream, just before step k, with no per-step sync
  (the main stream waits on an event); the cache's gather runs in a helper thread that needs no GIL;
- `ahead-cache-inline`: as ahead-cache on the main stream (does the side stream matter?);
- `*-w10`: the workers feeds with 10 workers instead of auto's count.

Modes: `default` (torch.compile as the trainer calls it), `reduce-overhead` (CUDA graphs through
torch.compile), `eager`. The results and what they say: docs/input-pipeline.md, "Where the time goes on
a compiled run".

    python3 scripts/profile_feed.py --out /tmp/pf --keep-traces --budget 410   # ~7 min on an H200, 16 CPUs
    python3 scripts/profile_feed.py --train-images 12000 --feeds "" --cores-eager 0 \
        --rows synthetic-compiled,default-compiled,default-compiled-static       # the short batch's cost
    python3 scripts/profile_feed.py --device cpu --model small_cnn --img-size 32 --batch-size 8 \
        --train-images 64 --val-images 16 --warm 2 --steps 3 --profile-steps 2 --out /tmp/pf-cpu

Writes OUT/profile_feed.json (every number) and OUT/profile_feed.md (the tables and timelines) after
each part, and with --keep-traces OUT/traces.tar (the gzipped Chrome traces, at most 15 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import gzip
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import benchhost  # noqa: E402
import feed_variants as fv  # noqa: E402
import torch  # noqa: E402

from dlenv.data import pipeline  # noqa: E402
from dlenv.options import config  # noqa: E402
from dlenv.options.cpus import usable_cpus  # noqa: E402

#: product rows: train options (synthetic data has no loader)
ROWS = {
    "synthetic-compiled": {"synthetic": True, "compile": "on"},
    "cache-compiled": {"cache": "on", "cache_mode": "ram", "compile": "on"},
    "default-compiled": {"cache": "off", "compile": "on"},  # --cache auto leaves 12k JPEGs to the workers
    "synthetic-eager": {"synthetic": True, "compile": "off"},
    "cache-eager": {"cache": "on", "cache_mode": "ram", "compile": "off"},
    "default-eager": {"cache": "off", "compile": "off"},
    # the trainer's torch.compile call changed from here (a measurement, not the product): dynamic=False keeps
    # one static graph per batch size (a short last batch compiles its own), reduce-overhead adds CUDA graphs
    "cache-compiled-static": {"cache": "on", "cache_mode": "ram", "compile": "on", "_compile": {"dynamic": False}},
    "default-compiled-static": {"cache": "off", "compile": "on", "_compile": {"dynamic": False}},
    "default-compiled-graphs": {"cache": "off", "compile": "on", "_compile": {"mode": "reduce-overhead"}},
    # the trainer's call before it took dynamic=False (0f3bfda): the short last batch's dynamic-shape graph
    "default-compiled-dynamic": {"cache": "off", "compile": "on", "_compile": {"dynamic": None}},
}
EPOCHS = 3          # 1: compile and fill; 2: the profiled window; 3: the timed steps
PROFILE_EPOCH = 1   # completed epochs when the window runs (the trainer's state.epoch)
TIMED_EPOCH = 2
TIMED = (11, 41)    # batches of the timed epoch: from just after one loss read to just after another


def yardstick(name: str) -> str:
    return "synthetic-compiled" if "-compiled" in name else "synthetic-eager"


@contextlib.contextmanager
def compile_args(kwargs: dict | None):
    """The trainer's compat.compile_model called with `kwargs` added, while a row runs."""
    from dlenv import compat

    if not kwargs:
        yield
        return
    orig = compat.compile_model
    compat.compile_model = lambda model, **given: orig(model, **{**given, **kwargs})
    try:
        yield
    finally:
        compat.compile_model = orig


def product_row(name: str, a: argparse.Namespace, work: Path, traces: Path) -> dict:
    """Train row `name` through dlenv.train.train with the profiler hook; its numbers and trace summary."""
    from dlenv.train import train

    opts = ROWS[name]
    steps = a.train_images // a.batch_size
    first, last = min(TIMED[0], max(1, steps // 4)), min(TIMED[1], steps)
    hook = fv.StepHook(PROFILE_EPOCH, min(5, steps - a.profile_steps - 2), a.profile_steps, TIMED_EPOCH, first,
                       last, traces / f"{name}.json", torch.device(a.device), stack=False)
    cfg = config.build(config.TrainConfig, data=None if opts.get("synthetic") else str(a.data), model=a.model,
                       amp=True, batch_size=a.batch_size, img_size=a.img_size, epochs=EPOCHS,
                       max_steps=steps if opts.get("synthetic") else None, project=str(work / name), name="run",
                       cache_dir=str(work / "cache"), device=a.device, **{k: v for k, v in opts.items()
                                                                          if k not in ("synthetic", "_compile")},
                       synthetic=bool(opts.get("synthetic")))
    with hook.annotations, compile_args(opts.get("_compile")):
        summary = train(cfg, on_step=hook)
    with open(Path(summary["run_dir"]) / "results.csv", newline="") as f:
        last_row = list(csv.DictReader(f))[-1]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"row": name, "options": opts, "img_s": hook.rate(a.batch_size), "timed_steps": [first, last],
            "epoch_img_s": float(last_row["img_per_s"]), "data_wait": float(last_row["data_wait"]),
            "latency_ms": hook.annotations.latency_ms(), "profile": hook.summary(),
            "not_annotated": hook.annotations.missing}


def run_rows(a: argparse.Namespace, names: list[str], deadline: float, work: Path, traces: Path) -> list[dict]:
    rows, speeds = [], {}
    for name in names:
        if time.monotonic() > deadline:
            rows.append({"row": name, "error": "skipped: --budget spent"})
            continue
        t0 = time.monotonic()
        try:
            r = product_row(name, a, work, traces)
        except Exception as e:  # one failed row is reported and the others still run
            rows.append({"row": name, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
            print(f"{name}: failed: {rows[-1]['error']}", flush=True)
            continue
        if name.startswith("synthetic"):
            speeds[name] = r["img_s"]
        base = speeds.get(yardstick(name))
        r["x_synthetic"] = r["img_s"] / base if base and r["img_s"] else None
        r["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(r)
        print(f"{name}: {fmt(r['img_s'])} img/s steady, x{fmt(r['x_synthetic'], 2)}; epoch "
              f"{r['epoch_img_s']:,.0f} img/s, data wait {r['data_wait']:.1%} ({r['seconds']:.0f} s)", flush=True)
        print(timeline(r), flush=True)
    return rows


def child(a: argparse.Namespace, n: int, deadline: float) -> dict | None:
    """The eager rows in a process held to `n` CPUs (its workers inherit that); its JSON."""
    out = a.out / f"cores{n}"
    cmd = [sys.executable, __file__, "--pin", str(n), "--rows", a.eager_rows, "--feeds", "", "--out", str(out),
           "--data", str(a.data), "--train-images", str(a.train_images), "--val-images", str(a.val_images),
           "--batch-size", str(a.batch_size), "--img-size", str(a.img_size), "--model", a.model,
           "--device", a.device, "--profile-steps", str(a.profile_steps), "--cores-eager", "0",
           "--budget", str(max(1, int(deadline - time.monotonic())))]
    if a.have_data:
        cmd.append("--have-data")
    if a.keep_traces:
        cmd.append("--keep-traces")
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.call(cmd)
    path = out / "profile_feed.json"
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------------
# The report.


def fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def timeline(r: dict) -> str:
    """A profiled row's step as text: the GPU's busy and idle time, who was late, the main thread's
    phases, the feed's thread, the streams and the synchronisations, per step."""
    s = r.get("profile")
    if not s:
        return "  (no profile)"
    lines = []
    g = s.get("gpu")
    if g:
        hist = ", ".join(f"{k} {v['count']} ({v['ms']:.2f} ms)" for k, v in g["gaps"].items() if v["count"])
        lines.append(f"  GPU: {g['step_ms']:.2f} ms a step, idle {g['idle_per_step_ms']:.2f} ms a step "
                     f"({g['idle_share']:.1%}); gaps over {s['steps']} steps: {hist or 'none'}")
    gp = s.get("gaps")
    if gp:
        late = ", ".join(f"{who} {ms:.2f} ms" for who, ms in gp["late_launch_ms"].items()) or "none"
        lines.append(f"  gaps >= 20 us: {gp['per_step_ms']:.2f} ms a step; launched late by: {late}; queued behind "
                     f"another stream or event: {gp['queued_waiting_ms']:.2f} ms")
        main = "; ".join(f"{n} {v:.2f}" for n, v in gp["main_thread_during_gaps_ms"][:6])
        lines.append(f"  main thread during the gaps (ms in window): {main or '-'}")
        for who, names in gp["late_thread_top_ms"].items():
            if who != "main":
                top5 = "; ".join(f"{n} {v:.2f}" for n, v in names[:5])
                lines.append(f"  {who} before its late launches (ms): {top5}")
    if s.get("phases"):
        lines.append("  per step: " + "; ".join(f"{k} {v['ms_per_step']:.2f} ms" for k, v in s["phases"].items()))
    for who, t in s.get("threads", {}).items():
        if t["busy_ms_per_step"] >= 0.5:
            names = "; ".join(f"{n} {v:.2f}" for n, v in t["top_ms_per_step"][:5])
            lines.append(f"  thread {who}: in ops {t['busy_ms_per_step']:.2f} ms a step; top (ms a step): {names}")
    for sid, v in s.get("streams", {}).items():
        copies = ", ".join(f"{k} {c['count']}x {c['MB']:.0f} MB" for k, c in v["copies"].items())
        lines.append(f"  stream {sid} ({v['role']}): {v['kernels']} kernels, {v['kernel_ms']:.1f} ms"
                     + (f"; {copies}" if copies else ""))
    for who, calls in s.get("syncs", {}).items():
        each = ", ".join(f"{k} {c['per_step']}x {c['ms_per_step']:.2f} ms" for k, c in calls.items())
        lines.append(f"  synchronisation calls on {who} (a step): {each}")
    lat = r.get("latency_ms")
    if lat:
        lines.append(f"  a batch from leaving the workers/cache to its step: {lat['host_to_step_median']} ms median "
                     f"(after its augmentation was issued: {lat['ready_to_step_median']} ms), {lat['batches']} batches")
    if r.get("not_annotated"):
        lines.append(f"  not annotated (not found): {', '.join(r['not_annotated'])}")
    return "\n".join(lines)


def report(result: dict) -> str:
    i = result["info"]
    out = [f"{i['device']} (driver {i.get('driver', '-')}), PyTorch {i['torch']}, CUDA {i['cuda']}, Python "
           f"{i['python']}, {i['cpus']} CPUs; {i['model']} --amp, batch {i['batch']}, {i['img_size']} px, "
           f"{i['train_images']:,} JPEGs 500x375; {i['date']}", ""]

    def rows_table(rows: list[dict], title: str) -> None:
        out.extend([title, "", "| row | img/s (steady) | x synthetic | epoch img/s | data wait | GPU idle ms/step |",
                    "| --- | ---: | ---: | ---: | ---: | ---: |"])
        for r in rows:
            if "error" in r:
                out.append(f"| {r['row']} | {r['error']} | | | | |")
                continue
            g = (r.get("profile") or {}).get("gpu") or {}
            out.append(f"| {r['row']} | {fmt(r['img_s'])} | {fmt(r.get('x_synthetic'), 2)} | {fmt(r['epoch_img_s'])} | "
                       f"{r['data_wait']:.1%} | {fmt(g.get('idle_per_step_ms'), 2)} |")
        out.append("")
        for r in rows:
            if "error" not in r:
                out.extend([f"{r['row']}:", timeline(r), ""])

    rows_table(result["rows"], "Part 1: the trainer (dlenv.train.train), steady state (third epoch, unprofiled)")
    for n, child in result.get("children", {}).items():
        if child:
            rows_table(child["rows"], f"The trainer held to {n} CPUs")
        else:
            out.extend([f"The trainer held to {n} CPUs: no result", ""])
    if result.get("feeds"):
        out.extend(["Part 2: the mirror loop (dlenv.engine.step.train_step) by feed and compile mode", "",
                    "| mode | feed | img/s | x synthetic (same mode) | x synthetic compiled default "
                    "| GPU idle ms/step |",
                    "| --- | --- | ---: | ---: | ---: | ---: |"])
        for r in result["feeds"]:
            if "error" in r:
                out.append(f"| {r['mode']} | {r['feed']} | {r['error']} | | | |")
                continue
            g = (r.get("profile") or {}).get("gpu") or {}
            out.append(f"| {r['mode']} | {r['feed']} | {fmt(r['img_s'])} | {fmt(r.get('x_synthetic'), 2)} | "
                       f"{fmt(r.get('x_synthetic_default'), 2)} | {fmt(g.get('idle_per_step_ms'), 2)} |")
        out.append("")
        for r in result["feeds"]:
            if r.get("profile"):
                out.extend([f"{r['mode']} {r['feed']}:", timeline(r), ""])
    out.append(f"total {result.get('seconds', 0):.0f} s")
    return "\n".join(out)


def machine_info(dev: torch.device, a: Any) -> dict[str, Any]:
    import datetime

    from dlenv.options.cpus import usable_cpus

    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpus": usable_cpus(), "model": a.model, "batch": a.batch_size, "img_size": a.img_size,
            "train_images": a.train_images, "device": "CPU"}
    if dev.type == "cuda":
        info["device"] = torch.cuda.get_device_name(dev)
        info["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            import subprocess

            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
    return info


def keep_traces(traces: Path, tar_path: Path, limit: int = 15 << 20) -> None:
    """The traces gzipped into one tar of at most `limit` bytes (what the device tool brings back): the
    trainer's rows first, then the mirror's; a trace that would pass the limit is left out."""
    total = 0
    paths = sorted(traces.glob("*.json"), key=lambda p: (p.name.startswith("mirror-"), p.name))
    with tarfile.open(tar_path, "w") as tar:
        for path in paths:
            gz = path.with_suffix(".json.gz")
            with open(path, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
                dst.write(src.read())
            if total + gz.stat().st_size + 1024 > limit:
                print(f"traces.tar: {gz.name} left out ({gz.stat().st_size / 2**20:.1f} MiB)", flush=True)
                continue
            total += gz.stat().st_size + 1024
            tar.add(gz, arcname=gz.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("profile-feed"))
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "dlenv-jpegs-profile")
    p.add_argument("--train-images", type=int, default=11_776, help="default 46 x 256: no short last batch, whose "
                   "new shape makes torch.compile compile again, with a dynamic batch size (12000: the issue's set-up)")
    p.add_argument("--val-images", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=None, help="product rows (default: the three compiled ones on CUDA, the "
                   f"eager ones on a CPU); of: {', '.join(ROWS)}")
    p.add_argument("--cores-eager", type=int, default=4, help="CPUs for the eager rows' child process (0: none)")
    p.add_argument("--eager-rows", default="synthetic-eager,default-eager")
    p.add_argument("--feeds", default=",".join(fv.FEEDS), help=f"mirror feeds, of: {', '.join(fv.FEEDS)}")
    p.add_argument("--graph-feeds", default="synthetic,product-cache,product-cache-ondevice,product-workers",
                   help="the feeds measured again with CUDA graphs (mode reduce-overhead)")
    p.add_argument("--modes", default=None, help="mirror modes (default: default,reduce-overhead on CUDA, eager "
                   "on a CPU)")
    p.add_argument("--profile-feeds", default="synthetic,product-cache,product-cache-ondevice,product-workers")
    p.add_argument("--stack-feeds", default="", help="feeds profiled with Python frames too (torch.profiler's "
                   "with_stack), in the first mode: minutes to write and read on a GPU")
    p.add_argument("--warm", type=int, default=8, help="mirror steps before timing (the first compiles)")
    p.add_argument("--steps", type=int, default=24, help="mirror steps timed")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds; later rows are skipped past it")
    p.add_argument("--keep-traces", action="store_true", help="OUT/traces.tar with the gzipped traces")
    p.add_argument("--have-data", action="store_true", help="--data is complete: do not check or generate it")
    p.add_argument("--pin", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget
    benchhost.hold_cores(a.pin)
    dev = benchhost.device_or_none(a.device, "profile_feed")
    if dev is None:
        return 2
    if a.train_images < a.batch_size:
        print(f"--train-images {a.train_images} is fewer than one batch (--batch-size {a.batch_size})", file=sys.stderr)
        return 2
    cuda = dev.type == "cuda"
    if not cuda:  # the CPU check: a model that fits one batch drives its gradients into denormals, 100x slower
        torch.set_flush_denormal(True)
    rows = [r for r in (a.rows or ("synthetic-compiled,cache-compiled,default-compiled" if cuda
                                   else "synthetic-eager,cache-eager,default-eager")).split(",") if r]
    modes = [m for m in (a.modes or ("default,reduce-overhead" if cuda else "eager")).split(",") if m]
    unknown = [r for r in rows if r not in ROWS] + [f for f in a.feeds.split(",") if f and f not in fv.FEEDS]
    if unknown:
        print(f"unknown rows or feeds: {', '.join(unknown)}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.have_data:
        import make_jpeg_dataset

        t = time.monotonic()
        make_jpeg_dataset.generate(a.data, a.train_images, a.val_images, 10, 500, 375, 0, usable_cpus())
        print(f"dataset: {a.data} ({time.monotonic() - t:.0f} s)", flush=True)
        a.have_data = True
    work = Path(tempfile.mkdtemp(prefix="profile-feed-"))
    traces = work / "traces"
    traces.mkdir()
    info = machine_info(dev, a)
    print(json.dumps(info), flush=True)
    result: dict = {"info": info, "rows": [], "feeds": [], "children": {}}

    def save() -> None:  # after each part: a run cut short still leaves what it measured
        result["seconds"] = round(time.monotonic() - t_start, 1)
        (a.out / "profile_feed.json").write_text(json.dumps(result, indent=1))
        (a.out / "profile_feed.md").write_text(report(result) + "\n")

    result["rows"] = run_rows(a, rows, deadline, work, traces)
    save()
    located = pipeline.locate(str(a.data))
    feeds = [f for f in a.feeds.split(",") if f]
    # the eager rows' child between the modes: CUDA graphs compile longest, so they come last
    for k, mode in enumerate(modes):
        if feeds and time.monotonic() < deadline:
            result["feeds"] += fv.mirror(a, dev, located, feeds, [mode], deadline, work, traces, result["feeds"])
            save()
        if k == 0 and a.cores_eager and cuda:
            result["children"][str(a.cores_eager)] = child(a, a.cores_eager, deadline)
            save()
    print("\n" + report(result), flush=True)
    if a.keep_traces:
        keep_traces(traces, a.out / "traces.tar")
    import shutil

    with contextlib.suppress(OSError):
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
