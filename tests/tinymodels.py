"""Tiny models that stand in for torchvision's in tests, so a run of the real trainer takes a blink
(importable as `tinymodels` from any test module, and from the scripts tests run with tests/ on
sys.path). tests/conftest.py's `tiny` and `wide` fixtures patch dlenv.model.models.build_model with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from imagedata import train_config
from torch import nn


class Tiny(nn.Module):
    """conv, BatchNorm, dropout, linear; `norm=False, dropout=0.0` leaves a model whose result depends only
    on the data order and the gradients (accumulation and DDP equivalence)."""

    def __init__(self, num_classes: int, norm: bool = True, dropout: float = 0.2):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6) if norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(6, num_classes)
        self.poison = False  # set to make every output NaN

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        out = self.fc(self.drop(x))
        return out * float("nan") if self.poison else out


class Wide(nn.Module):
    """Small enough to train in a blink, wide enough that its weights outweigh a checkpoint's other entries."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.fc = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def build_tiny(name: str, num_classes: int, weights: Any = None, **kw: Any) -> Tiny:
    """dlenv.model.models.build_model's stand-in: "tiny-nonorm" is Tiny without BatchNorm and dropout, any
    other name the plain Tiny."""
    return Tiny(num_classes, norm=False, dropout=0.0) if name == "tiny-nonorm" else Tiny(num_classes)


def build_wide(name: str, num_classes: int, weights: Any = None, **kw: Any) -> Wide:
    """dlenv.model.models.build_model's stand-in that builds Wide."""
    return Wide(num_classes)


def tiny_config(tmp_path: Path, ds: Path, **kw: Any):
    """A TrainConfig of the tiny model with SGD (imagedata.train_config's CPU defaults) on `ds`."""
    return train_config(tmp_path, ds, **{"model": "tiny", "optimizer": "sgd", **kw})
