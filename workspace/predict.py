"""Predict unlabelled images: `python predict.py --weights runs/exp/best_model.pth --source photos/`.

A starting point you can edit: the work is done by `dlenv predict` (see `python predict.py --help`); it
takes an image, a folder, a glob, a video or `-` (paths on stdin) and writes each image's top-k
classes and probabilities to runs/predict/<name>/predictions.csv (`--json` prints them as JSON lines).
"""

import sys

from dlenv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["predict", *sys.argv[1:]]))
