"""Predictions on unlabelled images: `dlenv predict --weights best_model.pth --source photos/`.

The model is opened by dlenv.runfolder.trained.open_trained, as `dlenv val` opens it (the guarded load under the
command's --trust-pickle, the check of the saved options, the rebuild with the rule for a model of your
own), so a file val refuses is refused here in the same words; predict also takes an ONNX export (run
by onnxruntime) and, with consent, a TorchScript one. Its preprocessing is val's too: resize and centre
crop at the model's image size, its normalisation and resampling, in the precision it trained in
(`evaluate.val_precision`), batched through `evaluate.predict`.

`--source` is an image, a folder (recursively, images only), a glob, a video (OpenCV, every
`--vid-stride`-th frame) or `-` for paths on standard input. An unreadable image is skipped with one
line (the first few named, then counted: dlenv.data.badimages); nothing readable at all is an error.
Up to SHOWN images get one line each on the terminal (class and probability); at the default place a
few images leave no run folder (`keeps_run`: one call per photo would litter runs/predict/). Otherwise
the results go to runs/predict/<name>/predictions.csv, written whole or not at all (dlenv.files.atomic):
path, frame (for a video), tta, then class_i and prob_i for i = 1..top-k. `--json` prints the same
as JSON lines on stdout; `--save-images` writes annotated copies into <run>/images/ and, for more than
one image, contact sheets (a grid of thumbnails, each with its top class and probability) into <run>/.

A TorchScript export is a program: torch.jit.load runs the code it holds, so it opens only with
--trust-pickle, and since it stores neither class names nor image size, with --classes and --img-size.
An ONNX export carries both in its metadata (dlenv.files.onnxmodel).
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlenv.cluster.devices import resolve_device
from dlenv.data.badimages import BadImageError
from dlenv.data.decode import load_rgb
from dlenv.data.folder import IMAGE_EXTS, is_image
from dlenv.data.loaders import build_eval_loader, build_transforms
from dlenv.errors import UserError, optional_import, printable
from dlenv.evaluate import csv_cell, predict, refuse_non_finite, val_precision
from dlenv.files import safeio
from dlenv.files.atomic import check_output, write_atomic, write_file
from dlenv.files.onnxmodel import OnnxModule
from dlenv.files.weights import LoadPolicy
from dlenv.options.predict_options import PredictConfig
from dlenv.runfolder import BEST, new_run_dir
from dlenv.runfolder.trained import Trained, open_trained

#: file name endings `--source FILE` reads as a video (anything else named alone is read as an image)
VIDEO_EXTS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv"})
#: the file of the predictions inside the run folder
CSV_NAME = "predictions.csv"
#: up to this many images, predict prints each one's answer (more: the CSV holds them), and writes no
#: run folder unless asked (`keeps_run`)
SHOWN = 8


@dataclass
class Source:
    """What to predict: image paths, or one video (`video` set, `paths` empty)."""

    paths: list[str]
    video: Path | None
    what: str


# ---------------------------------------------------------------------------------------------------
# The model.


def open_model(cfg: Any, device: torch.device, say: Any = print) -> Trained:
    """The model cfg.weights holds (any kind dlenv.runfolder.trained opens), with --classes and --img-size."""

    return open_trained(cfg.weights, LoadPolicy.of(cfg), cfg.model, verb="predict", classes=cfg.classes,
                        img_size=cfg.img_size, device=device, say=say,
                        prep={"normalize": cfg.normalize, "resize": cfg.resize})


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
    cv2 = optional_import("cv2", "reading a video needs OpenCV (opencv-python-headless, in requirements.txt)")
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


def _video_batches(path: Path, stride: int, opened: Trained, batch_size: int) -> Iterator[tuple[torch.Tensor, Any]]:
    """(images, frame numbers) batches of the video through val's eval transform."""

    transform = build_transforms(opened.img_size, False, norm=opened.norm, interpolation=opened.interpolation,
                                 crop=opened.resize != "full")
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


def run(opened: Trained, source: Source, cfg: Any, device: torch.device, mode: str) -> tuple[list[Prediction], float]:
    """(predictions in source order, seconds the pass took). Unreadable images are left out, said in
    one line each for the first few, then counted. Raises UserError when nothing could be read, and
    (dlenv.evaluate.refuse_non_finite) for NaN or inf outputs."""

    net = FlipAverage(opened.model) if cfg.tta == "flip" else opened.model
    t0 = time.perf_counter()
    if source.video is not None:
        batches = _video_batches(source.video, cfg.vid_stride, opened, cfg.batch_size)
        logits, keys = predict(net, batches, device, mode=mode, progress=True, what="predicting")
        paths, frames = [str(source.video)] * len(keys), keys.tolist()
    else:
        samples = [(p, i) for i, p in enumerate(source.paths)]  # the label is the index: each row's path
        loader = build_eval_loader(samples, opened.img_size, cfg.batch_size, cfg.workers, norm=opened.norm,
                                   interpolation=opened.interpolation, crop=opened.resize != "full")
        try:
            logits, _ = predict(net, loader, device, mode=mode, progress=True, what="predicting")
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
    """One row of predictions.csv: a path or class name that would start a spreadsheet formula is quoted
    (dlenv.evaluate.csv_cell), as class names come from a file and paths from the user's folder."""
    return [csv_cell(p.path), "" if p.frame is None else p.frame, tta,
            *(v for name, q in p.top for v in (csv_cell(name), f"{q:.6f}"))]


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


#: a contact sheet's grid: thumbnails of CELL pixels, COLUMNS a row, at most SHEET_MAX images a sheet
CELL, COLUMNS, SHEET_MAX = 160, 10, 100
#: the height of the caption under each thumbnail (two lines: the top class and probability, the file name)
CAPTION = 28


def caption(name: str, q: float) -> str:
    """A thumbnail's caption on a contact sheet: the class (printable, cut to 16 characters with "...") and its
    probability, two spaces apart, so "cat  87%" never reads as one word even where a long name is cut."""
    name = printable(name)
    return f"{name if len(name) <= 16 else name[:13] + '...'}  {q:.0%}"


def _sheet(cells: list[tuple[Any, str, str]]) -> Any:
    """One contact sheet: each (image, caption, name) as a thumbnail with its caption below, in a grid."""
    from PIL import Image, ImageDraw

    cols = min(COLUMNS, len(cells))
    rows = -(-len(cells) // cols)
    sheet = Image.new("RGB", (cols * CELL, rows * (CELL + CAPTION)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (im, caption, name) in enumerate(cells):
        x, y = (i % cols) * CELL, (i // cols) * (CELL + CAPTION)
        scale = min((CELL - 4) / im.width, (CELL - 4) / im.height)  # small images are scaled up to be seen
        thumb = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))))
        sheet.paste(thumb, (x + (CELL - thumb.width) // 2, y + (CELL - thumb.height) // 2))
        draw.text((x + 3, y + CELL), caption, fill=(0, 0, 0))
        draw.text((x + 3, y + CELL + 13), name if len(name) <= 24 else name[:11] + "..." + name[-10:],
                  fill=(90, 90, 90))
    return sheet


def save_images(run_dir: Path, preds: list[Prediction], source: Source, stride: int) -> tuple[int, list[Path]]:
    """Annotated copies of the predicted images (or frames) in <run_dir>/images, and for more than one
    image (a folder, a glob, stdin) contact sheets in run_dir: contact_sheet.jpg (contact_sheet_2.jpg, ...
    past SHEET_MAX images), each image's thumbnail with its top class and probability. Every file is
    written atomically. Returns (annotated copies written, sheets written). A name met twice (a glob over
    folders) gets -2, -3, ..."""
    from PIL import Image


    folder = run_dir / "images"
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
        return len(by_frame), []
    sheets: list[Path] = []
    cells: list[tuple[Any, str, str]] = []

    def flush() -> None:
        name = "contact_sheet.jpg" if not sheets else f"contact_sheet_{len(sheets) + 1}.jpg"
        grid = _sheet(cells)
        write_atomic(run_dir / name, lambda tmp: grid.save(tmp, format="JPEG", quality=90))
        sheets.append(run_dir / name)
        cells.clear()

    for p in preds:
        im = load_rgb(p.path)
        save(im, os.path.basename(p.path), p.top[0])
        if len(preds) > 1:
            thumb = im.copy()
            thumb.thumbnail((CELL, CELL))  # only the thumbnail is kept until its sheet is written
            cells.append((thumb, caption(*p.top[0]), os.path.basename(p.path)))
            if len(cells) == SHEET_MAX:
                flush()
    if cells:
        flush()
    return len(preds), sheets


# ---------------------------------------------------------------------------------------------------
# `dlenv predict`.


def main(cfg: Any) -> int:
    """`dlenv predict`: predict cfg.source with cfg.weights and write predictions.csv. Returns 0.

    Raises UserError for a missing or unreadable source or model (see `find_source`, `open_model`), a
    source with nothing readable in it, and NaN or inf outputs.
    """

    if not cfg.weights:
        raise UserError(f"--weights is required: the trained model to predict with (e.g. runs/exp/{BEST})")
    out_stream = sys.stderr if cfg.json else sys.stdout  # --json: stdout holds the JSON lines alone

    def say(line: str) -> None:
        print(line, file=out_stream, flush=True)

    source = find_source(cfg.source)
    device = resolve_device(cfg.device)
    opened = open_model(cfg, device, say)
    try:
        return _predict(cfg, source, device, opened, say, out_stream)
    finally:  # an ONNX file from elsewhere runs in a child process: it ends with the command, stopped or not
        if isinstance(opened.model, OnnxModule):
            opened.model.close()


def _predict(cfg: Any, source: Source, device: torch.device, opened: Trained, say: Any, out_stream: Any) -> int:
    k = min(cfg.topk, len(opened.class_names))
    if k < cfg.topk:
        say(f"--topk {cfg.topk}: the model has {k} classes, so all {k} are listed")
    mode, why = val_precision(cfg.precision, cfg.amp, opened.precision, device)
    how = f"{mode}: {why}; --precision fp32 to change" if mode != "fp32" else why
    tta = f", tta {cfg.tta}" if cfg.tta != "none" else ""
    stride = f", every {cfg.vid_stride}th frame" if source.video is not None and cfg.vid_stride > 1 else ""
    if keeps_run(cfg, len(source.paths), source.video is not None):  # a folder it cannot write: before the work
        check_output(Path(cfg.project) / cfg.name, "--project", folder=True)
    say(f"predicting {source.what}{stride} with {printable(cfg.weights)} ({device}, {opened.img_size}px, {how}{tta})")
    with contextlib.redirect_stdout(out_stream):  # the progress bar and the loader's lines
        preds, seconds = run(opened, source, cfg, device, mode)
    if cfg.json:
        for p in preds:
            print(json_line(p, cfg.tta), flush=False)
        sys.stdout.flush()
    elif len(preds) <= SHOWN and source.video is None:
        for line in answer_lines(preds):
            say(line)
    rate = len(preds) / seconds if seconds > 0 else float("inf")
    what = ("frame" if source.video is not None else "image") + ("s" if len(preds) != 1 else "")
    say(f"{len(preds)} {what} in {seconds:.1f} s: {rate:.1f} img/s (decoding included{', x2 for tta' if tta else ''})")
    if not keeps_run(cfg, len(preds), source.video is not None):
        say(f"no run folder for {len(preds)} {what} (the answers are above); --save-images, --name or --project "
            f"writes {CSV_NAME} into {cfg.project}/<name>/")
        return 0
    run_dir = new_run_dir(cfg.project, cfg.name, cfg.exist_ok)
    write_csv(run_dir / CSV_NAME, preds, k, cfg.tta)
    saved, sheets = save_images(run_dir, preds, source, cfg.vid_stride) if cfg.save_images else (0, [])
    say(f"predictions in {run_dir / CSV_NAME}" + (f"; {saved} annotated {what} in {run_dir / 'images'}/" if saved
                                                   else "")
        + (f"; contact sheet{'s' if len(sheets) > 1 else ''} {', '.join(p.name for p in sheets)}" if sheets else ""))
    return 0


def keeps_run(cfg: Any, n: int, video: bool) -> bool:
    """Whether predict writes a run folder (predictions.csv): for more than SHOWN images, a video, or when
    asked (--save-images, a --project, --name or --exist-ok of the user's). A few images, at the default
    place, are answered on the terminal only, so that one call per photo leaves no runs/predict/expN."""

    default = PredictConfig()
    asked = cfg.save_images or cfg.exist_ok or cfg.project != default.project or cfg.name != default.name
    return bool(asked or video or n > SHOWN)


def answer_lines(preds: list[Prediction]) -> list[str]:
    """One line per image: its name, its top class and probability, and the rest of its --topk (the line
    --topk's note promises: every class listed when the model has fewer). Names are written as
    train's data report writes them (dlenv.errors.printable): a class name from a file's metadata or a
    dataset's folders that holds an escape sequence, a newline or U+202E shows it instead of acting on the
    terminal."""
    width = max(len(printable(p.path)) for p in preds)
    lines = []
    for p in preds:
        (best, q), *rest = p.top
        second = f"  (then {', '.join(f'{printable(n)} {v:.1%}' for n, v in rest)})" if rest else ""
        lines.append(f"  {printable(p.path):<{width}}  {printable(best)} {q:.1%}{second}")
    return lines
