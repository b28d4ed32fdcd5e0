"""What a `dlenv watch` record suggests: a pure function of the samples, and the one paragraph.

`summarize` gives each GPU's busy share (the mean NVML utilisation: the share of time a kernel ran), its
memory peak and its power at full utilisation; `advise` names the patterns below, each with the dlenv
option and the own-loop part that addresses it; `paragraph` puts both into the text watch.md holds.
docs/watch.md says what each advice line means. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlenv.watch.probes import Sample

MIB = 1024 ** 2
GIB = 1024 ** 3

# What the advice calls a pattern. Each is a share or a ratio of what NVML and /proc report.
#: a sample with GPU utilisation below this (%) is an idle gap
GAP_UTIL = 50.0
#: idle gaps in at least this share of the active samples are worth a line
GAP_SHARE = 0.15
#: the CPUs the command may use, busy at least this share (%) during the gaps: the CPU is the limit
CPU_SATURATED = 80.0
#: disk reads above this (MiB/s) during the gaps, with the CPUs not saturated: the disk is the limit
DISK_BUSY_MIBS = 50.0
#: memory used at least this share of the card: near the card
MEM_NEAR = 0.90
#: utilisation at or above this (%) is "full"
FULL_UTIL = 90.0
#: power below this share of its limit at full utilisation: small kernels
LOW_POWER = 0.50
#: SM clock below this share of its maximum at full utilisation: the card slows itself down
LOW_CLOCK = 0.70
#: memory below this share of the card at full utilisation: room for a bigger batch
MEM_ROOM = 0.40


@dataclass(frozen=True)
class Advice:
    """One pattern seen: what was seen, what it means, the dlenv option and the own-loop part for it."""

    key: str
    seen: str
    fix_dlenv: str
    fix_own: str

    def line(self) -> str:
        return f"{self.seen} dlenv train: {self.fix_dlenv}. Your own loop: {self.fix_own}."


@dataclass(frozen=True)
class GpuSummary:
    """One GPU's figures over the run."""

    index: int
    name: str
    busy: float | None            # mean utilisation, %: the share of time a kernel ran
    busy_active: float | None     # the same from its first busy sample to its last
    mem_peak: float | None        # bytes
    mem_total: float | None       # bytes
    power_full: float | None      # mean W at full utilisation
    power_limit: float | None     # W


def _mean(xs: Sequence[float | None]) -> float | None:
    vs = [x for x in xs if x is not None]
    return sum(vs) / len(vs) if vs else None


def summarize(samples: Sequence[Sample], names: Sequence[str]) -> list[GpuSummary]:
    """Each GPU's busy share (whole run and active part), memory peak, and power at full utilisation."""
    out = []
    for i, name in enumerate(names):
        g = [s.gpus[i] for s in samples if len(s.gpus) > i]
        utils = [x.util for x in g]
        busy_at = [k for k, u in enumerate(utils) if u is not None and u >= 1]
        active = utils[busy_at[0]:busy_at[-1] + 1] if busy_at else []
        full = [x for x in g if x.util is not None and x.util >= FULL_UTIL]
        out.append(GpuSummary(
            index=i, name=name, busy=_mean(utils), busy_active=_mean(active),
            mem_peak=max((x.mem_used for x in g if x.mem_used is not None), default=None),
            mem_total=next((x.mem_total for x in g if x.mem_total), None),
            power_full=_mean([x.power for x in full]),
            power_limit=next((x.power_limit for x in reversed(g) if x.power_limit), None)))
    return out


def _active(samples: Sequence[Sample], i: int) -> list[Sample]:
    """The samples from GPU i's first busy one to its last: start-up and shutdown are not patterns."""
    busy = [k for k, s in enumerate(samples) if len(s.gpus) > i and (s.gpus[i].util or 0) >= 1]
    return list(samples[busy[0]:busy[-1] + 1]) if busy else []


def advise(samples: Sequence[Sample], names: Sequence[str]) -> list[Advice]:
    """What the samples suggest, each with the dlenv option and the own-loop part that addresses it.

    Pure: the same samples give the same advice. The patterns (thresholds at the top of the module):
    - `idle`: GPU never busy while the command ran;
    - `input-cpu`: idle gaps in the active part while the command's CPUs are saturated (the input
      pipeline decodes and augments too slowly on the CPU);
    - `input-workers`: idle gaps while the CPUs have room and the disk is quiet (too few loader workers,
      or per-step work outside the GPU);
    - `input-disk`: idle gaps while the disk reads fast and the CPUs have room (data read from disk);
    - `memory`: memory used near the card's total;
    - `small-kernels`: power well below its limit at full utilisation;
    - `throttled`: SM clock well below its maximum at full utilisation;
    - `room`: full utilisation with most of the memory unused (a bigger batch fits).
    """
    out: dict[str, Advice] = {}
    for i, summary in enumerate(summarize(samples, names)):
        gpu = f"GPU {i}" if len(names) > 1 else "The GPU"
        active = _active(samples, i)
        if not active:
            out.setdefault("idle", Advice(
                "idle", f"{gpu} ran no kernel while the command ran: it trained on the CPU, or stopped before its "
                        "first step.",
                "--device cuda (auto picks the GPU where PyTorch sees one; `dlenv verify-env` says why not)",
                "move the model and each batch to the GPU (model.to('cuda'), x.to('cuda', non_blocking=True))"))
            continue
        gaps = [s for s in active if (s.gpus[i].util or 0) < GAP_UTIL]
        share = len(gaps) / len(active)
        if share >= GAP_SHARE:
            cpu = _mean([s.host_cpu for s in gaps])
            disk = _mean([s.disk_read for s in gaps])
            head = f"{gpu} waited in {share:.0%} of its active samples (utilisation under {GAP_UTIL:.0f}%)"
            if cpu is not None and cpu >= CPU_SATURATED:
                out.setdefault("input-cpu", Advice(
                    "input-cpu", f"{head} while the CPUs the command may use were {cpu:.0f}% busy: the input "
                                 "pipeline (JPEG decoding, augmentation) cannot keep up on the CPU.",
                    "--cache on (decode once, augment on the GPU), --decoder nvimgcodec or nvjpeg (decode on the "
                    "GPU), --gpu-augment on; `dlenv bench-data` measures each",
                    "decode on the GPU (torchvision.io.decode_jpeg(..., device='cuda')), augment batches on the GPU, "
                    "or keep decoded images (a uint8 tensor or memory-mapped array) instead of JPEGs"))
            elif disk is not None and disk >= DISK_BUSY_MIBS * MIB:
                out.setdefault("input-disk", Advice(
                    "input-disk", f"{head} while the disk read {disk / MIB:.0f} MiB/s and the CPUs had room: the "
                                  "data comes from disk too slowly.",
                    "--cache on --cache-mode ram (the decoded dataset in memory), or the data on a local SSD",
                    "read the dataset into memory once, or copy it to local disk before training"))
            else:
                cpu_text = f" while the CPUs were only {cpu:.0f}% busy" if cpu is not None else ""
                out.setdefault("input-workers", Advice(
                    "input-workers", f"{head}{cpu_text}: too few processes load the data, or the step waits on "
                                     "something else (a .item() each step, logging, saving).",
                    "--workers N (more loader processes; auto takes the cores and /dev/shm into account)",
                    "DataLoader(num_workers=N, pin_memory=True, persistent_workers=True), and no .item() or "
                    "print of a GPU value every step"))
        if summary.mem_peak and summary.mem_total and summary.mem_peak >= MEM_NEAR * summary.mem_total:
            out.setdefault("memory", Advice(
                "memory", f"{gpu}'s memory peaked at {summary.mem_peak / GIB:.1f} of {summary.mem_total / GIB:.1f} "
                          f"GiB ({summary.mem_peak / summary.mem_total:.0%}): near the card, one larger batch from "
                          "out of memory.",
                "--amp (half-size activations), --checkpoint (recompute them in backward; --checkpoint-ratio auto "
                "for as few blocks as fit), --accum-steps N with a smaller --batch-size",
                "torch.autocast(...) with a GradScaler for fp16, torch.utils.checkpoint on the repeated blocks"))
        full = [s for s in active if (s.gpus[i].util or 0) >= FULL_UTIL]
        if len(full) >= max(3, len(active) // 4):
            power = _mean([s.gpus[i].power for s in full])
            limit = summary.power_limit
            if power is not None and limit and power < LOW_POWER * limit:
                out.setdefault("small-kernels", Advice(
                    "small-kernels", f"{gpu} was at full utilisation but drew {power:.0f} of {limit:.0f} W "
                                     f"({power / limit:.0%}): kernels too small to fill the card (utilisation counts "
                                     "any kernel running, not how much of the GPU it uses).",
                    "a bigger --batch-size (or --batch-size auto), --compile (fused kernels), --amp, --channels-last",
                    "a larger batch, torch.compile(model), torch.autocast, channels_last memory format"))
            clock = _mean([s.gpus[i].sm_clock for s in full])
            top = next((s.gpus[i].sm_clock_max for s in full if s.gpus[i].sm_clock_max), None)
            if clock is not None and top and clock < LOW_CLOCK * top:
                out.setdefault("throttled", Advice(
                    "throttled", f"{gpu}'s SM clock averaged {clock:.0f} of {top:.0f} MHz at full utilisation: the "
                                 "card slows itself (temperature or its power cap).",
                    "nothing in dlenv: check cooling and `nvidia-smi -q -d PERFORMANCE` (its throttle reasons)",
                    "the same: the code is not the limit"))
            if (summary.mem_peak and summary.mem_total and summary.mem_peak < MEM_ROOM * summary.mem_total
                    and "small-kernels" not in out):
                out.setdefault("room", Advice(
                    "room", f"{gpu} was busy with {summary.mem_peak / GIB:.1f} of {summary.mem_total / GIB:.1f} GiB "
                            "in use: a larger batch fits, often at more images/s.",
                    "--batch-size auto (the largest that fits, measured)",
                    "raise the batch (and the learning rate with it)"))
    return list(out.values())


def host_line(samples: Sequence[Sample], n_cpus: int) -> str:
    """The command's processes' CPU (mean, in cores) and resident memory (peak), and how busy its CPUs were."""
    cores = _mean([None if s.proc_cpu is None else s.proc_cpu / 100 for s in samples])
    rss = max((s.proc_rss for s in samples if s.proc_rss is not None), default=None)
    busy = _mean([s.host_cpu for s in samples])
    if cores is None and rss is None:
        return ""
    text = "The command's processes used"
    text += f" {cores:.1f} of the {n_cpus} CPU core(s) they may use on average" if cores is not None else ""
    text += (" and" if cores is not None else "") + f" up to {rss / GIB:.2f} GiB resident" if rss is not None else ""
    return text + (f"; those cores were {busy:.0f}% busy (everything on them)." if busy is not None else ".")


def paragraph(summaries: Sequence[GpuSummary], advice: Sequence[Advice], seconds: float,
              no_gpu: str = "", host: str = "") -> str:
    """The one paragraph: each GPU's busy share, memory peak and power at full utilisation, the host's
    line, then the advice lines (or that nothing stood out)."""
    if no_gpu:
        return f"{no_gpu[0].upper()}{no_gpu[1:]}: the host was recorded for {seconds:.0f} s. {host}".strip()
    parts = []
    for s in summaries:
        who = f"GPU {s.index} ({s.name})" if len(summaries) > 1 else f"The GPU ({s.name})"
        if s.busy is None:
            parts.append(f"{who} reported no utilisation.")
            continue
        text = f"{who} was busy {s.busy:.0f}% of the {seconds:.0f} s"
        if s.busy_active is not None and s.busy_active - s.busy >= 5:
            text += f" ({s.busy_active:.0f}% from its first kernel to its last)"
        if s.mem_peak is not None and s.mem_total:
            text += (f"; its memory peaked at {s.mem_peak / GIB:.1f} of {s.mem_total / GIB:.1f} GiB "
                     f"({s.mem_peak / s.mem_total:.0%})")
        if s.power_full is not None and s.power_limit:
            text += f"; at full utilisation it drew {s.power_full:.0f} of {s.power_limit:.0f} W"
        parts.append(text + ".")
    if host:
        parts.append(host)
    if advice:
        parts.append("What the pattern suggests:")
        parts += [f"- {a.line()}" for a in advice]
    else:
        parts.append("Nothing stood out: no idle gaps, memory not near the card, power in line with utilisation.")
    return "\n".join(parts)


