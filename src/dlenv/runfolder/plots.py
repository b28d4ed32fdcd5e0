"""Figures from a run's results.csv: `dlenv plot --log-dir DIR`.

Reads only `results.csv` (the contract in `dlenv.runfolder.results`), never a run file or a running trainer, so
it works on a run still in progress, a single epoch included. For every run under DIR it writes
`results.png` beside the CSV (losses, accuracy, learning rate, throughput, data wait, peak memory
against epoch); with several runs it also writes `DIR/compare.png`, overlaying their val top-1 and
peak memory, in natural order (exp, exp2, exp10), a colour of its own for each run however many, each
named with the data and model of its config.yaml (`exp2: resnet18 on digits`). Figures are built and
saved through `dlenv.runfolder.drawing` (dlenv's settings alone, names drawn as text, no pyplot), so a
run folder named `c$\\frac$` or a `matplotlibrc` beside the runs changes nothing.

This module never imports torch.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from dlenv import invocation
from dlenv.errors import UserError, need_folder, printable
from dlenv.files.atomic import write_atomic
from dlenv.options.cfgfile import read_yaml
from dlenv.runfolder import config_notes, drawing
from dlenv.runfolder.results import COLUMNS, read_results

RESULTS = "results.csv"
CONFIG = "config.yaml"
#: the longest data or model name shown in a legend; longer ones are cut with "..."
_NAME_CHARS = 40

#: (panel title, y-axis label, [(column, legend label)]) for each panel of results.png, row by row.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Loss", "cross-entropy loss", [("train_loss", "train"), ("val_loss", "val")]),
    ("Validation accuracy", "accuracy (%)", [("top1", "top-1"), ("top5", "top-5")]),
    ("Learning rate", "learning rate", [("lr", "lr (end of epoch)")]),
    ("Training throughput", "images / s", [("img_per_s", "images/s (all GPUs)")]),
    ("Waiting for data", "share of epoch (%)", [("data_wait", "data wait"), ("gpu_busy", "GPU busy (NVML)")]),
    ("Peak GPU memory", "memory (GiB)", [("mem_alloc_gib", "allocated"),
                                         ("mem_reserved_gib", "reserved")]),
]

# columns stored as a 0-1 share but shown in %
_PERCENT_OF_SHARE = {"data_wait", "gpu_busy"}


def find_runs(log_dir: str | Path) -> list[Path]:
    """Run folders under `log_dir` (itself included): every folder holding a results.csv, sorted.

    Hidden folders are skipped. Raises UserError when `log_dir` is missing or holds no run.
    """
    root = Path(log_dir)
    need_folder(root, "--log-dir", "pass the folder of your runs (e.g. runs)")
    runs = [p.parent for p in root.rglob(RESULTS)
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    if not runs:
        raise UserError(f"--log-dir {root}: no {RESULTS} in it or its subfolders yet (a run writes it at the end "
                        f"of its first epoch); train a run first ({invocation.command('train', '')}) or pass the "
                        "folder that holds runs/<name>/results.csv")
    return sorted(set(runs), key=lambda p: natural_key(p.relative_to(root).as_posix()))


def natural_key(name: str) -> tuple:
    """Sort key that orders the numbers in names by value: exp, exp2, exp3-2, exp10 (not exp, exp10, exp2).

    re.split with a group alternates text and digits, text first, so items at one position always
    compare str to str or int to int.
    """
    parts = re.split(r"(\d+)", name)
    return tuple(int(t) if i % 2 else t.lower() for i, t in enumerate(parts)), name


def run_colors(n: int) -> list[Any]:
    """A colour for each of `n` runs, no two alike: matplotlib's ten default colours (C0-C9) up to ten
    runs, else `n` evenly spaced samples of the turbo colormap (the default cycle repeats after ten)."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    turbo = drawing.matplotlib().colormaps["turbo"]
    # the ends of turbo are near-black; 0.05-0.95 keeps every colour visible on white
    return [tuple(turbo(0.05 + 0.9 * i / (n - 1))) for i in range(n)]


def run_config(run: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(options, notes) of the run's config.yaml, read once as any config file (size-limited, no aliases);
    ({}, {}) without one, and for one that cannot be read, which is said in one line (the run is still
    plotted, without its description)."""
    path = run / CONFIG
    if not path.is_file():
        return {}, {}
    try:
        options, text = read_yaml(path)
    except UserError as e:
        print(f"note: {e}; {run.name} is plotted without its data and model")
        return {}, {}
    return options, config_notes(text)


def describe_run(run: Path) -> str | None:
    """'MODEL on DATA' from the run's config.yaml (`resnet18 on digits`), or None without a readable one."""
    return describe(run_config(run)[0])


def describe(options: dict[str, Any]) -> str | None:
    """'MODEL on DATA' from a run's options; only string values are shown, printable and cut to _NAME_CHARS."""
    if not options:
        return None

    def text(value: Any) -> str | None:
        if not isinstance(value, str) or not value.strip():
            return None
        value = printable(value.strip())
        return value if len(value) <= _NAME_CHARS else value[:_NAME_CHARS - 3] + "..."

    model = text(options.get("model"))
    if options.get("synthetic") is True:
        data = "synthetic data"
    elif options.get("data") is None:
        data = "demo data"
    else:
        data = text(Path(str(options["data"])).name) if isinstance(options.get("data"), str) else None
    if text(options.get("pretrained")):
        model = f"{model} (pretrained)" if model else None
    if model is None and data is None:
        return None
    return f"{model or 'a model'} on {data or 'its data'}"


def run_label(run: Path, log_dir: Path) -> str:
    """A run's name for titles and legends: its path under log_dir, or its own name."""
    rel = run.resolve().relative_to(log_dir.resolve()) if run.resolve() != log_dir.resolve() else None
    return rel.as_posix() if rel else run.resolve().name


def cut(text: str, limit: int = 60) -> str:
    """`text` cut in the middle to `limit` characters, so a 200-character run name leaves the figure room
    for its panels and names that share a prefix stay apart."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[-(limit - 1 - head):]


def _series(df: Any, column: str):
    """(epochs, values) of one column with its missing values dropped; %-scaled where shown in %."""
    if column not in df.columns:
        return [], []
    sub = df[["epoch", column]].dropna()
    values = sub[column] * 100.0 if column in _PERCENT_OF_SHARE else sub[column]
    return sub["epoch"].tolist(), values.tolist()


def _style_epoch_axis(ax: Any, epochs: list[float]) -> None:
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(drawing.matplotlib().ticker.MaxNLocator(integer=True))
    if epochs:
        lo, hi = min(epochs), max(epochs)
        # one epoch: give the single point some room instead of a zero-width axis; several: span all
        # of them (matplotlib's own 5% margin), also where an inf value at one end is not drawn
        pad = 1 if lo == hi else 0.05 * (hi - lo)
        ax.set_xlim(lo - pad, hi + pad)
    ax.grid(True, alpha=0.3)


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4",
            fontsize=10, wrap=True)


def run_classes(run: Path) -> int | None:
    """How many classes the run trained on, from the `# classes: N` note of its config.yaml, or None."""
    return classes_of(run_config(run)[1])


def classes_of(notes: dict[str, str]) -> int | None:
    """The `classes` note as a count (1 to 9 digits), or None."""
    found = re.fullmatch(r"\d{1,9}", notes.get("classes", "").strip())
    return int(found.group(0)) if found else None


@drawing.settings()
def plot_run(df: Any, title: str, classes: int | None = None):
    """The results.png figure of one run's results (a DataFrame from `read_results`).

    Returns a matplotlib Figure with one Axes per entry of PANELS (title as in PANELS); each plotted
    column is a Line2D labelled as in PANELS, its ydata the CSV's values (data wait in %). With `classes`
    known and at most 5, top-5 is not drawn: every class is in the top 5, so it reads 100% and means nothing.
    """
    fig = drawing.new_figure(figsize=(15, 8.5), layout="constrained")
    axes = fig.subplots(2, 3).ravel()
    n = len(df)
    last = int(df["epoch"].max()) if n else 0
    first = int(df["epoch"].min()) if n else 0
    span = f"epoch {last}" if first == last else f"epochs {first}-{last}"
    fig.suptitle(f"{cut(title, 100)}: {span} ({n} row{'s' if n != 1 else ''} in results.csv)", fontsize=14)
    marker = "o" if n <= 30 else None
    for ax, (panel, ylabel, cols) in zip(axes, PANELS, strict=True):
        ax.set_title(panel)
        ax.set_ylabel(ylabel)
        all_epochs, all_values = [], []
        for col, label in cols:
            epochs, values = _series(df, col)
            if not epochs or (col == "top5" and classes is not None and classes <= 5):
                continue
            ax.plot(epochs, values, marker=marker, markersize=4, label=label)
            all_epochs += epochs
            all_values += values
        _style_epoch_axis(ax, all_epochs)
        # inf or nan (a diverged loss) is not drawn and sets no axis limit; the panel says so
        finite = [v for v in all_values if math.isfinite(v)]
        if not all_epochs:
            _note(ax, "not recorded in results.csv")
        elif not finite:
            _note(ax, "only inf or nan values (a diverged run?)")
        elif panel == "Peak GPU memory" and not any(finite):
            _note(ax, "0 GiB: a CPU run records no GPU memory")
        elif len(finite) < len(all_values):
            ax.set_title(f"{panel} ({len(all_values) - len(finite)} inf/nan value(s) not drawn)")
        if panel == "Learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        lone = len(set(all_epochs)) == 1
        if finite and (panel in ("Waiting for data", "Peak GPU memory") or (lone and min(finite) >= 0)):
            # shares, GiB and a lone epoch's values read against zero, not against a zoomed-in band;
            # headroom above the highest value keeps a flat line off the frame and out of the legend
            ax.set_ylim(bottom=0, top=max(finite) * 1.2 or None)
        if all_epochs:
            ax.legend(loc="best", fontsize=9)
    return fig


@drawing.settings()
def plot_compare(runs: dict[str, Any], about: dict[str, str | None] | None = None):
    """The compare.png figure: val top-1 and peak memory of several runs ({label: DataFrame}).

    `about` gives a run's data and model (`describe_run`), shown after its label in the legend
    ("exp2: resnet18 on digits") and in the title when every run shares it. Runs are drawn in natural
    order of their labels (exp, exp2, exp10), each in its own colour (`run_colors`).

    Returns a Figure with two Axes ("Validation top-1", "Peak GPU memory"); in each, one line per run
    labelled as above (memory: allocated solid, reserved dashed with label '_'-prefixed).
    A CPU run (memory all zero) gets no memory line but a "CPU run: label" note; when every run is a
    CPU run there is no memory panel at all (the title says so), only top-1.
    """
    about = about or {}
    named = {k: cut(f"{k}: {about[k]}" if about.get(k) else k) for k in sorted(runs, key=natural_key)}
    colors = dict(zip(named.values(), run_colors(len(named)), strict=True))
    shared = {about.get(k) for k in named}
    common = f": {shared.pop()}" if len(shared) == 1 and None not in shared else ""
    runs = {named[k]: runs[k] for k in named}

    def zeros(df: Any) -> bool:  # what a CPU run records as GPU memory
        alloc, reserved = _series(df, "mem_alloc_gib")[1], _series(df, "mem_reserved_gib")[1]
        return not any(alloc) and not any(reserved)

    if runs and all(zeros(df) for df in runs.values()):
        fig = drawing.new_figure(figsize=(8, 5.5), layout="constrained")
        ax_acc = fig.subplots(1, 1)
        fig.suptitle(f"{len(runs)} runs compared{common} (CPU runs: no GPU memory to draw)", fontsize=14)
        ax_acc.set_title("Validation top-1")
        ax_acc.set_ylabel("top-1 accuracy (%)")
        all_epochs: list[float] = []
        for label, df in runs.items():
            epochs, top1 = _series(df, "top1")
            if epochs:
                ax_acc.plot(epochs, top1, color=colors[label], marker="o" if len(df) <= 30 else None, markersize=4,
                            label=label)
            all_epochs += epochs
        _style_epoch_axis(ax_acc, all_epochs)
        if ax_acc.get_lines():
            ax_acc.legend(loc="best", fontsize=9)
        else:
            _note(ax_acc, "not recorded in results.csv")
        return fig
    fig = drawing.new_figure(figsize=(14, 5.5), layout="constrained")
    ax_acc, ax_mem = fig.subplots(1, 2)
    fig.suptitle(f"{len(runs)} runs compared{common}", fontsize=14)
    ax_acc.set_title("Validation top-1")
    ax_acc.set_ylabel("top-1 accuracy (%)")
    ax_mem.set_title("Peak GPU memory (solid: allocated, dashed: reserved)")
    ax_mem.set_ylabel("memory (GiB)")
    all_epochs: list[float] = []
    cpu_runs: list[str] = []
    for label, df in runs.items():
        color = colors[label]
        marker = "o" if len(df) <= 30 else None
        epochs, top1 = _series(df, "top1")
        if epochs:
            ax_acc.plot(epochs, top1, color=color, marker=marker, markersize=4, label=label)
        epochs_m, alloc = _series(df, "mem_alloc_gib")
        epochs_r, reserved = _series(df, "mem_reserved_gib")
        if (alloc or reserved) and not any(alloc) and not any(reserved):
            cpu_runs.append(label)  # all zeros: no GPU memory to draw, not a run that used none
            epochs_m = epochs_r = []
        if epochs_m:
            ax_mem.plot(epochs_m, alloc, color=color, marker=marker, markersize=4, label=label)
        if epochs_r:
            ax_mem.plot(epochs_r, reserved, color=color, linestyle="--", alpha=0.7, label=f"_{label}")
        all_epochs += epochs + epochs_m
    for ax in (ax_acc, ax_mem):
        _style_epoch_axis(ax, all_epochs)
        if ax.get_lines():
            # many runs: the legend goes below the axes so it never covers the curves
            if len(runs) > 6:
                ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8)
            else:
                ax.legend(loc="best", fontsize=9)
        elif not (ax is ax_mem and cpu_runs):
            _note(ax, "not recorded in results.csv")
    if cpu_runs:
        names = ", ".join(cpu_runs[:6]) + (f" and {len(cpu_runs) - 6} more" if len(cpu_runs) > 6 else "")
        text = f"CPU run{'s' if len(cpu_runs) > 1 else ''}: {names} (no GPU memory to draw)"
        if ax_mem.get_lines():
            ax_mem.text(0.02, 0.02, text, transform=ax_mem.transAxes, ha="left", va="bottom", color="0.4",
                        fontsize=9)
        else:
            _note(ax_mem, text)
    return fig


@drawing.settings()
def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` as a PNG atomically (temp file in the same folder, then os.replace); returns the path."""
    return write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))


def plot_log_dir(log_dir: str | Path) -> list[Path]:
    """Write results.png for every run under `log_dir` and compare.png when there are several.

    Runs whose CSV has no complete epoch yet are skipped with a note. Returns the PNGs written.
    Raises UserError when there is no run, or no run with a complete epoch.
    """
    root = Path(log_dir)
    written: list[Path] = []
    frames: dict[str, Any] = {}
    about: dict[str, str | None] = {}
    for run in find_runs(root):
        label = run_label(run, root)
        df = read_results(run / RESULTS)  # never raises on content: unreadable lines are left out
        dropped = df.attrs.get("dropped", [])
        if "epoch" not in df.columns or len(df) == 0:
            why = f"none of its {len(dropped)} line(s) could be read" if dropped else "no complete epoch yet"
            print(f"skipping {run / RESULTS}: {why}")
            continue
        if dropped:
            print(f"note: {run / RESULTS}: {len(dropped)} line(s) could not be read and are not plotted "
                  f"(line {', '.join(map(str, dropped[:5]))}{' ...' if len(dropped) > 5 else ''})")
        unknown = [c for c in df.columns if c not in COLUMNS]
        if unknown:
            print(f"note: {run / RESULTS} has columns this version does not plot: {', '.join(unknown)}")
        df = df.sort_values("epoch")
        options, notes = run_config(run)  # one read of config.yaml for the legend and the classes
        about[label] = describe(options)
        title = f"{label} ({about[label]})" if about[label] else label
        written.append(save_figure(plot_run(df, title, classes_of(notes)), run / "results.png"))
        frames[label] = df
        print(f"{label}: {len(df)} epoch(s) -> {run / 'results.png'}")
    if not frames:
        raise UserError(f"--log-dir {root}: no run has a complete epoch in its {RESULTS} yet; "
                        "wait for the first epoch to finish")
    if len(frames) > 1:
        written.append(save_figure(plot_compare(frames, about), root / "compare.png"))
        print(f"{len(frames)} runs compared -> {root / 'compare.png'}")
    return written


def main(cfg: Any) -> int:
    """`dlenv plot`: plot every run under cfg.log_dir. Returns 0; raises UserError when there is none."""
    plot_log_dir(cfg.log_dir)
    return 0
