"""bench-memory: the memory/speed table of FP32, AMP, checkpointing and both, measured here.

Articles print such a table for someone else's GPU; this measures it for the user's model, image
size and batch on the user's GPU. Each configuration runs in a fresh Python process
(`python -m dlenv.bench.memory_worker --worker SPEC --result FILE`), so its peak statistics and its caching
allocator start clean and no configuration inherits another's cached blocks. Every configuration
starts from the same seeded weights and trains on the same seeded batch, so the loss after the same
N steps shows what AMP and checkpointing cost in accuracy (nothing measurable, or they are wrong).

The auto-ratio row is AMP with only as many of the model's repeated blocks checkpointed as this
GPU needs for the batch: a worker first searches the fewest that fit (dlenv.engine.checkpointsearch.
fewest_checkpoint_blocks, as `--checkpoint-ratio auto` does), then another measures AMP with those.

Per configuration: peak memory allocated and reserved over the timed steps, images/s, both as
ratios to FP32, the loss at step N, and with --max-batch the largest batch that fits (real training
steps, doubling then bisection, see dlenv.engine.autobatch). A second table compares the allocator
settings this PyTorch offers on a workload that fragments (batch and image size change every step):
fragmentation = 1 - peak allocated / peak reserved, measured rather than repeated from articles.

Output in --out: memory.md (the tables), memory.csv, allocator.csv and memory.png. On a machine
without a GPU it still runs (speed and loss only; the memory columns say NA).

The user's model is measured as it is: with --num-classes auto its factory is called with its own default
class count (kuangliu's `MobileNetV2(num_classes=10)`: 10; 1000 where it has none) and its own head's width is
the class count (a named model gets 1000, an ImageNet-sized head). A configuration that fails is one line in the table
and on the console; the workers' own output (each step, any traceback) streams unbuffered into
workers.log in --out as it happens. Each worker runs in a process group of its own: Ctrl-C (or SIGTERM)
reaches this process alone, which stops the running worker's whole group at once and still writes the
tables of what was measured so far (exit 130 / 143).

The parent process (this module) never imports torch: the workers (dlenv.bench.memory_worker) do all
the measuring, each with the trainer's own step.
"""

from __future__ import annotations

import csv
import signal
import sys
from pathlib import Path
from typing import Any

from dlenv.bench.workers import Stop, run_worker, stoppable
from dlenv.errors import EXIT_SIGHUP, EXIT_SIGINT, EXIT_SIGTERM
from dlenv.files.atomic import write_atomic, write_text
from dlenv.runfolder import drawing

GIB = 1024 ** 3
NUM_CLASSES = 1000  # a named model's head with --num-classes auto: ImageNet-sized, as in the articles' tables
#: the workers' output, streamed into --out as it happens
WORKER_LOG = "workers.log"
SEED = 0

#: (key, label, amp, checkpoint) of the configurations, FP32 first: it is every ratio's reference.
BASE_CONFIGS = [
    ("fp32", "FP32", False, False),
    ("amp", "AMP", True, False),
    ("ckpt", "Checkpointing", False, True),
    ("amp_ckpt", "AMP + checkpointing", True, True),
]

#: AMP with the fewest checkpointed blocks that fit the batch here (checkpoint "auto": searched first).
AUTO_CONFIG = ("amp_ckpt_auto", "AMP + checkpointing (auto ratio)", True, "auto")

NO_SEARCH_ON_CPU = "not measured: the checkpoint search needs a CUDA GPU (nothing runs out of memory on a CPU)"

CSV_COLUMNS = ["key", "configuration", "status", "precision", "checkpoint", "channels_last", "batch_size",
               "img_size", "steps", "peak_alloc_gib", "peak_reserved_gib", "mem_vs_fp32", "img_per_s",
               "speed_vs_fp32", "loss_first", "loss_last", "skipped_steps", "max_batch"]
ALLOC_COLUMNS = ["setting", "status", "peak_alloc_gib", "peak_reserved_gib", "fragmentation", "img_per_s"]


# ---------------------------------------------------------------------------------------------------
# The configurations and the allocator settings to compare.


def configurations(convolutional: bool, channels_last: bool) -> list[dict[str, Any]]:
    """The configurations to run: the four base ones, the auto-ratio one, then the base ones' channels_last
    variants for conv nets."""
    out = [dict(key=k, label=lb, amp=a, checkpoint=c, channels_last=False)
           for k, lb, a, c in [*BASE_CONFIGS, AUTO_CONFIG]]
    if convolutional and channels_last:
        out += [dict(key=k + "_cl", label=lb + " + channels_last", amp=a, checkpoint=c, channels_last=True)
                for k, lb, a, c in BASE_CONFIGS]
    return out


def allocator_settings(has_expandable_segments: bool) -> list[str]:
    """PYTORCH_CUDA_ALLOC_CONF values to compare ("" = unset); expandable_segments needs PyTorch 2.1+."""
    settings = ["", "max_split_size_mb:128", "garbage_collection_threshold:0.8"]
    if has_expandable_segments:
        settings.append("expandable_segments:True")
    return settings


def fragmentation_schedule(batch_size: int, img_size: int, steps: int, seed: int = SEED) -> list[tuple[int, int]]:
    """A seeded sequence of (batch, image size) that changes every step, as mixed-size data does.

    Batches of 1/4 to 4/4 of `batch_size`, images of 0.75x to 1.25x `img_size` (multiples of 8):
    tensors of many sizes come and go, which is what splits the allocator's cached blocks.
    """
    import random

    rng = random.Random(seed)
    batches = sorted({max(1, batch_size * k // 4) for k in (1, 2, 3, 4)})
    sizes = sorted({max(16, int(img_size * f) // 8 * 8) for f in (0.75, 0.875, 1.0, 1.125, 1.25)})
    return [(rng.choice(batches), rng.choice(sizes)) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------------
# Tables, CSV and chart from the results (no torch here).


def _ratio(v: float | None, ref: float | None) -> float | None:
    return v / ref if v is not None and ref else None


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill mem_vs_fp32 (peak allocated) and speed_vs_fp32 from the row whose key is 'fp32'."""
    ref = next((r for r in rows if r["key"] == "fp32"), {})
    for r in rows:
        r["mem_vs_fp32"] = _ratio(r.get("peak_alloc_gib"), ref.get("peak_alloc_gib"))
        r["speed_vs_fp32"] = _ratio(r.get("img_per_s"), ref.get("img_per_s"))
    return rows


def _num(v: Any, fmt: str, na: str = "NA") -> str:
    return na if v is None or v == "" else format(v, fmt)


def _pct(ratio: float | None) -> str:
    return "—" if ratio is None else f"{(ratio - 1) * 100:+.0f}%"


def markdown_table(rows: list[dict[str, Any]], steps: int, with_max_batch: bool) -> str:
    """The articles' table: Configuration | Peak alloc GiB | Peak reserved GiB | vs FP32 | img/s | ..."""
    head = ["Configuration", "Peak alloc GiB", "Peak reserved GiB", "vs FP32", "img/s", "speed vs FP32",
            f"loss after {steps} steps"]
    if with_max_batch:
        head.append("max batch")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        label = r["configuration"] + (f" ({r['precision']})" if r.get("precision") in ("fp16", "bf16") else "")
        if r.get("ckpt_blocks") is not None:
            label += f", {r['ckpt_blocks']}/{r['ckpt_n_blocks']} blocks checkpointed"
        if r.get("status") != "ok":
            what = {"oom": "out of memory", "skipped": r.get("error", "not measured")}.get(
                r.get("status"), f"failed: {r.get('error', '?')}")
            cells = [label, what] + ["—"] * (len(head) - 2)
            if with_max_batch:
                cells[-1] = _num(r.get("max_batch"), "d")
        else:
            cells = [label, _num(r.get("peak_alloc_gib"), ".2f"), _num(r.get("peak_reserved_gib"), ".2f"),
                     _pct(r.get("mem_vs_fp32")), _num(r.get("img_per_s"), ".1f"),
                     _num(r.get("speed_vs_fp32"), ".2f", "—") + ("x" if r.get("speed_vs_fp32") else ""),
                     _num(r.get("loss_last"), ".4f")]
            if with_max_batch:
                cells.append(_num(r.get("max_batch"), "d"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def allocator_table(rows: list[dict[str, Any]]) -> str:
    """Setting | Peak alloc GiB | Peak reserved GiB | fragmentation | img/s."""
    lines = ["| PYTORCH_CUDA_ALLOC_CONF | Peak alloc GiB | Peak reserved GiB | fragmentation | img/s |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") != "ok":
            what = "out of memory" if r.get("status") == "oom" else f"failed: {r.get('error', '?')}"
            lines.append(f"| {r['setting'] or '(unset)'} | {what} | — | — | — |")
            continue
        frag = r.get("fragmentation")
        lines.append(f"| {r['setting'] or '(unset)'} | {_num(r.get('peak_alloc_gib'), '.2f')} | "
                     f"{_num(r.get('peak_reserved_gib'), '.2f')} | "
                     f"{'NA' if frag is None else f'{frag * 100:.1f}%'} | {_num(r.get('img_per_s'), '.1f')} |")
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path, columns: list[str]) -> Path:
    """`rows` as CSV with `columns` (missing values empty, floats to 6 significant digits)."""
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v))
                            for k, v in ((k, r.get(k)) for k in columns)})

    write_atomic(Path(path), write)
    return Path(path)


@drawing.settings()
def bar_chart(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Two panels: peak allocated/reserved GiB per configuration (when measured) and images/s."""
    ok = [r for r in rows if r.get("status") == "ok"]
    labels = [r["configuration"].replace(" + ", "\n+ ") for r in ok]
    xs = list(range(len(ok)))
    fig = drawing.new_figure(figsize=(max(10, 1.9 * len(ok) + 4), 4.8))
    ax_mem, ax_speed = fig.subplots(1, 2)
    if any(r.get("peak_alloc_gib") is not None for r in ok):
        w = 0.4
        alloc = [r.get("peak_alloc_gib") or 0 for r in ok]
        reserved = [r.get("peak_reserved_gib") or 0 for r in ok]
        ax_mem.bar([x - w / 2 for x in xs], alloc, w, label="peak allocated")
        ax_mem.bar([x + w / 2 for x in xs], reserved, w, label="peak reserved")
        for x, a in zip(xs, alloc, strict=True):
            ax_mem.annotate(f"{a:.2f}" if a < 10 else f"{a:.1f}", (x - w / 2, a), ha="center", va="bottom",
                            fontsize=8)
        ax_mem.set_ylabel("GiB")
        ax_mem.legend()
    else:
        ax_mem.text(0.5, 0.5, "memory numbers need a CUDA GPU", ha="center", va="center",
                    transform=ax_mem.transAxes)
    ax_mem.set_title("Peak GPU memory")
    speeds = [r.get("img_per_s") or 0 for r in ok]
    ax_speed.bar(xs, speeds, 0.6, color="tab:green")
    ax_speed.set_title("Training throughput")
    ax_speed.set_ylabel("images / s")
    for ax in (ax_mem, ax_speed):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return Path(path)


def _header(cfg: Any, info: dict[str, Any]) -> str:
    where = info.get("gpu") or "CPU"
    mem = f", {info['gpu_total_gib']:.0f} GiB" if info.get("gpu_total_gib") else ""
    if info.get("gpu_capped_gib"):
        mem += f" capped at {info['gpu_capped_gib']:g} GiB (--gpu-memory-gib)"
    classes = info.get("num_classes") or cfg.num_classes or NUM_CLASSES
    whose = "" if cfg.num_classes else " of the model's own head"
    chans = "" if cfg.channels == 3 else f", {cfg.channels} channel(s)"
    return (f"{cfg.model}, batch {cfg.batch_size}, {cfg.img_size} px{chans}, {cfg.warmup} warmup + {cfg.steps} "
            f"timed steps (SGD, {classes} classes{whose}) on {where}{mem}; PyTorch {info.get('torch')}, CUDA "
            f"{info.get('cuda') or '-'}; PYTORCH_CUDA_ALLOC_CONF={info.get('alloc_conf') or '(unset)'}")


def report(cfg: Any, rows: list[dict[str, Any]], alloc_rows: list[dict[str, Any]],
           info: dict[str, Any]) -> str:
    """The whole memory.md text: header, the configuration table, notes, the allocator table."""
    parts = [f"# bench-memory: {cfg.model}", "", _header(cfg, info), ""]
    if info.get("stopped"):
        parts += [f"**Stopped by {info['stopped']}** after {len(rows)} configuration(s): the table holds what "
                  "was measured until then.", ""]
    parts += [markdown_table(rows, cfg.warmup + cfg.steps, cfg.max_batch), ""]
    notes = ["Peak alloc/reserved: torch.cuda.max_memory_allocated/reserved over the timed steps, each "
             "configuration in a fresh process. vs FP32: peak allocated relative to FP32.",
             f"Loss: cross-entropy at step {cfg.warmup + cfg.steps}, from the same seeded weights on the same "
             "seeded batch in every configuration."]
    if info.get("device") != "cuda":
        notes.insert(0, "Memory numbers need a CUDA GPU: this run on the CPU measured speed and loss only.")
    if cfg.max_batch:
        notes.append("Max batch: the largest batch whose real training steps (forward, backward, SGD step) "
                     "fit, by doubling then bisection to within 1%, in a fresh process per configuration.")
    auto = next((r for r in rows if r.get("key") == AUTO_CONFIG[0]), None)
    if auto and auto.get("ckpt_blocks") is not None:  # on a CPU its row says why it was not searched
        notes.append(f"{AUTO_CONFIG[1]}: AMP with only the first k of the model's n repeated blocks "
                     "checkpointed, k the fewest whose training steps fit the batch plus the margin of "
                     "--batch-size auto, searched on this GPU in a fresh process (none first, then all, then "
                     "bisection), as `--checkpoint-ratio auto` does; the `checkpoint` column of memory.csv says "
                     "\"auto: k/n\".")
    skipped = [r["configuration"] for r in rows if r.get("skipped_steps")]
    if skipped:
        notes.append("The fp16 GradScaler skipped its first step(s) while finding its scale in: "
                     + ", ".join(skipped) + " (so their loss is a step or two behind).")
    parts += [f"- {n}" for n in notes]
    if alloc_rows:
        sched = fragmentation_schedule(cfg.batch_size, cfg.img_size, cfg.alloc_steps)
        parts += ["", "## Allocator settings", "",
                  f"{alloc_rows[0].get('precision', '')} training whose batch and image size change every "
                  f"step ({len(sched)} steps: batches {min(b for b, _ in sched)}-{max(b for b, _ in sched)}, "
                  f"images {min(s for _, s in sched)}-{max(s for _, s in sched)} px), each setting in a fresh "
                  "process. Fragmentation = 1 - peak allocated / peak reserved: the share of reserved memory "
                  "that tensors never used at the peak.", "", allocator_table(alloc_rows)]
    elif cfg.allocator:
        parts += ["", "Allocator settings: not compared (they need a CUDA GPU)."]
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------
# The command.


def _spec(cfg: Any, mode: str = "measure", **extra: Any) -> dict[str, Any]:
    spec = dict(mode=mode, model=cfg.model, batch_size=cfg.batch_size, img_size=cfg.img_size,
                warmup=cfg.warmup, steps=cfg.steps, amp_dtype=cfg.amp_dtype, device=cfg.device,
                seed=SEED, num_classes=cfg.num_classes, channels=cfg.channels, gpu_memory_gib=cfg.gpu_memory_gib)
    spec.update(extra)
    return spec


def checkpoint_label(row: dict[str, Any]) -> str:
    """The auto-ratio row's checkpoint column: "auto: k/n" blocks, or "auto" when the search did not run."""
    if row.get("ckpt_blocks") is None:
        return "auto"
    label = f"auto: {row['ckpt_blocks']}/{row['ckpt_n_blocks']}"
    return label if row.get("ckpt_fits_all", True) else label + " (none fit with the margin)"


def _search_checkpoint(cfg: Any, c: dict[str, Any], info: dict[str, Any], progress) -> dict[str, Any]:
    """The auto-ratio row's search, in a worker: its ckpt_* fields, or status "skipped"/"error" and why."""
    if info and info.get("device") != "cuda":  # known to be a CPU: no worker needed to say so
        return dict(status="skipped", error=NO_SEARCH_ON_CPU)
    progress(f"[bench-memory] {c['label']}: fewest checkpointed blocks that fit ...")
    res = run_worker(_spec(cfg, "ckpt_search", amp=c["amp"], checkpoint=False, channels_last=c["channels_last"]),
                     **_log(cfg))
    if res.get("status") == "error":
        res["error"] = f"checkpoint search: {res.get('error', '?')}"
    return res


def _log(cfg: Any) -> dict[str, Any]:
    """run_worker's `log` argument: workers.log in --out (when the folder is there)."""
    out = Path(cfg.out)
    return {"log": out / WORKER_LOG} if out.is_dir() else {}


def _said(row: dict[str, Any]) -> str:
    """One line for a finished configuration: its speed (and peak), or why it has none."""
    if row.get("status") == "ok":
        peak = f", peak {row['peak_alloc_gib']:.2f} GiB" if row.get("peak_alloc_gib") is not None else ""
        return f"{row.get('img_per_s') or 0:.1f} img/s{peak}"
    return {"oom": "out of memory", "skipped": row.get("error", "not measured")}.get(
        row.get("status"), f"failed: {row.get('error', '?')}")


def run_bench(cfg: Any, progress=print) -> tuple[list[dict], list[dict], dict]:
    """Run every configuration (and the allocator settings) in fresh workers.

    Returns (rows, allocator rows, environment info of the first worker). Ctrl-C or `Stop` ends the
    running worker and returns what was measured, with info["stopped"] naming the signal. Raises
    UserError for an unknown model or a device that is not there.
    """
    rows: list[dict[str, Any]] = []
    alloc_rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    try:
        _run_configurations(cfg, progress, rows, info)
        _run_allocator(cfg, progress, alloc_rows, info)
    except KeyboardInterrupt as e:
        info["stopped"] = signal.Signals(e.signum).name if isinstance(e, Stop) else "SIGINT (Ctrl-C)"
        progress(f"[bench-memory] stopped by {info['stopped']}: writing what was measured")
    add_ratios(rows)
    return rows, alloc_rows, info


def _run_configurations(cfg: Any, progress, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Measure each configuration in turn, appending its row to `rows` as it finishes."""
    todo = configurations(False, False)
    i = 0
    while i < len(todo):
        c = todo[i]
        progress(f"[bench-memory] {c['label']} ...")
        ckpt, found = c["checkpoint"], {}
        if ckpt == "auto":
            found = _search_checkpoint(cfg, c, info, progress)
            ckpt = found.get("ckpt_ratio") if found.get("status") == "ok" else None
        # no ratio means the search did not run: the row is its answer (skipped or failed, and why)
        res = found if ckpt is None else dict(found, **run_worker(_spec(cfg, amp=c["amp"], checkpoint=ckpt,
                                                                         channels_last=c["channels_last"]),
                                                                   **_log(cfg)))
        if not info and "device" in res:
            info.update({k: res.get(k) for k in ("device", "gpu", "gpu_total_gib", "gpu_capped_gib", "torch",
                                                  "cuda", "alloc_conf", "num_classes")})
            # the first worker tells whether the model is convolutional: add channels_last variants
            todo = configurations(bool(res.get("convolutional")), cfg.channels_last)
        row = dict(res, key=c["key"], configuration=c["label"],
                   checkpoint=checkpoint_label(found) if found else c["checkpoint"],
                   channels_last=c["channels_last"], batch_size=cfg.batch_size, img_size=cfg.img_size,
                   steps=cfg.warmup + cfg.steps)
        if cfg.max_batch and info.get("device") == "cuda" and ckpt is not None:
            progress(f"[bench-memory] {c['label']}: largest batch ...")
            mb = run_worker(_spec(cfg, "max_batch", amp=c["amp"], checkpoint=ckpt,
                                  channels_last=c["channels_last"]), **_log(cfg))
            row["max_batch"] = mb.get("max_batch")
        rows.append(row)
        progress(f"[bench-memory] {c['label']}: {_said(row)}")
        i += 1


def _run_allocator(cfg: Any, progress, alloc_rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Compare the allocator settings (CUDA only), appending a row per setting."""
    if cfg.allocator and info.get("device") == "cuda":
        from dlenv.compat import HAS_EXPANDABLE_SEGMENTS  # imports torch, in this one case only

        for setting in allocator_settings(HAS_EXPANDABLE_SEGMENTS):
            progress(f"[bench-memory] allocator {setting or '(unset)'} ...")
            res = run_worker(_spec(cfg, "allocator", amp=True, checkpoint=False, channels_last=False,
                                   steps=cfg.alloc_steps), alloc_conf=setting, **_log(cfg))
            alloc_rows.append(dict(res, setting=setting))


def main(cfg: Any) -> int:
    """`dlenv bench-memory`: run, print the tables, write memory.md/.csv/.png and allocator.csv to --out.

    Returns 0; 1 when a configuration's worker failed for a reason other than out of memory (each says
    why in one line); 130 / 143 / 129 when Ctrl-C, SIGTERM or SIGHUP stopped it (the tables then hold
    what was measured).
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / WORKER_LOG).write_bytes(b"")  # this run's workers only
    with stoppable():
        rows, alloc_rows, info = run_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    text = report(cfg, rows, alloc_rows, info)
    write_text(out / "memory.md", text)
    write_csv(rows, out / "memory.csv", CSV_COLUMNS)
    if alloc_rows:
        write_csv(alloc_rows, out / "allocator.csv", ALLOC_COLUMNS)
    bar_chart(rows, out / "memory.png", _header(cfg, info))
    print(text, flush=True)
    print(f"written: {out / 'memory.md'}, {out / 'memory.csv'}, {out / 'memory.png'}"
          + (f", {out / 'allocator.csv'}" if alloc_rows else "") + f"; the workers' output: {out / WORKER_LOG}",
          flush=True)
    stopped = info.get("stopped", "")
    if stopped:
        return EXIT_SIGTERM if stopped == "SIGTERM" else EXIT_SIGHUP if stopped == "SIGHUP" else EXIT_SIGINT
    failed = [r for r in rows + alloc_rows if r.get("status") == "error"]
    return 1 if failed else 0
