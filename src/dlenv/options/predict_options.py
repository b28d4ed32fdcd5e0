"""The options of `dlenv predict`, declared once (dlenv.options.config registers the command; the CLI and the
invoke task are generated from this class as from every other).

It lives beside config.py because that module is at its size limit. The bounds and words it shares with
the other commands (image size, batch size, the device's help, --trust-pickle) come from dlenv.options.declare,
as config.py's do. No torch here: `dlenv --help` and `invoke --list` import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlenv.options.declare import (
    BATCH_MAX,
    BATCH_WHY,
    CLASSES_MAX,
    DEVICE_HELP,
    IMG_SIZE_MAX,
    IMG_WHY,
    normalize_option,
    opt,
    resize_option,
    trust_pickle,
    workers_here,
)
from dlenv.options.values import folder_name, parse_int, parse_str, workers_or_auto


def class_list(v: Any) -> tuple[str, ...]:
    """'cat,dog,fox' (or a YAML list) -> ('cat', 'dog', 'fox'): names in the model's output order, each
    given once, none empty. Raises ValueError with the reason."""
    parts = [parse_str(x) for x in v] if isinstance(v, (list, tuple)) else parse_str(v).split(",")
    names = tuple(p.strip() for p in parts)
    if not names or any(not n for n in names):
        raise ValueError("expected class names separated by commas, e.g. cat,dog,fox (none empty)")
    if len(names) > CLASSES_MAX:
        raise ValueError(f"more than {CLASSES_MAX:,} class names")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"class name {twice[0]!r} is given twice")
    return names


@dataclass(frozen=True)
class PredictConfig:
    """Options of `predict`."""

    weights: str | None = opt(None, "the trained model: best_model.pth, last.pth, a copy of one, its .safetensors "
                                    "or ONNX export, a bare state dict (with --model), or a TorchScript export "
                                    "(with --classes, --img-size and --trust-pickle: it is a program)",
                              parse=parse_str)
    source: str | None = opt(None, "what to predict: an image, a folder (recursively, images only), a glob "
                                   "('photos/*.jpg', quoted), a video file (every --vid-stride-th frame), or - "
                                   "for image paths on standard input, one a line", parse=parse_str)
    model: str | None = opt(None, "architecture, for a bare state dict from another tool; or the run file's "
                                  "FILE.py:factory again, to trust one outside the working folder", parse=parse_str)
    trust_pickle: bool = trust_pickle()
    classes: tuple | None = opt(None, "class names in the model's output order, comma-separated, for a file "
                                      "that has none (a TorchScript export, a bare state dict)", parse=class_list)
    img_size: int | None = opt(None, "image size; default: the run file's (a bare state dict's preprocess.yaml, "
                                     "else 224)", parse=parse_int, min=16, max=IMG_SIZE_MAX, why=IMG_WHY)
    normalize: str = normalize_option()
    resize: str = resize_option()
    topk: int = opt(5, "classes and probabilities listed per image (at most the model's class count)", min=1)
    batch_size: int = opt(64, "batch size", min=1, max=BATCH_MAX, why=BATCH_WHY)
    workers: int | str = opt("auto", "DataLoader worker processes: a number (0: load in the main process; at "
                                     "most 4 per CPU, or 64), or auto", parse=workers_or_auto, here=workers_here)
    amp: bool = opt(False, "predict under AMP even if the model was trained in fp32")
    precision: str = opt("auto", "auto: the precision the model was trained in (its AMP dtype, or fp32); "
                                 "or fp32, fp16, bf16", choices=("auto", "fp32", "fp16", "bf16"))
    device: str = opt("auto", DEVICE_HELP)
    tta: str = opt("none", "test-time augmentation: flip averages each image's probabilities with its mirror "
                           "image's (not for digits or text); said in predictions.csv", choices=("none", "flip"))
    vid_stride: int = opt(1, "for a video: predict every Nth frame", min=1)
    save_images: bool = opt(False, "also write a copy of each image (or video frame) with its top class and "
                                   "probability drawn on it, and for several images contact sheets (grids of "
                                   "them)")
    json: bool = opt(False, "print one JSON object per image to standard output (messages go to stderr)")
    project: str = opt("runs/predict", "folder that holds the prediction runs")
    name: str = opt("exp", "run name; exp, exp2, exp3, ... if it exists", parse=folder_name)
    exist_ok: bool = opt(False, "write into an existing run folder instead of a new name")
