"""The built-in demo dataset: ten classes of geometric shapes, generated on the spot, no download.

Each image is one shape (circle, ring, square, frame, triangle, star, cross, hexagon, crescent, arrow)
of random colour, size, position and rotation on a random two-colour gradient with noise. Colour is
drawn independently of the class, so the task needs shape, not colour: a classifier on mean colour is
at chance, a small CNN learns it in minutes on a CPU. The same seed gives the same bytes.

`ensure_demo_data` writes train/<class>/*.png and val/<class>/*.png into a temporary folder beside
the destination and renames it into place when complete; a complete dataset with the same settings
is reused, so `dlenv train` without --data can call it every time.

`default_data` is what `dlenv train` (and a project's `python train.py`) trains on without --data: the one
dataset under data/ when there is one (an uploaded project's), the demo when there is none; with several
it asks for --data. No torch here: the CLI asks it before PyTorch loads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dlenv import invocation
from dlenv.errors import UserError

#: The demo's image size, and the default --img-size when training on it.
DEMO_IMG_SIZE = 64
#: What `dlenv train` trains on the demo data on a machine without a GPU, when --model is left to auto:
#: ResNet-18 there needs far more CPU time than a first run should take (docs/benchmarks.md, "CPU demo",
#: has the measurements behind each value). The demo data's augmentation is --augment auto's "light".
CPU_RECIPE = {"model": "small_cnn", "img_size": 32, "epochs": 10, "lr": 3e-3, "warmup_epochs": 0.5}
#: what the options left to auto become everywhere else
TRAIN_DEFAULTS = {"model": "resnet18", "epochs": 10, "warmup_epochs": 1.0}
#: user data takes the CPU recipe too (its --img-size stays auto: the data's own) when its training images'
#: typical shorter side is at most this: small images, where small_cnn learns in a fraction of ResNet-18's
#: CPU time and to a higher top-1 in 10 epochs (docs/training.md, "The demo on a CPU", has the digits run)
CPU_RECIPE_MAX_SIDE = 64
CLASSES = ("arrow", "circle", "crescent", "cross", "frame", "hexagon", "ring", "square", "star",
           "triangle")
#: Bump when the drawing changes, so an older dataset on disk is not mistaken for the current one.
VERSION = 1
MARKER = ".dlenv-demo.json"
_SUPERSAMPLE = 4  # shapes are drawn 4x larger and box-filtered down: smooth, anti-aliased edges


def _polygon(cx: float, cy: float, pts: list[tuple[float, float]], angle: float) -> list[tuple[float, float]]:
    """Local (x, y) points rotated by `angle` and moved to (cx, cy)."""
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _regular(n: int, r: float, phase: float = 0.0) -> list[tuple[float, float]]:
    return [(r * math.cos(phase + 2 * math.pi * k / n), r * math.sin(phase + 2 * math.pi * k / n))
            for k in range(n)]


def _shape_mask(name: str, rng: np.random.Generator, size: int) -> np.ndarray:
    """Coverage (0..1, float32, size x size) of one randomly placed, sized and rotated shape."""
    from PIL import Image, ImageDraw

    big = size * _SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    r = rng.uniform(0.2, 0.36) * big  # half-extent of the shape
    margin = 0.07 * big  # keeps the shape inside the eval centre crop (256/224 resize)
    cx, cy = rng.uniform(r + margin, big - r - margin, size=2)
    a = rng.uniform(0, 2 * math.pi)

    def poly(pts, fill=255):
        draw.polygon(_polygon(cx, cy, pts, a), fill=fill)

    def disc(x, y, rad, fill=255):
        draw.ellipse((x - rad, y - rad, x + rad, y + rad), fill=fill)

    if name == "circle":
        disc(cx, cy, r)
    elif name == "ring":
        disc(cx, cy, r)
        disc(cx, cy, r * rng.uniform(0.5, 0.7), 0)
    elif name == "square":
        poly(_regular(4, r))
    elif name == "frame":
        poly(_regular(4, r))
        poly(_regular(4, r * rng.uniform(0.5, 0.65)), 0)
    elif name == "triangle":
        poly(_regular(3, r))
    elif name == "hexagon":
        poly(_regular(6, r))
    elif name == "star":
        outer, inner = _regular(5, r), _regular(5, r * 0.42, math.pi / 5)
        poly([p for pair in zip(outer, inner, strict=True) for p in pair])
    elif name == "cross":
        w = r * rng.uniform(0.25, 0.35)
        poly([(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w),
              (-r, -w), (-w, -w)])
    elif name == "crescent":
        disc(cx, cy, r)
        off = r * rng.uniform(0.4, 0.55)
        disc(cx + off * math.cos(a), cy + off * math.sin(a), r * 0.85, 0)
    elif name == "arrow":
        w, head = r * 0.22, r * 0.15
        poly([(-r, -w), (head, -w), (head, -2.6 * w), (r, 0), (head, 2.6 * w), (head, w), (-r, w)])
    else:
        raise ValueError(f"unknown demo class {name!r}")
    small = mask.resize((size, size), Image.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def _colour(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0, 255, size=3).astype(np.float32)


def render(name: str, rng: np.random.Generator, size: int = DEMO_IMG_SIZE) -> np.ndarray:
    """One demo image of class `name` as a (size, size, 3) uint8 array."""
    # Background: a linear gradient between two random colours in a random direction.
    c1, c2 = _colour(rng), _colour(rng)
    t = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    ang = rng.uniform(0, 2 * math.pi)
    ramp = (math.cos(ang) * t[None, :] + math.sin(ang) * t[:, None]) / 2.0 + 0.5
    img = c1 + (c2 - c1) * ramp[..., None]
    # Shape colour: random, but far enough from the background that the shape is visible. This
    # rule is the same for every class, so colour carries no information about the class.
    bg_mean = (c1 + c2) / 2
    fg = _colour(rng)
    while np.linalg.norm(fg - bg_mean) < 90:
        fg = _colour(rng)
    alpha = _shape_mask(name, rng, size)[..., None]
    img = img * (1 - alpha) + fg * alpha
    img += rng.normal(0, rng.uniform(4, 16), size=img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _write_split(root: Path, split: int, split_name: str, per_class: int, size: int, seed: int) -> None:
    from PIL import Image

    for ci, name in enumerate(CLASSES):
        d = root / split_name / name
        d.mkdir(parents=True)
        for i in range(per_class):
            # One generator per image: the same image whatever the counts or the order of writing.
            rng = np.random.default_rng([seed, split, ci, i])
            Image.fromarray(render(name, rng, size)).save(d / f"{name}_{i:05d}.png", compress_level=1)


def _params(train_per_class: int, val_per_class: int, size: int, seed: int) -> dict[str, Any]:
    return {"version": VERSION, "classes": list(CLASSES), "train_per_class": train_per_class,
            "val_per_class": val_per_class, "size": size, "seed": seed}


def _read_marker(dest: Path) -> dict[str, Any] | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_demo_folder(root: str | Path) -> bool:
    """Whether `root` is a demo dataset written by `ensure_demo_data` (it has the marker), wherever it
    lives: `--data data/demo` then trains with the demo's image size and crop scale, as no --data does."""
    return _read_marker(Path(root)) is not None


def is_complete(dest: str | Path, params: dict[str, Any]) -> bool:
    """Whether `dest` holds a whole demo dataset made with exactly these settings."""
    dest = Path(dest)
    if _read_marker(dest) != params:
        return False
    for split, n in (("train", params["train_per_class"]), ("val", params["val_per_class"])):
        for name in params["classes"]:
            d = dest / split / name
            if not d.is_dir() or sum(1 for f in os.scandir(d) if f.name.endswith(".png")) != n:
                return False
    return True


@contextlib.contextmanager
def _lock(dest: Path):
    """Serialise writers of one destination (several ranks of a torchrun job may call us at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no concurrent writers to guard against in practice
        yield
        return
    with open(dest.parent / f".{dest.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_demo_data(dest: str | Path = "data/demo", train_per_class: int = 300, val_per_class: int = 60,
                     size: int = DEMO_IMG_SIZE, seed: int = 0, overwrite: bool = False) -> Path:
    """Write the demo dataset to `dest` (train/ and val/ of class folders) unless it is already
    there with the same settings; return `dest`.

    Written to a temporary folder beside `dest` and renamed into place when complete, so an
    interrupted run never leaves a half dataset. Raises UserError when `dest` holds something else
    (another folder, or a demo dataset with other settings) and `overwrite` is False.
    """
    dest = Path(dest)
    params = _params(train_per_class, val_per_class, size, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _lock(dest):
        if not overwrite and is_complete(dest, params):
            return dest
        if not overwrite and dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            old = _read_marker(dest)
            if old is None:
                raise UserError(f"{dest} exists and is not a demo dataset; choose another --dest, "
                                "or --overwrite to replace it")
            changed = ", ".join(f"{k} {old.get(k)} -> {v}" for k, v in params.items() if old.get(k) != v)
            raise UserError(f"{dest} holds a demo dataset made with other settings ({changed or 'incomplete'}); "
                            "pass --overwrite to replace it, or choose another --dest")
        # Leftovers of an interrupted run (we hold the lock, so no one else is writing them).
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the dataset is not
            _write_split(tmp, 0, "train", train_per_class, size, seed)
            _write_split(tmp, 1, "val", val_per_class, size, seed)
            (tmp / MARKER).write_text(json.dumps(params, indent=1))
            if dest.exists() or dest.is_symlink():
                old_dir = tmp.with_name(tmp.name + "-old")
                os.rename(dest, old_dir)
                os.rename(tmp, dest)
                if old_dir.is_dir() and not old_dir.is_symlink():
                    shutil.rmtree(old_dir)
                else:
                    old_dir.unlink()
            else:
                os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def main(cfg: Any) -> int:
    """`dlenv demo-data`: write (or reuse) the demo dataset and say where it is; 0 on success."""
    params = _params(cfg.train_per_class, cfg.val_per_class, cfg.size, cfg.seed)
    reused = not cfg.overwrite and is_complete(cfg.dest, params)
    t0 = time.perf_counter()
    path = ensure_demo_data(cfg.dest, cfg.train_per_class, cfg.val_per_class, cfg.size, cfg.seed,
                            cfg.overwrite)
    how = "already there, reused" if reused else f"written in {time.perf_counter() - t0:.1f} s"
    print(f"demo dataset {path}: {len(CLASSES)} classes ({', '.join(CLASSES)}), "
          f"{cfg.train_per_class * len(CLASSES)} train / {cfg.val_per_class * len(CLASSES)} val images, "
          f"{cfg.size}x{cfg.size} PNG; {how}")
    print(f"train on it: {invocation.command('train', '')} (no --data, where it is the only dataset under "
          f"{DATA_HOME}/), or {invocation.command('train', f'--data {path}')}")
    return 0


def train_defaults(cfg: Any, device_type: str) -> tuple[Any, str | None]:
    """`cfg` (a TrainConfig) with the options left to auto (None, or "auto" for --model) filled in, and
    the line that says so when they became the CPU recipe (else None).

    Without a GPU and without --model, the auto options take CPU_RECIPE's values on the demo data (no
    --data, or a folder `demo-data` wrote), and on user data of small images (`small_images`: --img-size
    then stays auto, the data's own size); options given keep theirs. Anywhere else they take
    TRAIN_DEFAULTS'; --img-size and --lr stay auto (the data and the optimizer decide them)."""
    import dataclasses

    values, why = _cpu_recipe(cfg, device_type)
    auto = {k: v for k, v in values.items() if getattr(cfg, k) in (None, "auto")}
    if why is None:
        return dataclasses.replace(cfg, **auto), None
    shown = " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                     for k, v in auto.items())
    return dataclasses.replace(cfg, **auto), (
        f"no GPU: {why}, {shown} (minutes on 2 cores, see docs/training.md); give --model to train another")


def _cpu_recipe(cfg: Any, device_type: str) -> tuple[dict[str, Any], str | None]:
    """(the values of the options left to auto, why they are the CPU recipe's; None where they are
    TRAIN_DEFAULTS'). The recipe needs a CPU and --model auto; user data takes it (less --img-size) only
    of small images, and never with --weights or --pretrained (weights for --model auto's ResNet-18)."""
    if device_type != "cpu" or cfg.model != "auto":
        return TRAIN_DEFAULTS, None
    if cfg.data is None or is_demo_folder(cfg.data):
        return CPU_RECIPE, "the demo's CPU recipe"
    side = None if cfg.synthetic or cfg.weights or cfg.pretrained else small_images(cfg.data, cfg.val_split,
                                                                                    cfg.seed)
    if side is None:
        return TRAIN_DEFAULTS, None
    return ({k: v for k, v in CPU_RECIPE.items() if k != "img_size"},
            f"images this small ({side} px typical shorter side) take the CPU recipe")


#: where `default_data` looks for the dataset of a run without --data (the workspace's data/)
DATA_HOME = "data"


def datasets_in(home: str | Path = DATA_HOME) -> list[Path]:
    """The datasets under `home`, sorted: its folders that hold a folder (class folders, or train/ and
    val/), not hidden (unpack's temporary folders) and not a demo dataset."""
    def holds_folder(d: Path) -> bool:
        with os.scandir(d) as it:
            return any(e.is_dir() and not e.name.startswith(".") for e in it)

    try:
        entries = sorted(Path(home).iterdir())
    except OSError:  # no data/ (or not a folder): no dataset
        return []
    return [d for d in entries if not d.name.startswith((".", "_")) and d.is_dir() and not is_demo_folder(d)
            and holds_folder(d)]


def default_data(data: str | None, synthetic: bool = False, home: str | Path = DATA_HOME) -> tuple[str | None, str]:
    """(the dataset a run trains on, why): the one place that decides what no --data means.

    --data given, or --synthetic: that. Else the one dataset under `home` (`datasets_in`); none: None, the
    built-in demo (written on first use). Raises UserError when there are several, naming them.
    """
    if synthetic:
        return data, "--synthetic"
    if data is not None:
        return data, f"--data {data}"
    found = datasets_in(home)
    if len(found) > 1:
        shown = ", ".join(str(d) for d in found[:6]) + (", ..." if len(found) > 6 else "")
        raise UserError(f"{len(found)} datasets under {home}/ ({shown}); choose one with --data, "
                        f"e.g. --data {found[0]}")
    if found:
        return str(found[0]), f"the one dataset under {home}/; --data to choose"
    return None, f"no dataset under {home}/; --data to choose"


def small_images(data: str, val_split: float = 0.2, seed: int = 0) -> int | None:
    """The typical shorter side of `data`'s training images (dlenv.data.imagesize, as --img-size auto reads
    it) when it is at most CPU_RECIPE_MAX_SIDE, else None; None too for a folder the trainer will refuse
    (it says why then) or whose headers cannot be read."""
    from dlenv.data.folder import find_layout
    from dlenv.data.imagesize import typical_side

    try:
        layout = find_layout(data, val_split, seed)
    except (UserError, OSError):
        return None
    found = typical_side([p for p, _ in layout.train])
    return found[0] if found and found[0] <= CPU_RECIPE_MAX_SIDE else None
