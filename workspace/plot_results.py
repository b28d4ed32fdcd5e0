"""Plot training runs: `python plot_results.py --log-dir ./runs`.

A starting point you can edit: the work is done by `dlenv plot` (see `python plot_results.py --help`);
it writes results.png into every run folder with a results.csv, and compare.png when there are several.
"""

import sys

from dlenv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["plot", *sys.argv[1:]]))
