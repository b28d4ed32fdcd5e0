"""A dlenv run file of an untrained torchvision model, calibrated and in the format `dlenv train` writes, for the
compress tests (tests/compress/: prune, quantize, export, int8 ONNX). Two classes at 32 px."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlenv import compat
from dlenv.files.runstate import FORMAT, save_state
from dlenv.options import config

CLASSES = ["cat", "dog"]
IMG = 32
NO_ONNX = compat.onnx_export_unavailable()


def calibrated(model: nn.Module) -> nn.Module:
    """Give BatchNorm realistic running statistics (a fresh model's are 0/1), then eval mode."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, IMG, IMG))
    return model.eval()


def save_ckpt(path: Path, data: Path | str | None, model_name: str = "mobilenet_v3_small", **override) -> Path:
    """A dlenv checkpoint of an untrained torchvision model, in the format `dlenv train` writes."""
    from dlenv.files.runstate import environment
    from dlenv.model.models import build_model

    torch.manual_seed(0)
    model = calibrated(build_model(model_name, len(CLASSES)))
    train_cfg = config.to_dict(config.build(config.TrainConfig, data=str(data) if data else None,
                                            img_size=IMG, model=model_name, val_split=0.25))
    state = {"format": FORMAT, "model": model.state_dict(), "model_name": model_name,
             "num_classes": len(CLASSES), "class_names": list(CLASSES), "img_size": IMG, "config": train_cfg,
             "epoch": 1, "step": 3, "batch_in_epoch": 0, "best_metric": 50.0,
             "optimizer": {"state": {}, "param_groups": []}, "scaler": None, "scheduler": None, "ema": None,
             "rng": None, "env": environment()}
    state.update(override)
    return save_state(state, path)
