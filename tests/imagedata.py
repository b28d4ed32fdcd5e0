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


def make_train_val(root: Path, per_class: int, val_per_class: int = 2, size=(16, 16),
                   classes=("cat", "dog")) -> Path:
    """root/train and root/val of the same classes (val drawn with another seed); return root."""
    make_image_folder(Path(root) / "train", classes=classes, per_class=per_class, size=size)
    make_image_folder(Path(root) / "val", classes=classes, per_class=val_per_class, size=size, seed=1)
    return Path(root)


def photo(path, w=120, h=90, seed=0, quality=95, **save):
    """A smooth photo-like JPEG: colour ramps and a soft disc (decoders differ only by rounding)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    cx, cy = rng.uniform(0.3, 0.7) * w, rng.uniform(0.3, 0.7) * h
    disc = np.clip(1.5 - np.hypot(x - cx, y - cy) / (0.25 * min(w, h)), 0, 1)
    arr = np.stack([40 + 180 * x / w, 60 + 150 * y / h, 200 - 120 * disc], -1)
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path, quality=quality, **save)
    return path


def make_photo_layout(root: Path, train: int, val: int, classes: int, size) -> Path:
    """root/train and root/val of `classes` class folders holding `photo` JPEGs, image i of a split
    `size(i)` = (w, h) pixels (varied sizes exercise the per-size resize); return root."""
    for split, n in (("train", train), ("val", val)):
        for i in range(n):
            d = Path(root) / split / f"c{i % classes}"
            d.mkdir(parents=True, exist_ok=True)
            photo(d / f"{i}.jpg", *size(i), seed=i + (100 if split == "val" else 0))
    return Path(root)


def write_file(path, data: bytes) -> Path:
    """Write `data` to `path`, creating its folders; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def encoded_image(fmt: str, size=(20, 16), seed=0) -> bytes:
    """A small random RGB image encoded as `fmt` (PNG, JPEG, ...), as bytes."""
    import io

    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


class FillsUpAfter:
    """A file whose write() raises ENOSPC once `limit` bytes went through, as a full disk does."""

    def __init__(self, fh, limit: int):
        self.fh, self.limit, self.written = fh, limit, 0

    def write(self, data):
        import errno
        import os

        self.written += memoryview(data).nbytes
        if self.written > self.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def train_config(tmp_path: Path, data: Path, /, **kw):
    """A TrainConfig for a short deterministic CPU run on `data` (16 px, batch 4, no workers, two
    epochs) into tmp_path/runs; `kw` overrides any of it."""
    from dlenv.options import config
    from dlenv.options.config import TrainConfig

    base = dict(data=str(data), project=str(Path(tmp_path) / "runs"), img_size=16, batch_size=4, workers=0,
                epochs=2, device="cpu", deterministic=True)
    if kw.get("resume"):  # a resume's --epochs sets a new end: given only where a test gives it
        del base["epochs"]
    return config.build(TrainConfig, **{**base, **kw})
