"""Predictions on unlabelled images: `dlenv predict --weights best_model.pth --source photos/`.

The model is opened the way `dlenv val` opens it (dlenv.runstate's guarded load under the command's
--trust-pickle, dlenv.evaluate's check of the saved options, dlenv.models' rebuild with the rule for a
model of your own), so a file val refuses is refused here in the same words. Its preprocessing is
val's too: resize and centre crop at the checkpoint's image size, its normalisation and resampling,
in the precision it trained in (`evaluate.val_precision`), batched through `evaluate.predict`.

`--source` is an image, a folder (recursively, images only), a glob, a video (OpenCV, every
`--vid-stride`-th frame) or `-` for paths on standard input. An unreadable image is skipped with one
line (the first few named, then counted: dlenv.data.badimages); nothing readable at all is an error.
The results go to runs/predict/<name>/predictions.csv, written whole or not at all (dlenv.atomic):
path, frame (for a video), tta, then class_i and prob_i for i = 1..top-k. `--json` prints the same
as JSON lines on stdout; `--save-images` writes annotated copies into <run>/images/.

A TorchScript export is a program: torch.jit.load runs the code it holds, so it opens only with
--trust-pickle, and since `dlenv export` stores neither class names nor image size in it, with
--classes and --img-size. An ONNX file needs onnxruntime, which this environment does not provide.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import os
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv import pretrained, safeio
from dlenv.atomic import write_atomic, write_file
from dlenv.data.folder import IMAGE_EXTS, is_image
from dlenv.errors import UserError, printable

#: file name endings `--source FILE` reads as a video (anything else named alone is read as an image)
VIDEO_EXTS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv"})
#: the file of the predictions inside the run folder
CSV_NAME = "predictions.csv"


@dataclass
class Opened:
    """A model ready to predict with, and how its inputs are prepared."""

    model: torch.nn.Module
    class_names: list[str]
    img_size: int
    norm: tuple[tuple, tuple] | None  # (mean, std); None: ImageNet's
    interpolation: str
    trained: dict[str, Any]  # the training options it was saved with ({}: unknown)


@dataclass
class Source:
    """What to predict: image paths, or one video (`video` set, `paths` empty)."""

    paths: list[str]
    video: Path | None
    what: str


# ---------------------------------------------------------------------------------------------------
# The model.


def _is_torchscript(path: Path) -> bool:
    """Whether `path` is a TorchScript archive (a zip with constants.pkl, as dlenv.runstate tells one)."""
    if not safeio.is_regular(path):
        return False
    try:
        with safeio.open_regular(path, "weights file") as fh, zipfile.ZipFile(fh) as zf:
            return any(n.endswith("constants.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def _names(given: tuple | None, own: list[str], named: bool, path: Path) -> list[str]:
    """The class names to report: the file's own when it has them (--classes must agree), else --classes."""
    if given is None:
        return list(own)
    given = list(given)
    if len(given) != len(own):
        raise UserError(f"--classes names {len(given)} classes but {printable(str(path))} has {len(own)} outputs; "
                        f"pass {len(own)} names in the model's output order")
    if named and given != list(own):
        raise UserError(f"--classes differs from the class names {printable(str(path))} was trained with "
                        f"({', '.join(own[:5])}{', ...' if len(own) > 5 else ''}); drop --classes")
    return given


def _open_torchscript(cfg: Any, path: Path) -> Opened:
    """A TorchScript export: with consent, and the class names and size the file does not carry."""
    from dlenv import compat

    if not cfg.trust_pickle:
        raise UserError(f"{printable(str(path))} is a TorchScript export, a program: loading it runs the code it "
                        "holds. Pass --trust-pickle if you trust where it came from, or predict from the "
                        "checkpoint or its .safetensors export (no code run)")
    if cfg.classes is None or cfg.img_size is None:
        raise UserError(f"{printable(str(path))} is a TorchScript export, which stores no class names or image "
                        "size; pass --classes NAME,NAME,... and --img-size N (or use the checkpoint it was "
                        "exported from)")
    try:
        model = compat.jit_load(path, map_location="cpu").eval()
    except Exception as e:  # the file is what's wrong: truncated, or written by a newer PyTorch
        raise UserError(f"TorchScript file {printable(str(path))} could not be loaded "
                        f"({printable(str(e).strip().splitlines()[0][:160]) if str(e).strip() else type(e).__name__})"
                        "; export it again") from None
    try:
        with torch.inference_mode():
            width = model(torch.zeros(1, 3, cfg.img_size, cfg.img_size)).shape[-1]
    except Exception as e:
        first = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"{printable(str(path))} does not run on {cfg.img_size}x{cfg.img_size} images "
                        f"({printable(first)}); pass the --img-size it was exported at") from None
    names = _names(cfg.classes, [str(i) for i in range(int(width))], False, path)
    return Opened(model, names, int(cfg.img_size), None, "bilinear", {})


def open_model(cfg: Any, say: Any = print) -> Opened:
    """The model cfg.weights holds, opened as `dlenv val` opens it (or a TorchScript export).

    Raises UserError for a missing, foreign, unsafe or corrupt file, a bare state dict without --model,
    an ONNX file, and --classes that do not fit the model.
    """
    from dlenv.evaluate import check_saved_options
    from dlenv.models import model_from_checkpoint
    from dlenv.runstate import is_dlenv_checkpoint, load_checkpoint
    from dlenv.weights import LoadPolicy

    path = Path(cfg.weights)
    if path.suffix.lower() == ".onnx":
        raise UserError(f"{printable(str(path))} is an ONNX file, and predicting with one needs onnxruntime, "
                        "which this environment does not have; pass the checkpoint it was exported from, or "
                        "its .safetensors or TorchScript export")
    if _is_torchscript(path):
        return _open_torchscript(cfg, path)
    ckpt = load_checkpoint(path, LoadPolicy.of(cfg))
    check_saved_options(ckpt, path)
    model, class_names, img_size = model_from_checkpoint(ckpt, cfg.model, source=str(path))
    named = is_dlenv_checkpoint(ckpt)
    class_names = _names(cfg.classes, class_names, named, path)
    size = cfg.img_size or img_size
    if size is None:
        size = 224
        say("image size: 224 (the state dict does not say; set --img-size to change it)")
    return Opened(model, class_names, int(size), pretrained.norm_of(ckpt), pretrained.interpolation_of(ckpt),
                  dict(ckpt.get("config") or {}) if named else {})


class FlipAverage(torch.nn.Module):
    """`--tta flip`: the model's probabilities averaged with those of the mirrored image, returned as log
    probabilities, so a softmax of the output is that average (and argmax its top class)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.model(x).float(), 1) + torch.softmax(self.model(torch.flip(x, dims=[3])).float(), 1)
        return torch.log((p / 2).clamp_min(torch.finfo(torch.float32).tiny))  # a 0 would read as -inf


# ---------------------------------------------------------------------------------------------------
# The source.


def _images_in(folder: Path) -> list[str]:
    """Image files under `folder`, recursively, sorted; hidden files and folders left out, links to
    folders not followed (dlenv.data.folder's rules)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__MACOSX")
        found += [os.path.join(root, f) for f in files if is_image(f)]
    return sorted(found)


def find_source(spec: str | None, stdin: Any = None) -> Source:
    """The images (or the video) `--source` names. Raises UserError for a missing source, a folder or a
    glob without images, an empty standard input, and a video OpenCV cannot open."""
    if not spec:
        raise UserError("--source is required: an image, a folder, a glob, a video file, or - for paths on stdin")
    if spec == "-":
        lines = [line.strip() for line in (stdin or sys.stdin).read().splitlines()]
        paths = [p for p in lines if p]
        if not paths:
            raise UserError("--source -: standard input held no paths; pipe image paths one a line, e.g. "
                            "find photos -name '*.jpg' | dlenv predict --source - --weights ...")
        return Source(paths, None, f"{len(paths)} paths from standard input")
    path = Path(spec)
    exts = " ".join(sorted(IMAGE_EXTS))
    if path.is_dir():
        paths = _images_in(path)
        if not paths:
            raise UserError(f"--source {printable(spec)}: no images in this folder or below it (extensions: {exts})")
        return Source(paths, None, f"{len(paths)} images in {printable(spec)}")
    if path.exists():
        if path.suffix.lower() in VIDEO_EXTS:
            _check_video(path)
            return Source([], path, f"video {printable(spec)}")
        return Source([str(path)], None, printable(spec))
    if glob.has_magic(spec):
        paths = sorted(p for p in glob.glob(spec, recursive=True) if is_image(os.path.basename(p)))
        if not paths:
            raise UserError(f"--source {printable(spec)}: the pattern matches no images (extensions: {exts})")
        return Source(paths, None, f"{len(paths)} images matching {printable(spec)}")
    raise UserError(f"--source {printable(spec)}: no such file or folder")


def _capture(path: Path) -> Any:
    try:
        import cv2
    except ImportError:
        raise UserError("reading a video needs OpenCV (opencv-python-headless, in requirements.txt)") from None
    return cv2, cv2.VideoCapture(str(path))


def _check_video(path: Path) -> None:
    """UserError unless `path` is a regular file whose first frame OpenCV decodes."""
    if not safeio.is_regular(path):
        raise UserError(f"--source {printable(str(path))} is not a regular file (a named pipe, a device or a socket)")
    _, cap = _capture(path)
    try:
        ok = cap.isOpened() and cap.read()[0]
    finally:
        cap.release()
    if not ok:
        raise UserError(f"--source {printable(str(path))}: OpenCV cannot read a frame of this video (damaged, or a "
                        "codec this OpenCV build lacks); convert it, e.g. ffmpeg -i IN -c:v libx264 out.mp4")


def video_frames(path: Path, stride: int) -> Iterator[tuple[int, Any]]:
    """(frame number, PIL RGB image) of every `stride`-th frame of the video, from frame 0."""
    from PIL import Image

    cv2, cap = _capture(path)
    try:
        n = 0
        while True:
            ok = cap.grab()
            if not ok:
                return
            if n % stride == 0:
                ok, bgr = cap.retrieve()
                if not ok:
                    return
                yield n, Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
            n += 1
    finally:
        cap.release()


def _video_batches(path: Path, stride: int, opened: Opened, batch_size: int) -> Iterator[tuple[torch.Tensor, Any]]:
    """(images, frame numbers) batches of the video through val's eval transform."""
    from dlenv.data.loaders import build_transforms

    transform = build_transforms(opened.img_size, False, norm=opened.norm, interpolation=opened.interpolation)
    images, frames = [], []
    for n, im in video_frames(path, stride):
        images.append(transform(im))
        frames.append(n)
        if len(images) == batch_size:
            yield torch.stack(images), torch.tensor(frames)
            images, frames = [], []
    if images:
        yield torch.stack(images), torch.tensor(frames)


# ---------------------------------------------------------------------------------------------------
# Predicting.


@dataclass
class Prediction:
    """One image's (or frame's) top-k: [(class name, probability)], best first."""

    path: str
    frame: int | None
    top: list[tuple[str, float]]


def run(opened: Opened, source: Source, cfg: Any, device: torch.device, mode: str) -> tuple[list[Prediction], float]:
    """(predictions in source order, seconds the pass took). Unreadable images are left out, said in
    one line each for the first few, then counted. Raises UserError when nothing could be read, and
    (dlenv.evaluate.refuse_non_finite) for NaN or inf outputs."""
    from dlenv.data.loaders import BadImageError, build_eval_loader, resolve_workers
    from dlenv.evaluate import predict, refuse_non_finite

    net = FlipAverage(opened.model) if cfg.tta == "flip" else opened.model
    t0 = time.perf_counter()
    if source.video is not None:
        batches = _video_batches(source.video, cfg.vid_stride, opened, cfg.batch_size)
        logits, keys = predict(net, batches, device, mode=mode, progress=True)
        paths, frames = [str(source.video)] * len(keys), keys.tolist()
    else:
        samples = [(p, i) for i, p in enumerate(source.paths)]  # the label is the index: each row's path
        workers = resolve_workers(cfg.workers, cfg.batch_size, opened.img_size)
        loader = build_eval_loader(samples, opened.img_size, cfg.batch_size, workers, norm=opened.norm,
                                   interpolation=opened.interpolation)
        try:
            logits, _ = predict(net, loader, device, mode=mode, progress=True)
        except BadImageError as e:  # every image failed: the dataset found none to stand in
            raise UserError(f"none of the {len(samples)} image(s) of {source.what} could be read (e.g. "
                            f"{printable(e.path)}: {printable(e.reason)})") from None
        bad = set(loader.bad_paths)
        keep = [i for i, p in enumerate(source.paths) if p not in bad]  # a skipped file's slot holds a stand-in
        logits = logits[keep]
        paths, frames = [source.paths[i] for i in keep], [None] * len(keep)
        if bad:
            print(f"{len(bad)} unreadable image(s) left out of {len(samples)}")
    seconds = time.perf_counter() - t0
    if len(paths) == 0:
        raise UserError(f"no frame of {source.what} could be read; nothing to predict")
    refuse_non_finite(logits, net, mode, cfg.weights)
    k = min(cfg.topk, len(opened.class_names))
    probs, idx = torch.softmax(logits.float(), 1).topk(k, dim=1)
    names = opened.class_names
    preds = [Prediction(p, f, [(names[j], float(q)) for q, j in zip(pr.tolist(), ix.tolist(), strict=True)])
             for p, f, pr, ix in zip(paths, frames, probs, idx, strict=True)]
    return preds, seconds


# ---------------------------------------------------------------------------------------------------
# Outputs.


def csv_header(k: int) -> list[str]:
    """predictions.csv's columns for top-`k`."""
    return ["path", "frame", "tta", *(f"{c}_{i}" for i in range(1, k + 1) for c in ("class", "prob"))]


def csv_row(p: Prediction, tta: str) -> list[Any]:
    return [p.path, "" if p.frame is None else p.frame, tta,
            *(v for name, q in p.top for v in (name, f"{q:.6f}"))]


def write_csv(path: Path, preds: list[Prediction], k: int, tta: str) -> Path:
    """predictions.csv, atomically: the old file stays whole if any row fails."""
    def write(fh: Any) -> None:
        text = io.TextIOWrapper(fh, encoding="utf-8", newline="")
        w = csv.writer(text)
        w.writerow(csv_header(k))
        for p in preds:
            w.writerow(csv_row(p, tta))
        text.flush()
        text.detach()  # leave the handle to write_file, which closes it

    return write_file(path, write)


def json_line(p: Prediction, tta: str) -> str:
    return json.dumps({"path": p.path, "frame": p.frame, "tta": tta,
                       "top": [{"class": name, "prob": round(q, 6)} for name, q in p.top]})


def _annotated(im: Any, label: str) -> Any:
    """A copy of `im` with `label` on a dark band at its top-left corner."""
    from PIL import ImageDraw

    im = im.copy()
    draw = ImageDraw.Draw(im)
    x0, y0, x1, y1 = draw.textbbox((2, 2), label)
    draw.rectangle((0, 0, x1 + 2, y1 + 2), fill=(0, 0, 0))
    draw.text((2, 2), label, fill=(255, 255, 255))
    return im


def save_images(folder: Path, preds: list[Prediction], source: Source, stride: int) -> int:
    """Annotated copies of the predicted images (or frames) in `folder`, each written atomically;
    returns how many. A name met twice (a glob over folders) gets -2, -3, ..."""
    from PIL import Image

    from dlenv.data.decode import load_rgb

    folder.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()

    def save(im: Any, name: str, top: tuple[str, float]) -> None:
        stem, ext = os.path.splitext(name)
        fmt = Image.registered_extensions().get(ext.lower()) or "PNG"
        ext = ext if ext.lower() in Image.registered_extensions() else ".png"
        n, out = 1, stem + ext
        while out in taken:
            n += 1
            out = f"{stem}-{n}{ext}"
        taken.add(out)
        shown = _annotated(im, f"{top[0]} {top[1]:.0%}")
        write_atomic(folder / out, lambda tmp: shown.save(tmp, format=fmt))

    if source.video is not None:
        by_frame = {p.frame: p for p in preds}
        for n, im in video_frames(source.video, stride):
            if n in by_frame:
                save(im, f"{source.video.stem}_frame{n:06d}.jpg", by_frame[n].top[0])
        return len(by_frame)
    for p in preds:
        save(load_rgb(p.path), os.path.basename(p.path), p.top[0])
    return len(preds)


# ---------------------------------------------------------------------------------------------------
# `dlenv predict`.


def main(cfg: Any) -> int:
    """`dlenv predict`: predict cfg.source with cfg.weights and write predictions.csv. Returns 0.

    Raises UserError for a missing or unreadable source or model (see `find_source`, `open_model`), a
    source with nothing readable in it, and NaN or inf outputs.
    """
    from dlenv.devices import resolve_device
    from dlenv.evaluate import val_precision
    from dlenv.runs import BEST, new_run_dir

    if not cfg.weights:
        raise UserError(f"--weights is required: the trained model to predict with (e.g. runs/exp/{BEST})")
    out_stream = sys.stderr if cfg.json else sys.stdout  # --json: stdout holds the JSON lines alone

    def say(line: str) -> None:
        print(line, file=out_stream, flush=True)

    source = find_source(cfg.source)
    device = resolve_device(cfg.device)
    opened = open_model(cfg, say)
    k = min(cfg.topk, len(opened.class_names))
    if k < cfg.topk:
        say(f"--topk {cfg.topk}: the model has {k} classes, so all {k} are listed")
    mode, why = val_precision(cfg.precision, cfg.amp, opened.trained, device)
    how = f"{mode}: {why}; --precision fp32 to change" if mode != "fp32" else why
    tta = f", tta {cfg.tta}" if cfg.tta != "none" else ""
    stride = f", every {cfg.vid_stride}th frame" if source.video is not None and cfg.vid_stride > 1 else ""
    say(f"predicting {source.what}{stride} with {printable(cfg.weights)} ({device}, {opened.img_size}px, {how}{tta})")
    with contextlib.redirect_stdout(out_stream):  # the progress bar and the loader's lines
        preds, seconds = run(opened, source, cfg, device, mode)
    run_dir = new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
    write_csv(run_dir / CSV_NAME, preds, k, cfg.tta)
    if cfg.json:
        for p in preds:
            print(json_line(p, cfg.tta), flush=False)
        sys.stdout.flush()
    saved = save_images(run_dir / "images", preds, source, cfg.vid_stride) if cfg.save_images else 0
    rate = len(preds) / seconds if seconds > 0 else float("inf")
    what = ("frame" if source.video is not None else "image") + ("s" if len(preds) != 1 else "")
    say(f"{len(preds)} {what} in {seconds:.1f} s: {rate:.1f} img/s (decoding included{', x2 for tta' if tta else ''})")
    say(f"predictions in {run_dir / CSV_NAME}" + (f"; {saved} annotated {what} in {run_dir / 'images'}/" if saved
                                                   else ""))
    return 0
