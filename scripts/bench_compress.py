"""Before/after table of dlenv's compressions: size, zipped size, latency and top-1.

    python3 scripts/bench_compress.py                      # trains ResNet-18 on the demo data first
    python3 scripts/bench_compress.py --weights runs/exp/best_model.pth

Each row is one variant of the same checkpoint, measured the same way on its validation data:
float32; global L1 pruning at 30% and 50% (as saved: no fine-tune), 50% then one fine-tune epoch;
channels removed down to 50% of the parameters (Torch-Pruning), without and with one fine-tune epoch;
dynamic and static int8 (FX). Sizes are of the TorchScript file of each
variant (one container format for float and int8), raw and zip-deflated. CPU latency is one image,
median, at the thread count printed; GPU latency (float variants, when there is a GPU) is a batch of
64, to show that zeros in dense tensors do not speed up dense kernels. Writes the table as Markdown
and CSV into --out. Runs where dlenv is not installed (the repo's src/ is put on the path).
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", help="a dlenv checkpoint; default: train ResNet-18 on the demo data first")
    p.add_argument("--data", help="validation data; default: the checkpoint's own")
    p.add_argument("--epochs", type=int, default=5, help="training epochs when no --weights is given")
    p.add_argument("--model", default="resnet18", help="architecture to train when no --weights is given")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the CPU latency (default: torch's)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", default="auto")
    p.add_argument("--out", default="runs/bench-compress", help="folder for the trained run and the table")
    return p.parse_args(argv)


def train_demo(args: argparse.Namespace) -> Path:
    """Train args.model on the demo data (written on first use); returns best_model.pth."""
    import torch

    from dlenv.data.demo import DEMO_IMG_SIZE, ensure_demo_data
    from dlenv.options import config
    from dlenv.train import train

    out = Path(args.out)
    data = ensure_demo_data(out / "demo-data")
    cfg = config.build(config.TrainConfig, data=str(Path(data).resolve()), model=args.model, epochs=args.epochs,
                       img_size=DEMO_IMG_SIZE, workers=args.workers,
                       project=str(out), name=f"{args.model}-demo", exist_ok=True,
                       amp=torch.cuda.is_available())
    summary = train(cfg)
    if summary.get("status") != "done":
        raise SystemExit(summary.get("exit_code") or 1)
    return Path(summary["best"])


def gpu_latency_ms(model, img_size: int, batch: int = 64, runs: int = 30) -> float | None:
    """Median ms of one float forward of `batch` images on the GPU, or None without one."""
    import copy

    import torch

    if not torch.cuda.is_available():
        return None
    m = copy.deepcopy(model).cuda().eval()
    x = torch.randn(batch, 3, img_size, img_size, device="cuda")
    times = []
    with torch.no_grad():
        for _ in range(5):
            m(x)
        torch.cuda.synchronize()
        for _ in range(runs):
            t0 = time.perf_counter()
            m(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from dlenv import compat
    from dlenv.compress import channels, common, prune, quantize
    from dlenv.data.loaders import build_loaders
    from dlenv.data.plan import InputPlan

    threads = args.threads or torch.get_num_threads()
    weights = Path(args.weights) if args.weights else train_demo(args)
    torch.set_num_threads(threads)  # as asked, or as before training (which may change it)
    src = common.open_weights(str(weights), "benchmark")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root, loader = common.eval_loader(args.data, src, args.batch_size, args.workers)
    example = common.first_batch(loader)[:1]
    size = src.img_size

    def fresh():
        return common.cpu_copy(src.model)

    def pruned(amount: float, structured: bool = False, finetune: int = 0):
        m = fresh()
        if structured:  # channels removed (Torch-Pruning), as `dlenv prune --structured`
            m, _ = channels.remove_channels(m, amount, example, len(src.class_names))
            layers = []
        else:
            layers = prune.apply_pruning(m, amount)
        if finetune:
            layout = common.train_layout(src)
            plan = InputPlan.classic(size, args.batch_size, args.workers, norm=src.norm,
                                     interpolation=src.interpolation)
            train_loader, _ = build_loaders(layout, plan)
            prune.finetune(m, train_loader, device, finetune, lr=0.01)
            m.cpu()
        prune.make_permanent(layers)
        return m.eval()

    variants = [("float32", fresh, False), ("pruned 30% (L1, global)", lambda: pruned(0.3), False),
                ("pruned 50% (L1, global)", lambda: pruned(0.5), False),
                ("pruned 50% + 1 epoch fine-tune", lambda: pruned(0.5, finetune=1), False),
                ("channels removed, 50% of parameters", lambda: pruned(0.5, structured=True), False),
                ("channels removed, 50% + 1 epoch fine-tune", lambda: pruned(0.5, True, finetune=1), False)]
    if not compat.quantization_unavailable():
        calib = list(quantize.calibration_batches(loader, 8))
        variants += [("int8 dynamic (Linear)", lambda: quantize.quantize_dynamic(src.model), True),
                     ("int8 static (FX, calibrated)", lambda: quantize.quantize_static(src.model, calib, example),
                      True)]

    rows = []
    for name, make, is_int8 in variants:
        print(f"measuring {name} ...", flush=True)
        model = make()
        g, _ = prune.sparsity(model) if not is_int8 else (None, None)
        raw, zipped = common.saved_sizes(compat.jit_trace(model, example))
        top1 = common.top1(model, loader, "cpu" if is_int8 else device, src.class_names)
        model = model.cpu() if not is_int8 else model
        lat = common.cpu_latencies([model], size)[0]
        gpu_ms = None if is_int8 else gpu_latency_ms(model, size)
        rows.append({"variant": name, "params": None if is_int8 else common.count_params(model),
                     "sparsity_pct": None if g is None else round(100 * g, 1),
                     "size_mib": raw / 2**20, "zipped_mib": zipped / 2**20, "cpu_ms_1img": lat.median,
                     "cpu_p10": lat.p10, "cpu_p90": lat.p90,
                     "gpu_ms_b64": gpu_ms, "top1": top1})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compress.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines = [f"{src.run_file.get('model_name')} from {weights}, validated on {root} ({size}px). "
             f"PyTorch {torch.__version__}, CPU: {platform.processor() or platform.machine()} at "
             f"{torch.get_num_threads()} threads, GPU: {gpu}, int8 engine {compat.quant_backend()}.", "",
             "| variant | parameters | sparsity | TorchScript size | zipped | CPU latency, 1 image (p10-p90) "
             "| GPU latency, batch 64 | top-1 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        sp = "-" if r["sparsity_pct"] is None else f"{r['sparsity_pct']:.1f}%"
        gpu_ms = "-" if r["gpu_ms_b64"] is None else f"{r['gpu_ms_b64']:.2f} ms"
        params = "-" if r["params"] is None else f"{r['params'] / 1e6:.2f} M"
        cpu = f"{r['cpu_ms_1img']:.2f} ms ({r['cpu_p10']:.2f}-{r['cpu_p90']:.2f})"
        lines.append(f"| {r['variant']} | {params} | {sp} | {r['size_mib']:.2f} MiB | {r['zipped_mib']:.2f} MiB | "
                     f"{cpu} | {gpu_ms} | {r['top1']:.2f}% |")
    text = "\n".join(lines)
    (out / "compress.md").write_text(text + "\n")
    print("\n" + text)
    print(f"\nwritten: {out / 'compress.md'}, {out / 'compress.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
