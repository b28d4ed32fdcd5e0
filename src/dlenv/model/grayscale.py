"""`--channels 1`: a model whose first layer takes one channel (MNIST's `Net`) trains on dlenv's images.

Every input path of dlenv (the CPU decoders, --cache, the GPU decoders and GPU augmentation, val, predict)
delivers 3-channel RGB batches normalised with ImageNet's mean and std. `grayscale_input` puts one
forward pre-hook on such a model that turns each batch into its luma (ITU-R BT.601: 0.299 R + 0.587 G +
0.114 B of the pixel values) normalised with one mean and std (the same weights of ImageNet's), so the
model gets [N, 1, H, W] while every path stays as it is. The hook holds no state: the weights file is the
model's own, and val, predict, prune and export put the same hook back from the run's config.yaml
(`channels`), so an ONNX or TorchScript export takes RGB like every other dlenv model.

In pixel terms, x_c = (p_c - mean_c) / std_c and the luma p = sum w_c p_c normalised by mean = sum w_c
mean_c, std = sum w_c std_c is sum (w_c std_c / std) x_c: a fixed weighted sum of the normalised channels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dlenv.model.pretrained import IMAGENET_STD

#: ITU-R BT.601 luma weights of R, G and B
LUMA = (0.299, 0.587, 0.114)


def luma_weights(std: tuple[float, float, float] = IMAGENET_STD) -> tuple[float, ...]:
    """The weights of the normalised R, G, B channels whose sum is the normalised luma (see the module doc)."""
    total = sum(w * s for w, s in zip(LUMA, std, strict=True))
    return tuple(w * s / total for w, s in zip(LUMA, std, strict=True))


def to_gray(x: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] normalised RGB -> [N, 1, H, W] normalised luma; any other shape as it is."""
    if x.dim() != 4 or (not torch.jit.is_tracing() and x.shape[1] != 3):  # an export traces RGB batches
        return x
    r, g, b = luma_weights()  # Python numbers: an export records them as the graph's constants, silently
    return x[:, 0:1] * r + x[:, 1:2] * g + x[:, 2:3] * b


def _hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (to_gray(args[0]), *args[1:]) if args and torch.is_tensor(args[0]) else args


def grayscale_input(model: nn.Module) -> nn.Module:
    """`model` with its input turned from 3-channel RGB into 1-channel luma before its forward (once)."""
    if not getattr(model, "_dlenv_grayscale", False):
        model.register_forward_pre_hook(_hook)
        model._dlenv_grayscale = True
    return model


def apply(model: nn.Module, channels: Any) -> nn.Module:
    """The model for --channels `channels` (1: `grayscale_input`; 3 or None: as it is)."""
    return grayscale_input(model) if channels == 1 else model
