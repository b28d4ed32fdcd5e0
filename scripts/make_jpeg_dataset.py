#!/usr/bin/env python3
"""Write a photo-like JPEG ImageFolder (train/ and val/ of class folders) for input-pipeline benchmarks.

Decoding cost depends on what a JPEG holds: flat colours compress to a few KB and decode far faster
than photographs. So each image here has what photographs have: a smooth 1/f ("fractal") random field
for light and colour, a few soft-edged shapes with gradients, and fine grain, saved at quality 90
(about 60-90 KB at 500x375, like a phone photo scaled down). Each class has its own hue range and
shape kind, so a model can learn the task.

Deterministic: image i of class c depends only on (--seed, c, i). Runs in parallel processes:

    python3 scripts/make_jpeg_dataset.py --out /tmp/jpegs                 # 20,000 train + 1,000 val
    python3 scripts/make_jpeg_dataset.py --out /tmp/jpegs --train 2000 --val 200 --classes 4

An existing complete dataset with the same settings is kept (a marker file records them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

MARKER = ".make_jpeg_dataset.json"
VERSION = 1


def _fractal_field(rng: np.random.Generator, h: int, w: int, beta: float) -> np.ndarray:
    """(3, h, w) float32 random field with a 1/f**beta power spectrum, each channel scaled to [0, 1]."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = f ** (-beta / 2.0)
    amp[0, 0] = 0.0
    spec = (rng.standard_normal((3, h, w // 2 + 1)) + 1j * rng.standard_normal((3, h, w // 2 + 1))) * amp
    field = np.fft.irfft2(spec, s=(h, w)).astype(np.float32)
    lo = field.min(axis=(1, 2), keepdims=True)
    hi = field.max(axis=(1, 2), keepdims=True)
    return (field - lo) / np.maximum(hi - lo, 1e-6)


def render(seed: int, cls: int, index: int, classes: int, width: int, height: int) -> Image.Image:
    """One image: deterministic in (seed, cls, index)."""
    rng = np.random.default_rng([seed, cls, index])
    # Low-frequency light and colour: a fractal field at half resolution, upsampled smoothly.
    lh, lw = height // 2, width // 2
    field = _fractal_field(rng, lh, lw, beta=rng.uniform(2.0, 3.0))
    hue = (cls / classes + rng.normal(0, 0.04)) * 2 * math.pi
    tint = np.array([math.cos(hue), math.cos(hue - 2.094), math.cos(hue + 2.094)], np.float32)
    base = 0.55 * field[0] + 0.45 * field[1:].mean(axis=0)
    rgb = base[None] * (0.6 + 0.35 * tint[:, None, None]) + 0.25 * (field - 0.5)
    low = np.clip(rgb.transpose(1, 2, 0) * 255.0, 0, 255).astype(np.uint8)
    img = Image.fromarray(low).resize((width, height), Image.BICUBIC)

    # Objects: soft shapes whose kind depends on the class, with a light-to-dark gradient.
    draw_layer = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(draw_layer)
    kind = cls % 3
    for _ in range(int(rng.integers(2, 6))):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.06, 0.25) * min(width, height)
        if kind == 0:
            draw.ellipse([cx - r, cy - r * rng.uniform(0.5, 1), cx + r, cy + r], fill=int(rng.integers(120, 255)))
        elif kind == 1:
            n = int(rng.integers(3, 7))
            a0 = rng.uniform(0, 2 * math.pi)
            pts = [(cx + r * math.cos(a0 + 2 * math.pi * k / n), cy + r * math.sin(a0 + 2 * math.pi * k / n))
                   for k in range(n)]
            draw.polygon(pts, fill=int(rng.integers(120, 255)))
        else:
            draw.line([(cx - r, cy - r), (cx + r, cy + r * rng.uniform(-1, 1))],
                      fill=int(rng.integers(120, 255)), width=int(max(3, r / 4)))
    mask = draw_layer.filter(ImageFilter.GaussianBlur(rng.uniform(0.8, 2.5)))
    colour = (rng.uniform(0.3, 1.0, 3) * 255 * (0.7 + 0.3 * tint)).clip(0, 255)
    ramp = np.linspace(0.55, 1.1, width, dtype=np.float32)[None, :, None]
    shade = Image.fromarray(np.clip(colour[None, None, :] * ramp, 0, 255).astype(np.uint8).repeat(height, 0))
    img = Image.composite(shade, img, mask)

    # Fine grain and sensor-like noise: what makes a photograph's JPEG large and slow to decode.
    arr = np.asarray(img, dtype=np.int16)
    grain = rng.integers(-10, 11, size=(height, width, 1), dtype=np.int16)
    chroma = rng.integers(-4, 5, size=(height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(arr + grain + chroma, 0, 255).astype(np.uint8))


def _write_chunk(args: tuple) -> int:
    seed, split_seed, classes, jobs, width, height, quality = args
    for out, cls, index in jobs:
        render(seed + split_seed, cls, index, classes, width, height).save(out, quality=quality)
    return len(jobs)


def generate(out: Path, train: int, val: int, classes: int, width: int, height: int, seed: int,
             workers: int, quality: int = 90) -> Path:
    """Write out/train/class_XX/*.jpg and out/val/class_XX/*.jpg (reused when already complete)."""
    settings = {"version": VERSION, "train": train, "val": val, "classes": classes, "width": width,
                "height": height, "seed": seed, "quality": quality}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        print(f"{out}: already complete, kept")
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    jobs = []
    for split, count, split_seed in (("train", train, 0), ("val", val, 10_000_019)):
        for i in range(count):
            cls = i % classes
            d = tmp / split / f"class_{cls:02d}"
            jobs.append((split_seed, (str(d / f"{split}_{i:06d}.jpg"), cls, i)))
    for c in range(classes):
        for split in ("train", "val"):
            (tmp / split / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    chunks = []
    for split_seed in (0, 10_000_019):
        mine = [j for s, j in jobs if s == split_seed]
        step = 64
        chunks += [(seed, split_seed, classes, mine[k:k + step], width, height, quality)
                   for k in range(0, len(mine), step)]
    t0 = time.perf_counter()
    done = 0
    with ProcessPoolExecutor(workers) as pool:
        for n in pool.map(_write_chunk, chunks):
            done += n
    if out.exists():
        shutil.rmtree(out)
    marker_tmp = tmp / MARKER
    marker_tmp.write_text(json.dumps(settings))
    os.replace(tmp, out)
    dt = time.perf_counter() - t0
    print(f"{out}: {done} JPEGs of {width}x{height} in {dt:.1f} s ({done / dt:,.0f}/s, {workers} processes)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="dataset folder to write")
    p.add_argument("--train", type=int, default=20_000, help="training images (all classes)")
    p.add_argument("--val", type=int, default=1_000, help="validation images (all classes)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args(argv)
    generate(a.out, a.train, a.val, a.classes, a.width, a.height, a.seed, a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
