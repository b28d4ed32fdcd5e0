"""Transfer: weights trained on the demo data fine-tune on another dataset (scikit-learn's digits) to a
higher accuracy than the same model trained from scratch for the same epochs.

    python scripts/transfer_digits.py [--out runs/transfer] [--epochs 2] [--per-class 15] [--pre-epochs 6]
                                      [--val-per-class 60] [--demo-per-class 100] [--model small_cnn] [--seeds 3]

1. the demo data (generated, no download) trains `--model` for --pre-epochs: the source weights;
2. scikit-learn's digits (shipped with it: sklearn.datasets.load_digits, 8x8 greyscale) become PNGs at
   32 px, --per-class training and --val-per-class validation images per digit;
3. two runs on the digits, the same options and epochs: from the demo weights (--weights, whose head of
   another class count starts fresh) and from scratch, each with --seeds seeds (0, 1, ...: the head's
   initialisation, the order and the crops); prints the mean top-1 of each, every seed's, and a markdown
   row (docs/training.md, "Fine-tuning", holds the measured one).

Why several seeds: two epochs of 15 digits per class are 10 optimizer steps, and from scratch one seed's
top-1 differs from the next by up to 40 points (BatchNorm's running statistics have not settled and a
random network has found little yet); the demo weights start every seed from the same features and
swing far less. One seed's pair can land either way by a point; the mean over seeds, run for run on the
same seeds, is the comparison that repeats.

The runs are dlenv's own (`dlenv.train.train`) on the CPU, deterministic, 0 workers; nothing is
downloaded. tests/model/test_pretrained_transfer.py runs a smaller version and asserts the direction.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def digits_folder(root: Path, per_class: int, val_per_class: int = 60, size: int = 32, seed: int = 0) -> Path:
    """root/train and root/val of PNGs, one folder per digit: `per_class` training and `val_per_class`
    validation images per digit, drawn at random (`seed`) from the 1,797."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    taken: dict[int, int] = {}
    for i in rng.permutation(len(digits.target)):
        label = int(digits.target[i])
        n = taken.get(label, 0)
        if n >= per_class + val_per_class:
            continue
        split = "train" if n < per_class else "val"
        taken[label] = n + 1
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        grey = (digits.images[i] * (255 / 16)).astype(np.uint8)
        img = Image.fromarray(grey).resize((size, size), Image.BILINEAR).convert("RGB")  # 2-D uint8: greyscale
        img.save(folder / f"{i:04d}.png")
    return root


def _train(out: Path, name: str, data: Path, epochs: int, model: str, weights: str | None = None,
           **extra) -> float:
    from dlenv import train as train_mod
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    # the demo's CPU recipe (dlenv.data.demo.CPU_RECIPE: lr 3e-3, half an epoch of warmup) for every run
    cfg = config.build(TrainConfig, data=str(data), project=str(out), name=name, exist_ok=True, model=model,
                       img_size=32, batch_size=32, workers=0, epochs=epochs, device="cpu", deterministic=True,
                       optimizer="adamw", lr=3e-3, warmup_epochs=0.5, weights=weights, **extra)
    summary = train_mod.train(cfg)
    return float(summary["best_metric"])


def run(out: Path, epochs: int, per_class: int, pre_epochs: int, model: str = "small_cnn",
        demo_per_class: int = 100, val_per_class: int = 60, reuse: bool = False, seeds: int = 3) -> dict:
    """Both numbers of the transfer experiment (see the module doc), as a dict: the mean top-1 over `seeds`
    seeds from the demo weights and from scratch, and each seed's. `reuse`: start from the demo weights an
    earlier call left in `out` (the same --pre-epochs and --demo-per-class)."""
    from dlenv.data.demo import ensure_demo_data
    from dlenv.runfolder import results

    out.mkdir(parents=True, exist_ok=True)
    data = out / "demo-data"
    demo = ensure_demo_data(data, train_per_class=demo_per_class, val_per_class=20, size=32)
    t0 = time.perf_counter()
    weights = out / "demo" / "best_model.pth"
    if reuse and weights.is_file():
        source = float(results.read_results(out / "demo" / "results.csv")["top1"].max())
    else:
        source = _train(out, "demo", Path(demo), pre_epochs, model)
    digits = digits_folder(out / "digits", per_class, val_per_class)
    tuned, scratch = [], []
    for seed in range(seeds):
        # digits: light crops, no flips (a mirrored digit is no digit)
        tuned.append(_train(out, f"from-demo-{seed}", digits, epochs, model, weights=str(weights), augment="light",
                            hflip=False, seed=seed))
        scratch.append(_train(out, f"scratch-{seed}", digits, epochs, model, augment="light", hflip=False,
                              seed=seed))
    return {"model": model, "demo_top1": source, "epochs": epochs, "per_class": per_class,
            "val_per_class": val_per_class, "pre_epochs": pre_epochs, "seeds": seeds,
            "from_demo_top1": sum(tuned) / seeds, "from_scratch_top1": sum(scratch) / seeds,
            "from_demo_each": tuned, "from_scratch_each": scratch, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/transfer")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--epochs", type=int, default=2, help="epochs on the digits, for both runs")
    p.add_argument("--per-class", type=int, default=15, help="training images per digit")
    p.add_argument("--val-per-class", type=int, default=60, help="validation images per digit")
    p.add_argument("--pre-epochs", type=int, default=6, help="epochs on the demo data")
    p.add_argument("--demo-per-class", type=int, default=100, help="demo training images per class")
    p.add_argument("--reuse", action="store_true", help="start from the demo weights of an earlier call")
    p.add_argument("--seeds", type=int, default=3, help="runs of each kind, seeds 0..N-1; the mean is reported")
    args = p.parse_args(argv)
    r = run(Path(args.out), args.epochs, args.per_class, args.pre_epochs, args.model, args.demo_per_class,
            args.val_per_class, args.reuse, args.seeds)
    print(json.dumps(r))
    each = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    print(f"| {r['model']} | {r['per_class']} per digit, {r['epochs']} epochs, mean of {r['seeds']} seeds | "
          f"{r['from_demo_top1']:.1f}% ({each(r['from_demo_each'])}) | "
          f"{r['from_scratch_top1']:.1f}% ({each(r['from_scratch_each'])}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
