"""Random-resized-crop, flip and normalization of whole uint8 batches on the GPU (or CPU, same code).

Input is the stored form of `decode`: a batch of size x size uint8 RGB squares (each the whole frame
squashed), and each image's decoded width and height. Crop boxes are drawn the way torchvision's
RandomResizedCrop draws them (area fraction in `scale`, log-uniform aspect ratio in `ratio`, ten tries
then a centre crop), in the image's own proportions, and expressed as fractions of the frame. Since
the square holds the whole frame, the same fractions address it, and one `affine_grid` +
`grid_sample` cuts, resizes and mirrors the whole batch in a single kernel. Evaluation takes the
region torchvision's Resize(img_size * 256/224) + CenterCrop(img_size) would.

Boxes are drawn on the CPU (in NumPy) from a generator seeded per batch, so a given (seed, batch) gives the
same crops on any device and after a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dlenv.model.pretrained import IMAGENET_MEAN, IMAGENET_STD, INTERPOLATIONS

#: eval crops this fraction of the shorter side (torchvision: Resize(256) then CenterCrop(224))
EVAL_CROP = 224 / 256


@dataclass(frozen=True)
class Crops:
    """The training crops: RandomResizedCrop's area range `scale` and aspect range `ratio` (an --augment
    preset's), and whether half the images are mirrored."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True


def random_boxes(sizes: Any, generator: np.random.Generator, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                 tries: int = 10) -> torch.Tensor:
    """RandomResizedCrop boxes for images of `sizes` ((B, 2) width, height: an array or CPU tensor), vectorised.

    Returns (B, 5) float64: x0, y0, w, h as fractions of the frame, and 1.0 where mirrored. Drawn in NumPy:
    its small-array operations keep the interpreter's lock, where each torch operation would give it up and
    wait to take it back from the training loop's thread, about forty times a batch.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    b = sizes.shape[0]
    w_img, h_img = sizes[:, :1], sizes[:, 1:]
    area = w_img * h_img
    u = generator.random((b, tries, 4))
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    r = np.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[..., 1])
    w, h = np.sqrt(target * r), np.sqrt(target / r)
    ok = (w <= w_img) & (h <= h_img) & (w > 0) & (h > 0)
    first = np.where(ok.any(1), ok.argmax(1), -1)
    rows, pick = np.arange(b), first.clip(min=0)
    w, h = w[rows, pick], h[rows, pick]
    x0 = (w_img[:, 0] - w) * u[rows, pick, 2]
    y0 = (h_img[:, 0] - h) * u[rows, pick, 3]
    # no try fitted (extreme aspect ratios): the largest centred crop with the ratio clamped into range
    fb = first < 0
    if fb.any():
        wi, hi = w_img[fb, 0], h_img[fb, 0]
        in_ratio = wi / hi
        fw = np.where(in_ratio > ratio[1], hi * ratio[1], wi)
        fh = np.where(in_ratio < ratio[0], wi / ratio[0], hi)
        w[fb], h[fb] = fw, fh
        x0[fb], y0[fb] = (wi - fw) / 2, (hi - fh) / 2
    flip = (generator.random(b) < flip_p).astype(np.float64)
    return torch.from_numpy(np.stack([x0 / w_img[:, 0], y0 / h_img[:, 0], w / w_img[:, 0], h / h_img[:, 0], flip], 1))


def center_boxes(sizes: torch.Tensor, crop: float = EVAL_CROP) -> torch.Tensor:
    """Eval boxes: a centred square of `crop` x the shorter side. (B, 5) like `random_boxes`."""
    sizes = sizes.to(torch.float64)
    side = sizes.min(1).values * crop
    fw, fh = side / sizes[:, 0], side / sizes[:, 1]
    zero = torch.zeros_like(fw)
    return torch.stack([(1 - fw) / 2, (1 - fh) / 2, fw, fh, zero], 1)


def boxes_to_theta(boxes: torch.Tensor) -> torch.Tensor:
    """(B, 5) boxes (CPU) -> (B, 2, 3) float64 affine_grid matrices (align_corners=False), mirroring folded in;
    computed in NumPy, as `random_boxes` draws them."""
    x0, y0, w, h, flip = np.asarray(boxes, dtype=np.float64).T
    theta = np.zeros((len(x0), 2, 3))
    theta[:, 0, 0] = w * (1 - 2 * flip)
    theta[:, 0, 2] = 2 * x0 + w - 1  # the box centre, in [-1, 1] coordinates
    theta[:, 1, 1] = h
    theta[:, 1, 2] = 2 * y0 + h - 1
    return torch.from_numpy(theta)


class GpuAugment:
    """Stored-form uint8 batches -> normalized float batches, on the batch's own device.

    train=True: RandomResizedCrop(img_size, scale, ratio) + horizontal flip as `crops` says, drawn by
    `random_boxes` from `seed`; train=False: the eval centre crop.
    Both sample with `interpolation` ('bilinear', 'bicubic' or 'nearest': grid_sample's modes; pretrained
    weights' own), bicubic clamped to the pixel range as torchvision's resize clamps it. Output:
    (B, 3, img_size, img_size) in `dtype` (float32, or bf16/fp16 under AMP), `memory_format` (channels_last
    for CNNs), normalized by `norm` (mean, std): pretrained weights' own, else ImageNet's.
    """

    def __init__(self, img_size: int, train: bool, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format,
                 crops: Crops = Crops(), norm: tuple[tuple, tuple] | None = None, interpolation: str = "bilinear"):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation {interpolation!r} is not one of: {', '.join(INTERPOLATIONS)}")
        self.img_size, self.train, self.interpolation = img_size, train, interpolation
        self.mean, self.std = norm or (IMAGENET_MEAN, IMAGENET_STD)
        self.dtype, self.memory_format = dtype, memory_format
        self.scale, self.ratio, self.flip_p = crops.scale, crops.ratio, 0.5 if crops.hflip else 0.0
        self._stats: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def boxes(self, sizes: torch.Tensor, seed: int) -> torch.Tensor:
        """The (B, 5) crop boxes for a batch with this seed (CPU, float64)."""
        if not self.train:
            return center_boxes(sizes.cpu())
        return random_boxes(sizes.cpu(), np.random.default_rng(int(seed) % 2**63), self.scale, self.ratio, self.flip_p)

    def _normalize_stats(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift) with x * scale + shift = (x / 255 - mean) / std, per channel, on `device` in `dtype`."""
        if (device, dtype) not in self._stats:
            std = torch.tensor(self.std, dtype=torch.float64).view(1, 3, 1, 1) * 255.0
            mean = torch.tensor(self.mean, dtype=torch.float64).view(1, 3, 1, 1) * 255.0
            self._stats[device, dtype] = ((1.0 / std).to(device, dtype), (-mean / std).to(device, dtype))
        return self._stats[device, dtype]

    def sampling_dtype(self, device: torch.device) -> torch.dtype:
        """float16 where a GPU batch goes to a half-precision model (AMP): the uint8 pixels are exact in it and
        every pass over the batch moves half the bytes of float32, which cost the training step 2.5% of its
        GPU time on an H100 (docs/input-pipeline.md, "Decoded once into GPU memory"); float32 elsewhere."""
        half = device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        return torch.float16 if half else torch.float32

    def __call__(self, images: torch.Tensor, sizes: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Augment (B, S, S, 3) uint8 images (any device) with (B, 2) width, height `sizes`."""
        return self.apply(images, boxes_to_theta(self.boxes(sizes, seed)))

    def apply(self, images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """Cut, resize and mirror by `theta` ((B, 2, 3), CPU), then normalize; see the class docstring. Four
        kernels over the batch: to the sampling dtype, the sampling, the normalization (one multiply-add) and
        the conversion to the model's dtype and memory format."""
        device = images.device
        work = self.sampling_dtype(device)
        theta = theta.to(work)
        if device.type == "cuda":
            theta = theta.pin_memory().to(device, non_blocking=True)  # no wait for the GPU's queue
        else:
            theta = theta.to(device)
        x = images.permute(0, 3, 1, 2).to(work)  # NHWC uint8 -> NCHW view in channels_last layout
        b = x.shape[0]
        grid = F.affine_grid(theta, [b, 3, self.img_size, self.img_size], align_corners=False)
        out = F.grid_sample(x, grid, mode=self.interpolation, padding_mode="border", align_corners=False)
        if self.interpolation == "bicubic":  # its overshoot at edges leaves 0..255
            out = out.clamp_(0.0, 255.0)
        scale, shift = self._normalize_stats(device, work)
        return torch.addcmul(shift, out, scale).to(dtype=self.dtype, memory_format=self.memory_format)
