"""Validation metrics and reports: `dlenv val`.

`main` rebuilds the model from a run file alone (architecture, classes and image size are stored in
it; `--model` only names the architecture of a bare state dict from another tool), runs it over a
folder of class folders, prints loss, top-1, top-5 and a per-class precision/recall/F1 table, and
writes the reports into `--out` (default: val/ in the run file's run folder, `run_folder`; val-<data>/ for
other data, `report_folder`):

    metrics.json           everything below, machine-readable
    per_class.csv          precision, recall, F1, support per class, then macro and weighted averages
    confusion_matrix.csv   rows: true class, columns: predicted class
    confusion_matrix.png   counts and row-normalized, side by side
    errors.csv             path, true class, predicted class, confidence; most confident mistakes first

Each file is written to a temporary file and `os.replace`d, so a report is whole or absent. The
building blocks `resolve_device`, `predict` and `compute_metrics` are shared with `dlenv.compress`,
which re-validates what it changes. Metrics come from scikit-learn and torch.topk, not hand-written.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from dlenv import compat, invocation
from dlenv.cluster.devices import resolve_device
from dlenv.data.demo import ensure_demo_data
from dlenv.data.folder import class_key, find_layout
from dlenv.data.loaders import build_eval_loader
from dlenv.engine.precision import Precision, resolve_precision
from dlenv.errors import EXIT_NONFINITE, UserError, need_folder, printable
from dlenv.files.atomic import check_output, write_bytes
from dlenv.files.weights import LoadPolicy
from dlenv.progress import Progress
from dlenv.runfolder import drawing
from dlenv.runfolder.plots import save_figure
from dlenv.runfolder.trained import RUN_FILE, STATE_DICT, open_trained

#: the report files `main` writes, in the order it writes them
REPORT_FILES = ("metrics.json", "per_class.csv", "confusion_matrix.csv", "confusion_matrix.png", "errors.csv")


# ---------------------------------------------------------------------------------------------------
# Building blocks (also used by dlenv.compress).


def predict(model: torch.nn.Module, loader: Any, device: torch.device | str, amp: bool = False,
            mode: str | None = None, progress: bool = False, what: str = "validating"):
    """Run `model` (moved to `device`, in eval mode) over `loader`'s (images, labels) batches.

    `mode` ("fp32", "fp16", "bf16") is the precision of the forward, through the toolkit's one
    mixed-precision path; without it `amp` picks bf16/fp16 as `dlenv.engine.precision` chooses for the device.
    `progress` shows a time-based bar (a line every few seconds in a log) named `what`. Returns (logits, targets):
    a float32 CPU tensor [N, num_classes] and an int64 CPU tensor [N], in the loader's order.
    """

    device = torch.device(device)
    precision = Precision(mode or resolve_precision(amp, "auto", device), device)
    model = model.to(device).eval()
    non_blocking = device.type == "cuda"
    all_logits, all_targets = [], []
    total = len(loader) if hasattr(loader, "__len__") else None
    bar = Progress(total, what, enabled=progress, unit="batch")
    try:
        with torch.inference_mode():
            for i, (images, labels) in enumerate(loader, 1):
                images = images.to(device, non_blocking=non_blocking)
                with precision.autocast():
                    out = model(images)
                all_logits.append(out.float().cpu())
                all_targets.append(torch.as_tensor(labels).long().cpu())
                bar.update(i)
    finally:
        bar.close()
    if not all_logits:
        return torch.zeros(0, 0), torch.zeros(0, dtype=torch.long)
    return torch.cat(all_logits), torch.cat(all_targets)


def _cpu_bf16_autocast_works() -> bool:
    """Whether this CPU build runs a matmul under bf16 autocast (a probe, not a version check)."""

    try:
        with compat.autocast("cpu", torch.bfloat16, enabled=True):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    except (RuntimeError, TypeError):
        return False


def val_precision(asked: str, amp: bool, trained: str | None, device: torch.device) -> tuple[str, str]:
    """(mode, why) to validate in: `asked` unless "auto", else the precision the model trained in.

    `trained` is dlenv.runfolder.trained.Trained.precision: fp32, amp (the device's dtype), fp16 or bf16, None when
    the file does not say (fp32). A dtype this device lacks falls back (fp16 on a CPU -> bf16; bf16 on a
    GPU without it -> fp16; no CPU bf16 -> fp32) and `why` says so. Raises UserError for an explicit
    dtype this device cannot run.
    """

    if asked != "auto":
        mode = "fp32" if asked == "fp32" else resolve_precision(True, asked, device)
        return mode, f"--precision {asked}"
    if trained in (None, "fp32") and not amp:
        return "fp32", "fp32 as trained" if trained else "fp32 (the file does not say)"
    want = "auto" if trained in (None, "fp32", "amp") else trained
    source = f"trained with --amp ({want})" if trained not in (None, "fp32") else "--amp"
    if device.type == "cpu":
        if not _cpu_bf16_autocast_works():
            return "fp32", f"{source}, but this CPU build has no bf16 autocast: fp32 (results may differ a little)"
        note = "" if want in ("bf16", "auto") else ": bf16 on the CPU (CPU autocast has no fp16)"
        return "bf16", source + note
    if device.type == "cuda" and want == "bf16" and not torch.cuda.is_bf16_supported():
        return "fp16", f"{source}: fp16, this GPU has no bf16"
    return resolve_precision(True, want, device), source


def _avg(p: Any, r: Any, f: Any, support: int) -> dict[str, float]:
    return {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(support)}


def compute_metrics(logits: torch.Tensor, targets: torch.Tensor, class_names: list[str]) -> dict[str, Any]:
    """Loss, accuracy and the per-class report of `logits` [N, C] against `targets` [N].

    Returns a dict of plain types:
      num_samples, num_classes, class_names,
      loss (mean cross-entropy), top1, top5 (in %; top5 is top-min(5, C), named by top5_k),
      per_class: [{class, precision, recall, f1, support}] (fractions 0-1, scikit-learn's definitions,
      0 where undefined), macro_avg and weighted_avg (same keys), confusion_matrix (list of lists,
      rows = true class, columns = predicted class, in class_names order).
    Raises ValueError for empty input or logits whose width is not len(class_names).
    """
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    logits = logits.detach().float().cpu()
    targets = targets.detach().long().cpu()
    n, c = (logits.shape[0], logits.shape[1]) if logits.ndim == 2 else (0, 0)
    if n == 0:
        raise ValueError("no samples to compute metrics on")
    if c != len(class_names):
        raise ValueError(f"logits have {c} columns but there are {len(class_names)} class names")
    k = min(5, c)
    topk = torch.topk(logits, k, dim=1).indices
    hit = topk == targets[:, None]
    preds = topk[:, 0].numpy()
    y = targets.numpy()
    labels = list(range(c))
    p, r, f, s = precision_recall_fscore_support(y, preds, labels=labels, average=None, zero_division=0)
    macro = precision_recall_fscore_support(y, preds, labels=labels, average="macro", zero_division=0)
    weighted = precision_recall_fscore_support(y, preds, labels=labels, average="weighted", zero_division=0)
    return {
        "num_samples": int(n),
        "num_classes": int(c),
        "class_names": list(class_names),
        "loss": float(torch.nn.functional.cross_entropy(logits, targets)),
        "top1": float(hit[:, 0].float().mean() * 100),
        "top5": float(hit.any(dim=1).float().mean() * 100),
        "top5_k": int(k),
        "per_class": [{"class": name, **_avg(p[i], r[i], f[i], s[i])} for i, name in enumerate(class_names)],
        "macro_avg": _avg(*macro[:3], n),
        "weighted_avg": _avg(*weighted[:3], n),
        "confusion_matrix": confusion_matrix(y, preds, labels=labels).tolist(),
    }


def refuse_non_finite(logits: torch.Tensor, model: torch.nn.Module, mode: str, weights: Any,
                      cause: str | None = None) -> None:
    """Raise UserError (exit EXIT_NONFINITE) when any output is NaN or inf.

    torch.argmax over a row of NaNs returns 0, so weights that are all NaN "predict" the first class
    for every image and score its share of the data (33% on three balanced classes): a number that
    looks like a result. The line names the non-finite weight tensors, when there are any, or else
    the precision (fp16 overflows to inf where fp32 does not); `cause` where the caller knows it (prune).
    """
    finite = torch.isfinite(logits).all(dim=1) if logits.numel() else torch.ones(0, dtype=torch.bool)
    if bool(finite.all()):
        return
    n_bad, n = int((~finite).sum()), len(finite)
    broken = [name for name, t in model.state_dict().items()
              if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    what = f"{n_bad} of {n} images" if n_bad < n else f"every one of the {n} images"
    if broken:
        found = (f"{len(broken)} of its weight tensors hold NaN or inf (e.g. {broken[0]}): the run that saved it "
                 "diverged or the file is damaged; validate an earlier run file (last.pth, best_model.pth)")
    elif mode != "fp32":
        found = f"its weights are finite, so {mode} overflowed; validate with --precision fp32"
    else:
        found = "its weights are finite but the model's outputs are not; check the model (--model) and its inputs"
    raise UserError(f"{weights} gives NaN or inf outputs for {what}, so no accuracy can be reported; {cause or found}",
                    exit_code=EXIT_NONFINITE)


def error_rows(logits: torch.Tensor, targets: torch.Tensor, paths: list[str],
               class_names: list[str]) -> list[dict[str, Any]]:
    """The misclassified samples, most confident mistakes first.

    Returns [{path, true_class, predicted_class, confidence}] where confidence is the softmax
    probability of the predicted class; ties keep the data's order.
    """
    probs = torch.softmax(logits.float(), dim=1)
    conf, pred = probs.max(dim=1)
    wrong = (pred != targets).nonzero().flatten().tolist()
    wrong.sort(key=lambda i: -float(conf[i]))  # stable: equal confidences stay in data order
    return [{"path": str(paths[i]), "true_class": class_names[int(targets[i])],
             "predicted_class": class_names[int(pred[i])], "confidence": round(float(conf[i]), 6)}
            for i in wrong]


# ---------------------------------------------------------------------------------------------------
# Reports.


def format_report(m: dict[str, Any]) -> str:
    """The printed report: loss and accuracy, then a per-class table with macro and weighted averages."""
    names = [printable(row["class"]) for row in m["per_class"]]  # a newline or bidi override in a folder name
    width = max([len(n) for n in names] + [len("weighted avg")])
    top5 = "top-5" if m["top5_k"] == 5 else f"top-{m['top5_k']}"
    lines = [f"{m['num_samples']} images, {m['num_classes']} classes: loss {m['loss']:.4f}  "
             f"top-1 {m['top1']:.2f}%  {top5} {m['top5']:.2f}%", "",
             f"{'class':<{width}}  precision  recall     f1  support"]
    rows = [*zip(names, m["per_class"], strict=True), ("", None)]
    rows += [("macro avg", m["macro_avg"]), ("weighted avg", m["weighted_avg"])]
    for name, r in rows:
        if r is None:
            lines.append("")
            continue
        lines.append(f"{name:<{width}}  {r['precision']:9.3f}  {r['recall']:6.3f}  {r['f1']:5.3f}  "
                     f"{r['support']:7d}")
    return "\n".join(lines)


#: what a spreadsheet takes a cell starting with for a formula (OWASP, "CSV Injection"): `=HYPERLINK(...)` as a
#: class folder's or an image's name would run when predictions.csv is opened
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")


def csv_cell(value: Any) -> Any:
    """`value` for a CSV cell a spreadsheet may open: text that would start a formula gets a leading `'`, as
    OWASP advises; numbers, and text that is a plain number (a class named -1), are left as they are."""
    if not isinstance(value, str) or not value.startswith(_FORMULA_START):
        return value
    try:
        float(value)
        return value  # -1, +3.5: a number, which no spreadsheet runs
    except ValueError:
        return "'" + value


def _csv_bytes(header: list[str], rows: list[list[Any]]) -> bytes:
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow([csv_cell(v) for v in header])
    w.writerows([csv_cell(v) for v in row] for row in rows)
    return buf.getvalue().encode("utf-8")


def _short(name: str, limit: int = 22) -> str:
    """A long class name cut in the middle, so names that share a prefix stay distinguishable."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[-(limit - 1 - head):]


@drawing.settings()
def plot_confusion(cm: list[list[int]], class_names: list[str], title: str | None = None):
    """Figure of the confusion matrix: counts (left) and row-normalized in % (right), under `title`.

    Cells carry their numbers up to 25 classes; the figure grows with the class count so 2-50
    classes stay readable. Returns a matplotlib Figure (Agg, no pyplot) drawn with dlenv's settings
    alone: a class named `c$\\frac$` is those characters, not math.
    """
    import numpy as np

    counts = np.asarray(cm, dtype=float)
    c = len(class_names)
    rows = counts.sum(axis=1, keepdims=True)
    normed = np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0) * 100
    cell = 0.55 if c <= 10 else 0.4 if c <= 25 else 0.28
    labels = [_short(n) for n in class_names]
    label_room = 0.09 * max(len(s) for s in labels) + 0.6
    side = max(3.5, c * cell) + label_room
    fig = drawing.new_figure(figsize=(2 * side + 3.0, side + (1.3 if title else 0.8)), layout="constrained")
    fig.get_layout_engine().set(w_pad=0.15)
    if title:
        fig.suptitle(title, fontsize=13)
    axes = fig.subplots(1, 2)
    tick_fs = 10 if c <= 10 else 8 if c <= 25 else 7
    cell_fs = 10 if c <= 10 else 7 if c <= 18 else 6
    for ax, data, title, fmt, bar in (
            (axes[0], counts, f"Counts ({int(counts.sum())} images)", "{:.0f}", "images"),
            (axes[1], normed, "Row-normalized (recall per true class)", "{:.0f}", "% of the true class")):
        im = ax.imshow(data, cmap="Blues", vmin=0, vmax=100 if data is normed else max(1.0, data.max()))
        ax.set_title(title)
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
        ax.set_xticks(range(c))
        ax.set_yticks(range(c))
        ax.set_xticklabels(labels, rotation=45 if c <= 10 else 90, ha="right" if c <= 10 else "center",
                           rotation_mode="anchor" if c <= 10 else "default", fontsize=tick_fs)
        ax.set_yticklabels(labels, fontsize=tick_fs)
        fig.colorbar(im, ax=ax, shrink=0.8, label=bar)
        if c <= 25:
            top = im.norm.vmax
            for i in range(c):
                for j in range(c):
                    v = data[i, j]
                    if v == 0 and data is normed:
                        continue
                    ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=cell_fs,
                            color="white" if v > 0.6 * top else "black")
    return fig


def write_reports(out: Path, metrics: dict[str, Any], errors: list[dict[str, Any]]) -> list[Path]:
    """Write the five report files into `out` (created if needed), each atomically; returns their paths."""

    out.mkdir(parents=True, exist_ok=True)
    names = metrics["class_names"]
    fields = ["precision", "recall", "f1", "support"]
    per_class = [[r["class"], *(round(r[k], 6) for k in fields)] for r in metrics["per_class"]]
    per_class += [[label, *(round(metrics[key][k], 6) for k in fields)]
                  for label, key in (("macro avg", "macro_avg"), ("weighted avg", "weighted_avg"))]
    cm = metrics["confusion_matrix"]
    write_bytes(out / "metrics.json", (json.dumps(metrics, indent=2) + "\n").encode("utf-8"))
    write_bytes(out / "per_class.csv", _csv_bytes(["class", *fields], per_class))
    write_bytes(out / "confusion_matrix.csv",
                _csv_bytes(["true \\ predicted", *names], [[n, *row] for n, row in zip(names, cm, strict=True)]))
    cols = ["path", "true_class", "predicted_class", "confidence"]
    write_bytes(out / "errors.csv", _csv_bytes(cols, [[e[k] for k in cols] for e in errors]))
    # the figure last: every table is on disk whatever happens while it is drawn
    title = (f"Confusion matrix: {metrics.get('weights', 'model')} on {metrics.get('data', 'data')} "
             f"(top-1 {metrics['top1']:.1f}%)")
    save_figure(plot_confusion(cm, names, title), out / "confusion_matrix.png")
    return [out / f for f in REPORT_FILES]


# ---------------------------------------------------------------------------------------------------
# `dlenv val`.


def _samples_of(root: Path, val_split: float, seed: int, trained_on: bool) -> tuple[list, list[str], str]:
    """(samples, classes, what) to validate on from a dataset folder.

    A dataset with a val/ folder gives its val split. Class folders only give all their images (a
    val folder passed with --data), or, when the model was `trained_on` this folder, the part that
    training held out with the same `val_split` and `seed`; so does a train/ without val/.
    """

    has_train = any(p.is_dir() and p.name.lower() == "train" for p in root.iterdir())
    if not has_train and not trained_on:  # a folder of class folders: every image is validation data
        layout = find_layout(root, val_split=0.0, seed=seed)
        return list(layout.train), list(layout.classes), "all images"
    layout = find_layout(root, val_split=val_split, seed=seed)
    if layout.split == "folders":
        return list(layout.val), list(layout.classes), "its val/ folder"
    return list(layout.val), list(layout.classes), f"the {val_split:g} held out for validation (seed {seed})"


def resolve_data(data: str | None, run_file: Any) -> tuple[Path, list, list[str], str]:
    """(root, samples, classes, what) to validate on: `data` (--data), else the data the run file was
    trained on (the part it held out), else the demo data when it was trained on that."""
    train_cfg = run_file.get("config") if isinstance(run_file, dict) else None
    train_cfg = train_cfg if isinstance(train_cfg, dict) else {}
    val_split = float(train_cfg.get("val_split") or 0.2)
    seed = int(train_cfg.get("seed") or 0)
    if data:
        root = Path(data)
        need_folder(root, "--data", "pass a folder of class folders or a dataset with val/")
        return (root, *_samples_of(root, val_split, seed, trained_on=False))
    if not train_cfg:
        raise UserError("this run file does not say what data it was trained on; pass --data FOLDER")
    if train_cfg.get("synthetic"):
        raise UserError("this run file was trained on synthetic data (--synthetic); pass --data FOLDER")
    if train_cfg.get("data"):
        root = Path(train_cfg["data"])
        if not root.is_dir():
            raise UserError(f"the run file was trained on {root}, which is not found from here; "
                            "pass --data FOLDER")
    else:

        root = Path(ensure_demo_data())  # what `dlenv train` without --data trained on
    return (root, *_samples_of(root, val_split, seed, trained_on=True))


def match_classes(data_classes: list[str], trained_classes: list[str], bare: bool, where: Path) -> list[int]:
    """Map each data class index to the run file's class index; UserError naming any difference.

    A bare state dict has no class names: the data's (sorted) classes are taken when the counts agree.
    Names are compared in Unicode NFC (a folder spelled NFD on one machine is the same class).
    """
    data_classes, trained_classes = [class_key(c) for c in data_classes], [class_key(c) for c in trained_classes]
    if bare:
        if len(data_classes) != len(trained_classes):
            raise UserError(f"{where} has {len(data_classes)} classes but the state dict's head has "
                            f"{len(trained_classes)} outputs; pass data with the classes it was trained on")
        return list(range(len(data_classes)))
    missing = [c for c in trained_classes if c not in data_classes]
    extra = [c for c in data_classes if c not in trained_classes]
    if missing or extra:
        def some(xs: list[str]) -> str:
            return ", ".join(xs[:8]) + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")
        parts = ([f"missing {len(missing)} of the run file's classes ({some(missing)})"] if missing else [])
        parts += [f"has {len(extra)} class(es) the run file does not know ({some(extra)})"] if extra else []
        raise UserError(f"{where} {' and '.join(parts)}; validate on data with the run file's "
                        f"{len(trained_classes)} classes")
    return [trained_classes.index(c) for c in data_classes]


def run_folder(weights: Path) -> Path:
    """The folder a run file's reports go to without --out: the one the file lies in, a link followed to
    its target (a best_model.pth linked into the folder `val` is started from reports into its run
    folder), never the folder `val` happens to be started from."""
    return Path(os.path.realpath(weights)).parent if weights.is_symlink() else weights.parent


def report_folder(run_dir: Path, data: Path) -> Path:
    """Where `val` writes without --out: <run_dir>/val, unless it holds the report on other data; then
    val-<data folder's name> (its dataset's for a val/, test/ or train/ folder: data/digits/val gives
    val-digits; val-<name>-2, ... when that is taken too), said in one line. A report on
    the same data replaces its own folder, as before."""
    def free(folder: Path) -> bool:
        if not folder.exists():
            return True
        try:
            return json.loads((folder / "metrics.json").read_text()).get("data") == str(data)
        except (OSError, ValueError, AttributeError):
            return not any(folder.iterdir()) if folder.is_dir() else False

    first = run_dir / "val"
    # data/digits/val is named by its dataset: val-digits, not val-val
    split = data.name.lower() in ("val", "valid", "validation", "test", "train") and data.parent.name
    label = (data.parent.name if split else data.name) or "data"
    candidates = [first, run_dir / f"val-{label}"] + [run_dir / f"val-{label}-{i}" for i in range(2, 1000)]
    folder = next(f for f in candidates if free(f))
    if folder != first:
        print(f"reports go to {folder}/: {first}/ holds the report on other data (--out chooses the folder)")
    return folder


def main(cfg: Any) -> int:
    """`dlenv val`: validate cfg.weights on cfg.data and write the reports. Returns 0.

    Raises UserError for a missing/unsafe/corrupt run file, a bare state dict without --model, data
    that is missing or has other classes than the run file, or a bad --device.
    """

    if not cfg.weights:
        raise UserError("--weights is required: the run file to validate (e.g. runs/exp/best_model.pth)")
    weights = Path(cfg.weights)
    if cfg.out:  # a bad --out fails before the run file is read
        check_output(cfg.out, "--out", folder=True)
    device = resolve_device(cfg.device)
    trained = open_trained(weights, LoadPolicy.of(cfg), cfg.model, kinds=(RUN_FILE, STATE_DICT), verb="val",
                           img_size=cfg.img_size, prep={"normalize": cfg.normalize, "resize": cfg.resize})
    model, class_names = trained.model, list(trained.class_names)
    bare = trained.kind == STATE_DICT
    root, samples, data_classes, what = resolve_data(cfg.data, trained.run_file)
    if not samples:
        raise UserError(f"no images to validate on in {root}; pass --data with class folders of images")
    out = check_output(cfg.out or report_folder(run_folder(weights), root), "--out", folder=True)
    remap = match_classes(data_classes, class_names, bare, root)
    if bare:
        class_names = list(data_classes)
    samples = [(path, remap[idx]) for path, idx in samples]
    size = trained.img_size
    loader = build_eval_loader(samples, size, cfg.batch_size, cfg.workers,  # sized there (decide_workers)
                               # --pretrained weights' own mean, std and resampling
                               norm=trained.norm, interpolation=trained.interpolation,
                               crop=trained.resize != "full")
    mode, why = val_precision(cfg.precision, cfg.amp, trained.precision, device)
    how = f"{mode}: {why}; --precision fp32 to change" if mode != "fp32" else why
    print(f"validating {weights} on {len(samples)} images from {root}, {what} ({device}, {size}px, {how})")
    logits, targets = predict(model, loader, device, mode=mode, progress=True)
    paths = [p for p, _ in samples]
    bad = set(getattr(loader, "bad_paths", {}))
    if bad:  # a skipped file's slot holds a substitute image: drop its prediction
        keep = torch.tensor([p not in bad for p in paths])
        logits, targets = logits[keep], targets[keep]
        paths = [p for p in paths if p not in bad]
        print(f"{len(bad)} unreadable image(s) left out; list them with "
              f"{invocation.command('data-report', f'{root} --check-images')}")
    if len(targets) == 0:
        raise UserError(f"none of the images in {root} could be read; check them with "
                        f"{invocation.command('data-report', f'{root} --check-images')}")
    refuse_non_finite(logits, model, mode, weights)  # before any report: argmax of NaN is class 0
    metrics = compute_metrics(logits, targets, class_names)
    metrics.update({"weights": str(weights), "data": str(root), "img_size": int(size),
                    "normalize": [list(v) for v in trained.norm] if trained.norm else "imagenet",
                    "resize": trained.resize, "device": str(device), "amp": mode != "fp32", "precision": mode})
    errors = error_rows(logits, targets, paths, class_names)
    print(format_report(metrics))
    write_reports(out, metrics, errors)
    print(f"\nreports in {out}/: {', '.join(REPORT_FILES)} ({len(errors)} errors listed)")
    return 0
