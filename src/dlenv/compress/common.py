"""What dlenv.compress works on and how it measures it.

A command starts from a dlenv run file opened by dlenv.runfolder.trained.open_trained (`open_weights`): the
model rebuilt from it, its class names, image size and preprocessing. Data for re-validation comes
from `--data` or the data the run file was trained on (the same rules as `dlenv val`). The
measurements are the ones every compress report prints: top-1 on that data, parameters, serialized
size raw and zipped (zip deflate, as a download or an artifact store would compress it), and the
median CPU latency of one image with its spread (and the GPU's, where there is one).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import statistics
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from dlenv import compat
from dlenv.data.folder import find_layout
from dlenv.data.loaders import build_eval_loader
from dlenv.errors import UserError
from dlenv.evaluate import compute_metrics, match_classes, predict, refuse_non_finite, resolve_data
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.runfolder import BEST
from dlenv.runfolder.trained import RUN_FILE, Trained, open_trained


def open_weights(weights: str | None, verb: str, policy: LoadPolicy = SAFE, model: str | None = None) -> Trained:
    """The dlenv run file `weights` (--weights) names, opened by dlenv.runfolder.trained.open_trained (model on the
    CPU, in eval mode) under `policy` (--trust-pickle); `model` is --model (a model of your own named again).

    Raises UserError when --weights is missing, the file is missing/corrupt/unsafe, it is not a dlenv
    run file (a bare state dict, an export: no class names or image size to re-validate with), or the
    weights don't fit the architecture.
    """

    if not weights:
        raise UserError(f"--weights is required: the run file to {verb} (e.g. runs/exp/{BEST})")
    return open_trained(weights, policy, model, kinds=(RUN_FILE,), verb=verb)


def _val_data(data: str | None, src: Trained) -> tuple[Path, list[tuple[str, int]]]:
    """(root, samples) to measure on, with labels in the run file's class order (as `dlenv val`)."""

    root, samples, classes, _ = resolve_data(data, src.run_file)  # the same choice of data as `dlenv val` makes
    remap = match_classes(list(classes), src.class_names, False, root)
    samples = [(p, remap[i]) for p, i in samples]
    if not samples:
        raise UserError(f"no images in {root}; pass --data with class folders of images")
    return Path(root), samples


def eval_loader(data: str | None, src: Trained, batch_size: int, workers: int | str) -> tuple[Path, Any]:
    """(root, loader) over the images to re-validate on: --data, else the run file's own val data.

    Raises UserError when neither is there or its classes differ from the run file's.
    """

    root, samples = _val_data(data, src)
    return root, build_eval_loader(samples, src.img_size, batch_size, workers, norm=src.norm,
                                   interpolation=src.interpolation)


def train_layout(src: Trained) -> Any:
    """The training split of the data the run file was trained on, labels in its class order.

    Returns a dlenv.data.folder.Layout with an empty val split (for fine-tuning). Raises UserError
    when that data is not on this machine.
    """

    train_cfg = src.config
    root = Path(resolve_data(None, src.run_file)[0])
    layout = find_layout(root, val_split=float(train_cfg.get("val_split", 0.2)),
                         seed=int(train_cfg.get("seed", 0)))
    remap = match_classes(list(layout.classes), src.class_names, False, root)
    train = [(p, remap[i]) for p, i in layout.train]
    if not train:
        raise UserError(f"no training images in {root}; fine-tuning needs the data the run file was "
                        "trained on")
    return dataclasses.replace(layout, classes=src.class_names, train=train, val=[], test=[])


def top1(model: torch.nn.Module, loader: Any, device: torch.device | str, class_names: list[str],
         weights: Any = "the model", cause: str | None = None) -> float:
    """Top-1 accuracy in % of `model` over `loader` (evaluated on `device`). UserError (EXIT_NONFINITE) when an
    output is NaN or inf, naming `weights` and `cause` (dlenv.evaluate.refuse_non_finite): the argmax of NaN
    is class 0, an accuracy that looks real."""

    logits, targets = predict(model, loader, device)
    if len(targets) == 0:
        raise UserError("none of the validation images could be read; check them with invoke data-report")
    refuse_non_finite(logits, model, "fp32", weights, cause)
    return float(compute_metrics(logits, targets, class_names)["top1"])


def first_batch(loader: Any) -> torch.Tensor:
    """The first batch of images of a loader (CPU float tensor)."""
    for images, _ in loader:
        return images
    raise UserError("the data loader yielded no images; check the data with invoke data-report")


# ---------------------------------------------------------------------------------------------------
# Sizes and latency.


def zipped_size(data: bytes) -> int:
    """Bytes of `data` after zip deflate (level 6), the compression a download or upload would see."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        zf.writestr("model", data)
    return buf.tell()


def saved_sizes(obj: Any) -> tuple[int, int]:
    """(raw, zipped) bytes of torch.save(obj) (a state dict, a run file) or torch.jit.save(obj)."""
    buf = io.BytesIO()
    if isinstance(obj, torch.jit.ScriptModule):
        compat.jit_save(obj, buf)
    else:
        torch.save(obj, buf)
    raw = buf.getvalue()
    return len(raw), zipped_size(raw)


def file_sizes(path: str | Path) -> tuple[int, int]:
    """(raw, zipped) bytes of a file."""
    raw = Path(path).read_bytes()
    return len(raw), zipped_size(raw)


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float CPU copy of `model` in eval mode (the original may live on a GPU)."""
    return copy.deepcopy(model).float().cpu().eval()


#: the p10-p90 range of a model's times, as a share of its median, above which the numbers say more
#: about the machine's other work than about the model
WIDE_SPREAD = 0.5


@dataclasses.dataclass(frozen=True)
class Latency:
    """One model's CPU forward times: the median and the 10th/90th percentiles in ms, over `runs`."""

    median: float
    p10: float
    p90: float
    runs: int

    @property
    def spread(self) -> float:
        """p90 - p10 as a share of the median."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.median:.2f} ms ({self.p10:.2f}-{self.p90:.2f})"

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        ms = sorted(t * 1000 for t in seconds)

        def at(q: float) -> float:  # nearest rank: no interpolation needed for a spread
            return ms[round(q * (len(ms) - 1))]

        return cls(statistics.median(ms), at(0.1), at(0.9), len(ms))


def cpu_latencies(models: list[Any], img_size: int, batch: int = 1, min_runs: int = 15,
                  budget_s: float = 3.0) -> list[Latency]:
    """Each model's CPU forward time for `batch` images, after warm-up, the models taking turns.

    Taking turns (a, b, a, b, ...) rather than timing a then b puts a busy moment of the machine on
    both, so their ratio holds even when the absolute times swing. Each runs at least `min_runs`
    times, more while the whole is under `budget_s`, at torch's current thread count. The models must
    already be on the CPU.
    """
    x = torch.randn(batch, 3, img_size, img_size)
    times: list[list[float]] = [[] for _ in models]
    with torch.no_grad():
        for m in models:
            for _ in range(3):
                m(x)
        start = time.perf_counter()
        while len(times[0]) < min_runs or (time.perf_counter() - start < budget_s and len(times[0]) < 200):
            for m, ts in zip(models, times, strict=True):
                t0 = time.perf_counter()
                m(x)
                ts.append(time.perf_counter() - t0)
    return [Latency.of(ts) for ts in times]


def gpu_latencies(models: list[Any], img_size: int, batch: int = 1, runs: int = 50) -> list[Latency]:
    """Each model's forward time on the GPU for `batch` images (CUDA events, after warm-up, the models taking
    turns), timed on float copies moved to the GPU. Call only where torch.cuda.is_available()."""
    x = torch.randn(batch, 3, img_size, img_size, device="cuda")
    copies = [copy.deepcopy(m).float().cuda().eval() for m in models]
    times: list[list[float]] = [[] for _ in copies]
    with torch.no_grad():
        for m in copies:
            for _ in range(5):
                m(x)
        torch.cuda.synchronize()
        for _ in range(runs):
            for m, ts in zip(copies, times, strict=True):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                m(x)
                end.record()
                end.synchronize()
                ts.append(start.elapsed_time(end) / 1000)
    del copies
    torch.cuda.empty_cache()
    return [Latency.of(ts) for ts in times]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def compare_table(dense: torch.nn.Module, pruned: torch.nn.Module, img_size: int, top1: list[float]) -> str:
    """The before/after table of a pruned model (both on the CPU): top-1, parameters, weights raw and
    zipped, CPU latency and, where there is a GPU, GPU latency; then the latency note."""
    sizes = [saved_sizes(m.state_dict()) for m in (dense, pruned)]
    lat = cpu_latencies([dense, pruned], img_size)
    rows = [["top-1 (%)", f"{top1[0]:.2f}", f"{top1[1]:.2f}"],
            ["parameters", f"{count_params(dense):,}", f"{count_params(pruned):,}"],
            ["weights (.pth)", mib(sizes[0][0]), mib(sizes[1][0])],
            ["weights zipped", mib(sizes[0][1]), mib(sizes[1][1])],
            ["CPU latency, 1 image", str(lat[0]), str(lat[1])]]
    if torch.cuda.is_available():
        gpu = gpu_latencies([dense, pruned], img_size)
        rows.append(["GPU latency, 1 image", str(gpu[0]), str(gpu[1])])
    return table(["", "before", "after"], rows) + "\n" + latency_note(lat, img_size)


def latency_note(lat: list[Latency], img_size: int) -> str:
    """The line under a table of latencies: how they were taken, and a warning when they swung."""
    note = (f"(CPU latency: median of {min(x.runs for x in lat)}+ runs at {img_size}px, "
            f"{torch.get_num_threads()} threads, the models taking turns; p10-p90 in brackets)")
    wide = max(x.spread for x in lat)
    if wide > WIDE_SPREAD:
        note += (f"\nwarning: CPU latency varied widely (p10-p90 spans {wide:.0%} of the median): the machine "
                 "is busy with other work; compare the models' medians only roughly, or rerun on an idle machine")
    return note


# ---------------------------------------------------------------------------------------------------
# Printing.


def mib(n: float) -> str:
    """Bytes as MiB with 2 decimals ('11.23 MiB'), or KiB below 1 MiB."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        padded = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        lines.append("  ".join(padded).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
