"""Tiny image datasets for tests (importable as `imagedata` from any test module)."""

from __future__ import annotations

from pathlib import Path


def make_image_folder(root: Path, classes=("cat", "dog"), per_class: int = 4, size=(24, 20),
                      ext: str = ".png", seed: int = 0) -> Path:
    """Write `per_class` small random RGB images per class under root/<class>/; return root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for ci, name in enumerate(classes):
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, size=(size[1], size[0], 3), dtype=np.uint8)
            arr[..., ci % 3] = 255  # a class-dependent channel so tiny models can learn something
            Image.fromarray(arr).save(d / f"{name}_{i}{ext}")
    return Path(root)
