"""Validate a checkpoint: `python val.py --weights best_model.pth --data ./dataset/val`.

A starting point you can edit: the work is done by `dlenv val` (see `python val.py --help`); it
prints loss, top-1, top-5 and a per-class report and writes them, the confusion matrix and the
misclassified images into <weights dir>/val/.
"""

import sys

from dlenv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["val", *sys.argv[1:]]))
