"""Validate a checkpoint: `python val.py --weights best_model.pth` (the newest run's; or a path).

A starting point you can edit: the work is done by `dlenv val` (see `python val.py --help`); it
prints loss, top-1, top-5 and a per-class report and writes them, the confusion matrix and the
misclassified images into the checkpoint's run folder (runs/exp/val/; runs/exp/val-<data>/ for a
report on other data; a linked checkpoint's target folder), wherever this script is run from.
--out FOLDER writes them elsewhere.
"""

import sys

from dlenv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["val", *sys.argv[1:]]))
