"""Pruning, int8 quantization and export of a trained run file, each re-validated.

`dlenv prune` and `dlenv export` take a dlenv run file (best_model.pth, last.pth), change or
convert the model, and measure what the change cost and bought on the same data: top-1, file size
(raw and zipped), CPU latency, and for exports the largest difference from PyTorch's own outputs.

    common.py    the run file and data a command works on; sizes, latency, top-1, tables
    prune.py     global L1 / channel pruning made permanent, optional fine-tune (`prune_main`)
    quantize.py  dynamic and static int8 for CPU inference
    export.py    ONNX / TorchScript files and their output check (`export_main`)

The entry points import torch only when a command runs.
"""

from __future__ import annotations

from typing import Any


def prune_main(cfg: Any) -> int:
    """`dlenv prune` (see dlenv.compress.prune.main)."""
    from dlenv.compress.prune import main

    return main(cfg)


def export_main(cfg: Any) -> int:
    """`dlenv export` (see dlenv.compress.export.main)."""
    from dlenv.compress.export import main

    return main(cfg)
