"""dlenv: a GPU training environment for image classifiers.

The package imports nothing heavy at the top: `dlenv --help` and `invoke --list` must stay fast and
must not import torch. The public classes for use in your own code load on first access:

    from dlenv import Precision, apply_checkpointing, MemoryMonitor
"""

from __future__ import annotations

__version__ = "0.1.0"

# name -> module that defines it; resolved lazily by __getattr__ below.
_LAZY = {
    "Precision": "dlenv.engine.precision",
    "apply_checkpointing": "dlenv.model.checkpointing",
    "build_model": "dlenv.model.models",
    "MemoryMonitor": "dlenv.engine.memory",
    "train": "dlenv.train",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlenv' has no attribute {name!r}")
