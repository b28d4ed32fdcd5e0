"""What running an ONNX file in a child process with limits costs `dlenv predict` (docs/predict.md quotes it).

    python scripts/bench_onnx_child.py [--images 256] [--repeats 5] [--models small_cnn:32,resnet18:112]

For each model: writes a dlenv checkpoint (untrained weights, 10 classes), exports it with `dlenv export --format
onnx`, writes N JPEGs, then runs `dlenv predict` on them in a fresh process per run, alternately

- child:      as dlenv runs it (dlenv.files.onnxchild: a child process under RLIMIT_AS, RLIMIT_CPU, wall clock);
- in-process: the session built in predict's own process, as before (onnxmodel.session, patched in for the run),

and prints a markdown table of the medians: predict's own img/s (the pass, decoding included) and the whole
command's seconds (start, PyTorch's import, opening the model, the pass, the CSV). Run it with each venv's
python to compare the stacks.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))


def _one_run(mode: str, argv: list[str]) -> int:
    """Inside the measured process: `dlenv predict argv`, with the in-process session patched in for `inproc`."""
    from dlenv.cli import main as cli_main

    if mode == "inproc":
        from dlenv.files import onnxchild, onnxmodel

        onnxchild.Child = lambda data, name, cuda=False, limits=None: onnxmodel.session(data)  # today's path
    return cli_main(argv)


def _prepare(work: Path, model_name: str, size: int, images: int) -> Path:
    import numpy as np
    from PIL import Image

    from dlenv.cli import main as cli_main
    from dlenv.files.runstate import FORMAT, environment, save_state
    from dlenv.model.models import build_model
    from dlenv.options import config

    classes = [f"c{i}" for i in range(10)]
    folder = work / model_name
    folder.mkdir()
    model = build_model(model_name, len(classes)).eval()
    cfg = config.to_dict(config.build(config.TrainConfig, img_size=size, model=model_name))
    save_state({"format": FORMAT, "model": model.state_dict(), "model_name": model_name,
                "num_classes": len(classes), "class_names": classes, "img_size": size, "config": cfg,
                "epoch": 1, "step": 1, "batch_in_epoch": 0, "best_metric": 0.0,
                "optimizer": {"state": {}, "param_groups": []}, "scaler": None, "scheduler": None, "ema": None,
                "rng": None, "env": environment()}, folder / "best_model.pth")
    if cli_main(["export", "--weights", str(folder / "best_model.pth"), "--format", "onnx", "--workers", "0"]):
        raise SystemExit("export failed")
    rng = np.random.default_rng(0)
    (work / "images").mkdir(exist_ok=True)
    for i in range(images):
        target = work / "images" / f"{i:05d}.jpg"
        if not target.exists():
            Image.fromarray(rng.integers(0, 255, size=(300, 400, 3), dtype=np.uint8)).save(target, quality=90)
    return folder / "best_model.onnx"


def _measure(mode: str, onnx_file: Path, work: Path, batch: str) -> tuple[float, float]:
    """(predict's img/s, the command's seconds) of one run in a fresh process."""
    argv = ["predict", "--weights", str(onnx_file), "--source", str(work / "images"), "--device", "cpu",
            "--batch-size", batch, "--project", str(work / "runs"), "--exist-ok", "--workers", "0"]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--run", mode, *argv], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    seconds = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{mode}: {out.stderr.strip()[-500:]}")
    rate = re.search(r"([0-9.]+) img/s", out.stdout + out.stderr)
    return float(rate.group(1)) if rate else float("nan"), seconds


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        return _one_run(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", default="32")
    ap.add_argument("--models", default="small_cnn:32,resnet18:112", help="MODEL:SIZE,...")
    args = ap.parse_args()
    import onnxruntime
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-onnx-child-") as tmp:
        work = Path(tmp)
        for spec in args.models.split(","):
            name, size = spec.split(":")
            onnx_file = _prepare(work, name, int(size), args.images)
            got: dict[str, list[tuple[float, float]]] = {"inproc": [], "child": []}
            for _ in range(args.repeats):
                for mode in got:  # alternately, so that a drift of the machine falls on both
                    got[mode].append(_measure(mode, onnx_file, work, args.batch_size))
            med = {m: (statistics.median(r for r, _ in v), statistics.median(s for _, s in v)) for m, v in got.items()}
            rows.append(f"| {name} {size}px | {med['inproc'][0]:.1f} | {med['child'][0]:.1f} | "
                        f"{(med['child'][0] / med['inproc'][0] - 1) * 100:+.1f}% | {med['inproc'][1]:.2f} | "
                        f"{med['child'][1]:.2f} | {(med['child'][1] / med['inproc'][1] - 1) * 100:+.1f}% |")
    print(f"PyTorch {torch.__version__}, onnxruntime {onnxruntime.__version__}, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; {args.images} JPEGs 400x300, batch {args.batch_size}, median of {args.repeats} "
          "runs each, alternating\n")
    print("| model | in-process img/s | child img/s | img/s change | in-process command s | child command s | "
          "command change |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
