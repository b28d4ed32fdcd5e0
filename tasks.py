"""invoke tasks for dlenv: `invoke --list`, `invoke train --amp --checkpoint`, ...

Thin on purpose: the tasks are generated from the options declared in dlenv/options/config.py and each is
one call into the dlenv package.
"""

import sys
from pathlib import Path

# Run from a source checkout without installing: prefer ./src over an installed dlenv.
_src = Path(__file__).resolve().parent / "src"
if _src.is_dir():
    sys.path.insert(0, str(_src))

from dlenv.tasks import ns  # noqa: E402

__all__ = ["ns"]
