"""A `dlenv watch` record on disk: watch.csv's columns and rows, and the timeline watch.png (drawn through
`dlenv.runfolder.drawing`: dlenv's settings alone, the command's words as text). No torch here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlenv.files.atomic import write_atomic
from dlenv.runfolder import drawing
from dlenv.watch.probes import Sample

MIB = 1024 ** 2

def csv_columns(n_gpus: int) -> list[str]:
    cols = ["t_s", "host_cpu_pct", "proc_cpu_pct", "proc_rss_mib", "disk_read_mib_s", "procs"]
    for i in range(n_gpus):
        cols += [f"gpu{i}_util_pct", f"gpu{i}_mem_used_mib", f"gpu{i}_mem_total_mib", f"gpu{i}_power_w",
                 f"gpu{i}_power_limit_w", f"gpu{i}_sm_clock_mhz", f"gpu{i}_sm_clock_max_mhz"]
    return cols


def csv_row(s: Sample) -> list[Any]:
    def f(v: float | None, scale: float = 1.0, nd: int = 1) -> Any:
        return "" if v is None else round(v / scale, nd)

    row = [round(s.t, 2), f(s.host_cpu), f(s.proc_cpu), f(s.proc_rss, MIB), f(s.disk_read, MIB),
           "" if s.procs is None else s.procs]
    for g in s.gpus:
        row += [f(g.util, nd=0), f(g.mem_used, MIB, 0), f(g.mem_total, MIB, 0), f(g.power), f(g.power_limit),
                f(g.sm_clock, nd=0), f(g.sm_clock_max, nd=0)]
    return row


@drawing.settings()
def plot(samples: Sequence[Sample], names: Sequence[str], path: Path, title: str, n_cpus: int = 1) -> Path:
    """watch.png, the timeline of `figure`, written atomically. Returns its path."""
    fig = figure(samples, names, title, n_cpus)
    write_atomic(Path(path), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    return Path(path)


#: every legend sits right of its panel (past the twin axis's labels), so none covers a line
_OUTSIDE = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.1, 1.0), "borderaxespad": 0.0}


@drawing.settings()
def figure(samples: Sequence[Sample], names: Sequence[str], title: str, n_cpus: int = 1):
    """The timeline as a matplotlib Figure: GPU utilisation and memory (% of the card), power (% of its limit),
    host CPU and the command's CPU, and the machine's disk reads (every process's, not only the command's:
    /proc/diskstats counts the disks, not who read)."""
    t = [s.t for s in samples]
    panels = 3 if names else 1
    fig = drawing.new_figure(figsize=(11, 2.6 * panels + 0.6))
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)
    axes = [a[0] for a in axes]
    if names:
        ax = axes[0]
        for i in range(len(names)):
            ax.plot(t, [_at(s, i, "util") for s in samples], label=f"GPU {i} utilisation", lw=1.2)
            ax.plot(t, [_pct(_at(s, i, "mem_used"), _at(s, i, "mem_total")) for s in samples], "--", lw=1,
                    label=f"GPU {i} memory (% of card)")
        ax.set_ylim(-2, 105)
        ax.set_ylabel("%")
        ax.legend(**_OUTSIDE)
        ax.set_title("GPU utilisation and memory", fontsize=9)
        ax = axes[1]
        for i in range(len(names)):
            ax.plot(t, [_at(s, i, "power") for s in samples], label=f"GPU {i} power (W)", lw=1.2)
            limit = next((_at(s, i, "power_limit") for s in samples if _at(s, i, "power_limit")), None)
            if limit:
                ax.axhline(limit, color="grey", lw=0.8, ls=":", label=f"GPU {i} power limit")
        ax.set_ylabel("W")
        ax.legend(**_OUTSIDE)
        ax.set_title("GPU power", fontsize=9)
    ax = axes[-1]
    ax.plot(t, [s.host_cpu for s in samples], label="CPUs it may use, % busy", lw=1.2, color="tab:red")
    ax.plot(t, [None if s.proc_cpu is None else s.proc_cpu / max(1, n_cpus)
                for s in samples], label="the command's processes, % of those CPUs", lw=1, color="tab:orange")
    ax.set_ylabel("%")
    ax.set_ylim(-2, 105)  # shares read against zero and a full 100, not a zoomed-in band
    ax.set_xlabel("seconds")
    ax2 = ax.twinx()
    ax2.plot(t, [None if s.disk_read is None else s.disk_read / MIB for s in samples], lw=0.8, color="tab:purple",
             label="disk reads, whole machine, MiB/s")
    ax2.set_ylabel("machine's disk reads, MiB/s")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], **_OUTSIDE)
    ax.set_title("host", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _at(s: Sample, i: int, name: str) -> float | None:
    return getattr(s.gpus[i], name) if len(s.gpus) > i else None


def _pct(a: float | None, b: float | None) -> float | None:
    return 100.0 * a / b if a is not None and b else None


