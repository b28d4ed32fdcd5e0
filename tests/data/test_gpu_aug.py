"""dlenv.data.gpu_aug on CPU tensors: crop boxes, the crop itself, flips, normalization, seeding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from dlenv.data.decode import to_square
from dlenv.data.gpu_aug import GpuAugment, boxes_to_theta, center_boxes, random_boxes
from dlenv.data.loaders import IMAGENET_MEAN, IMAGENET_STD


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """Undo the normalization: back to 0-255 values."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x.float() * std + mean) * 255


def _smooth(w: int, h: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    arr = np.stack([255 * x / w, 255 * y / h, 128 + 100 * np.sin(x / 9) * np.cos(y / 7)], -1)
    return arr.clip(0, 255).astype(np.uint8)


def test_output_shape_dtype_format_and_normalization():
    images = torch.full((3, 40, 40, 3), 124, dtype=torch.uint8)
    sizes = torch.tensor([[80, 60], [60, 80], [40, 40]], dtype=torch.int32)
    for train in (True, False):
        aug = GpuAugment(24, train, torch.bfloat16, torch.channels_last)
        out = aug(images, sizes, seed=3)
        assert out.shape == (3, 3, 24, 24) and out.dtype == torch.bfloat16
        assert out.is_contiguous(memory_format=torch.channels_last)
        want = (124 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
        assert torch.allclose(out.float()[:, :, 5, 5], want.expand(3, 3), atol=0.02)
    f32 = GpuAugment(24, True)(images, sizes, seed=3)
    assert f32.dtype == torch.float32 and f32.is_contiguous()


def test_seeded_crops_repeat_and_differ_by_seed():
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 255, (4, 32, 32, 3), dtype=np.uint8))
    sizes = torch.tensor([[64, 48]] * 4, dtype=torch.int32)
    aug = GpuAugment(16, True)
    assert torch.equal(aug(images, sizes, seed=7), aug(images, sizes, seed=7))
    assert not torch.equal(aug(images, sizes, seed=7), aug(images, sizes, seed=8))
    ev = GpuAugment(16, False)
    assert torch.equal(ev(images, sizes, seed=1), ev(images, sizes, seed=2))  # eval is not random


def test_crop_matches_cropping_the_original_image():
    """A box on the stored (squashed) square cuts the same region as on the original picture."""
    w, h = 96, 64
    original = _smooth(w, h)
    stored = torch.from_numpy(to_square(original, 80))[None]
    for box in ([0.1, 0.2, 0.5, 0.6, 0.0], [0.4, 0.0, 0.6, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]):
        theta = boxes_to_theta(torch.tensor([box], dtype=torch.float64)).float()
        got = _pixels(GpuAugment(32, True).apply(stored, theta))[0].permute(1, 2, 0).numpy()
        x0, y0, bw, bh = box[0] * w, box[1] * h, box[2] * w, box[3] * h
        ref = np.asarray(Image.fromarray(original).resize((32, 32), Image.BILINEAR,
                                                          box=(x0, y0, x0 + bw, y0 + bh)), np.float32)
        assert np.abs(got - ref).mean() < 4, box


def test_flip_mirrors_the_crop():
    original = _smooth(48, 48)
    stored = torch.from_numpy(original)[None]
    box = torch.tensor([[0.1, 0.2, 0.5, 0.6, 0.0]], dtype=torch.float64)
    flipped = box.clone()
    flipped[0, 4] = 1.0
    aug = GpuAugment(20, True)
    a = aug.apply(stored, boxes_to_theta(box).float())
    b = aug.apply(stored, boxes_to_theta(flipped).float())
    assert torch.allclose(a.flip(-1), b, atol=1e-4)
    assert not torch.allclose(a, b, atol=1e-2)


def test_random_box_statistics():
    n = 4000
    sizes = torch.tensor([[500, 375]] * n)
    boxes = random_boxes(sizes, np.random.default_rng(0))
    x0, y0, bw, bh, flip = boxes.unbind(1)
    assert ((x0 >= 0) & (y0 >= 0) & (x0 + bw <= 1 + 1e-9) & (y0 + bh <= 1 + 1e-9)).all()
    area = bw * bh
    assert area.min() >= 0.08 - 1e-9 and area.max() <= 1 + 1e-9
    ratio = (bw * 500) / (bh * 375)
    assert ratio.min() >= 3 / 4 - 1e-9 and ratio.max() <= 4 / 3 + 1e-9
    assert abs(flip.mean().item() - 0.5) < 0.03
    assert abs((x0 + bw / 2).mean().item() - 0.5) < 0.01  # positions uniform: centred on average
    assert 0.4 < area.mean().item() < 0.6  # ~0.54 for uniform area in [0.08, 1]
    # a log-uniform aspect ratio: on a square image as many crops wider than tall as taller than wide
    # (on 4:3 ones wide crops fit more often, as in torchvision)
    sq = random_boxes(torch.tensor([[400, 400]] * n), np.random.default_rng(1))
    assert abs((sq[:, 2] > sq[:, 3]).double().mean().item() - 0.5) < 0.03
    assert (ratio > 1).double().mean().item() > 0.5


def test_extreme_aspect_falls_back_to_a_centred_crop():
    sizes = torch.tensor([[1000, 10], [10, 1000]])
    boxes = random_boxes(sizes, np.random.default_rng(0), flip_p=0.0)
    x0, y0, bw, bh, _ = boxes.unbind(1)
    assert torch.allclose(x0 + bw / 2, torch.full((2,), 0.5, dtype=torch.float64))
    assert ((x0 >= 0) & (x0 + bw <= 1 + 1e-9) & (y0 + bh <= 1 + 1e-9)).all()
    assert math.isclose(bw[0].item() * 1000 / (bh[0].item() * 10), 4 / 3, rel_tol=1e-6)


def test_center_boxes_are_torchvisions_eval_crop():
    b = center_boxes(torch.tensor([[500, 375]]))[0]
    side = 375 * 224 / 256  # Resize(256) + CenterCrop(224), in original pixels
    assert b[2].item() == pytest.approx(side / 500) and b[3].item() == pytest.approx(side / 375)
    assert b[0].item() == pytest.approx((1 - side / 500) / 2) and b[4].item() == 0
