"""Train a classifier: `python train.py --amp --checkpoint` (the one dataset under data/, else the demo).

A starting point you can edit: the work is done by `dlenv train` (see `python train.py --help` for
every option: --data (to choose among several datasets under data/), --model, --epochs, --batch-size,
--accum-steps, --resume, ...). Runs go to runs/exp, runs/exp2, ...; `python train.py --resume auto`
continues the newest one.
"""

import sys

from dlenv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
