"""Measure `dlenv predict`'s img/s for ResNet-50 (untrained weights, 10 classes, 224 px) on N JPEGs.

    python scripts/bench_predict.py --device cuda --images 2048 [--amp]

Writes a dlenv checkpoint and the images into a temporary folder, runs `dlenv predict` on them twice
(the first pass warms the caches and cuDNN) and prints the second pass's last lines: the img/s there
includes JPEG decoding in the DataLoader workers, as a user's run does. docs/predict.md quotes it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    import numpy as np
    import torch
    from PIL import Image

    from dlenv.cli import main as cli_main
    from dlenv.files.runstate import FORMAT, environment, save_state
    from dlenv.model.models import build_model
    from dlenv.options import config

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--batch-size", default="64")
    ap.add_argument("--amp", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    classes = [f"c{i}" for i in range(10)]
    model = build_model("resnet50", len(classes)).eval()
    cfg = config.to_dict(config.build(config.TrainConfig, img_size=224, model="resnet50", amp=args.amp))
    save_state({"format": FORMAT, "model": model.state_dict(), "model_name": "resnet50",
                     "num_classes": len(classes), "class_names": classes, "img_size": 224, "config": cfg,
                     "epoch": 1, "step": 1, "batch_in_epoch": 0, "best_metric": 0.0,
                     "optimizer": {"state": {}, "param_groups": []}, "scaler": None, "scheduler": None, "ema": None,
                     "rng": None, "env": environment()}, tmp / "best_model.pth")
    rng = np.random.default_rng(0)
    (tmp / "images").mkdir()
    for i in range(args.images):
        arr = rng.integers(0, 255, size=(300, 400, 3), dtype=np.uint8)
        Image.fromarray(arr).save(tmp / "images" / f"{i:05d}.jpg", quality=90)
    argv = ["predict", "--weights", str(tmp / "best_model.pth"), "--source", str(tmp / "images"),
            "--device", args.device, "--batch-size", args.batch_size, "--project", str(tmp / "runs")]
    print(f"PyTorch {torch.__version__}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, "
          f"{torch.get_num_threads()} threads; {args.images} JPEGs 400x300, batch {args.batch_size}")
    for _ in range(2):
        code = cli_main(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
