"""What the trainer's `auto` options become on this machine: --amp's precision, --compile, --checkpoint-ratio,
--batch-size.

Each decision returns the value it chose and one sentence that says why; the trainer records both in
config.yaml, so a run says what it did and the next one can be told to do otherwise. They measure
(real training steps of the probe's model, on the GPU) but change nothing of the run: the model the
run trains is built after them, from the plan (dlenv.train.parts).

--amp is `resolve_precision`'s mode (dlenv.engine.precision: bf16 on a GPU that has it, else fp16), except
that on a CPU it never makes the run slower: many CPUs emulate bfloat16, so --amp-dtype auto keeps bf16
only where this CPU's flags and a timed probe step say it is faster (dlenv.train.cpuprobe, which keeps the
verdict per machine). Whatever the machine says, a reduced precision is kept only where one training step
of the run's own model runs in it on this torch (`amp_step_error`: PyTorch 1.13's CPU autocast hands a
LayerNorm after a Linear a bf16 input it refuses, so a ViT cannot train in bf16 there); else fp32.

--compile auto compiles a CUDA run of PyTorch 2.x that plans at least COMPILE_MIN_BATCHES
micro-batches per GPU. Compiling costs a while once, and then every step runs faster
(docs/benchmarks.md has the measurement the threshold comes from). Below that many steps it would
barely pay back, and a short run is usually a try, where starting at once matters
more; on a CPU the generated code gains little and the compile takes longest; PyTorch 1.13 has no
torch.compile at all.

--checkpoint-ratio auto recomputes the fewest of the repeated blocks that let the run's micro-batch
fit on this GPU, found by real training steps (dlenv.engine.checkpointsearch.fewest_checkpoint_blocks). With
--batch-size auto the batch is chosen to fill the card with every block checkpointed, so all are;
on a CPU none are (`cpu_checkpoint_ratio`: recomputing costs time there, to save memory a CPU run
rarely lacks), and the start line names no checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from dlenv import compat
from dlenv.cluster import distributed
from dlenv.engine import autobatch, checkpointsearch, stepprobe
from dlenv.engine.precision import Precision, resolve_precision
from dlenv.engine.step import Parts, train_step
from dlenv.errors import UserError
from dlenv.train import cpuprobe

#: micro-batches per GPU from which --compile auto compiles: above the steps in which ResNet-50 --amp
#: on an H200 repays its compile time (docs/benchmarks.md), with room for models that gain less.
COMPILE_MIN_BATCHES = 3000


class Decision(NamedTuple):
    """A choice the trainer made: the value it chose, and one sentence that says why (config.yaml)."""

    value: Any
    why: str


@dataclass(frozen=True)
class Probe:
    """What the auto probes train on this machine: the run's model built afresh (`build`, without
    --weights), its classes and image size, the precision, the device and the memory format; `resident`,
    bytes held on the device while probing: the run's model's weights (the probes once ran beside it, and
    keep that margin) and what the input keeps there (--synthetic's batch)."""

    name: str
    build: Callable[[], nn.Module]
    num_classes: int
    img_size: int
    precision: str
    device: torch.device
    channels_last: bool
    resident: int = 0


def decide_precision(amp: bool, amp_dtype: str, device: Any,
                     step_seconds: Callable[[str], float] | None = None,
                     cache: str | Path | None = None, what: str = "", native: bool | None = None,
                     model_step: Callable[[str], str | None] | None = None) -> Decision:
    """The precision a run trains in ("fp32", "fp16" or "bf16"), and the sentence config.yaml and the log
    give for it: what this machine says (`_machine_precision`), kept where `model_step(mode)` (one training
    step of the run's model in that mode, `amp_step_error`) returns None; where it returns the error's
    first line, fp32, and the sentence names it. On a CPU and on CUDA alike.

    As `resolve_precision`, except that --amp on a CPU never makes the run slower: with --amp-dtype auto,
    `step_seconds(mode)` (`cpuprobe.cpu_probe_seconds`) times a training step in fp32 and bf16, and bf16 is
    kept only where it was faster. (Many CPUs emulate bfloat16, and autocast's casts then cost more than
    they save; docs/training.md has the measurements.) --amp-dtype bf16 asks for bf16 whatever the speed. `native`
    (`cpuprobe.cpu_bf16_native`) decides without timing where the CPU's flags say it has no bfloat16
    instructions (False): fp32.

    `cache` (`cpuprobe.cpu_amp_cache()`): a file that keeps the verdict per CPU model, torch version, thread
    count and `what` (the model and size step_seconds times), so the timing happens once per machine.
    Raises UserError where `resolve_precision` does.
    """
    decided = _machine_precision(amp, amp_dtype, device, step_seconds, cache, what, native)
    failed = model_step(decided.value) if model_step is not None and decided.value != "fp32" else None
    if failed is None:
        return decided
    return Decision("fp32", f"--amp: one {decided.value} training step of this model failed on "
                    f"{torch.device(device).type} with PyTorch {torch.__version__} ({failed}), so training in fp32")


def amp_step_error(build: Callable[[], nn.Module], mode: str, device: Any, img_size: int, num_classes: int,
                   batch: int = 2) -> str | None:
    """None where one training step (dlenv.engine.step.train_step: forward, backward, optimizer step) of a
    model from `build` on `batch` random images runs in `mode`; else the first line of its error.

    Only an error of the precision counts: a RuntimeError (a dtype an op refuses under autocast) where the
    same step in fp32 runs. Out of memory, and an error fp32 meets too (the model's own), are None: the run
    meets them with its own message. The model is a copy of its own and the step draws from forked random
    streams, so the run's weights, buffers (BatchNorm's statistics) and random streams are as before it.
    """
    def step(precision: str) -> None:
        model = build().to(device).train()
        x = torch.randn(batch, 3, img_size, img_size, device=device)
        y = torch.randint(0, num_classes, (batch,), device=device)
        train_step(Parts.plain(model, torch.optim.SGD(model.parameters(), lr=0.0), Precision(precision, device)), x, y)

    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        try:
            step(mode)
            return None
        except RuntimeError as e:
            if compat.is_oom(e):
                return None
            failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        try:
            step("fp32")
        except Exception:  # not the precision's: the run's own step says what it is
            return None
    return failed


def _machine_precision(amp: bool, amp_dtype: str, device: Any, step_seconds: Callable[[str], float] | None,
                       cache: str | Path | None, what: str, native: bool | None) -> Decision:
    """What `decide_precision` decides before the model's step: the options, and on a CPU its flags and
    speed."""
    mode = resolve_precision(amp, amp_dtype, device)
    kind = torch.device(device).type
    if mode == "fp32":
        return Decision(mode, "no --amp")
    if kind != "cpu" or amp_dtype != "auto" or step_seconds is None:
        return Decision(mode, f"--amp --amp-dtype {amp_dtype} on {kind}")
    if native is False:
        return Decision("fp32", "--amp on this CPU: it has no bfloat16 instructions (no avx512_bf16, amx_bf16 or "
                        "bf16 in /proc/cpuinfo), so autocast would emulate bf16 and run slower: training in fp32; "
                        "--amp-dtype bf16 forces bf16")
    key = cpuprobe.machine_key(what)
    ratio = cpuprobe.kept_ratio(Path(cache), key) if cache is not None else None
    if ratio is not None:
        return _cpu_verdict(ratio, f"measured once on this CPU, kept in {cache}")
    fp32 = step_seconds("fp32")
    try:
        bf16 = step_seconds("bf16")
    except RuntimeError as e:  # an op of this model without a bf16 CPU kernel: fp32 trains, bf16 cannot
        return Decision("fp32", f"--amp on this CPU: a bf16 step failed ({str(e).splitlines()[0][:160]}), so "
                        "training in fp32")
    ratio = bf16 / fp32
    if cache is not None:
        cpuprobe.keep_ratio(Path(cache), key, ratio)
    return _cpu_verdict(ratio, "measured")


def _cpu_verdict(ratio: float, how: str) -> Decision:
    """The precision for a bf16 step that took `ratio` times fp32's, and why."""
    if ratio < 1:
        return Decision("bf16", f"--amp on this CPU: a bf16 step took {ratio:.2f}x the time of fp32's ({how})")
    return Decision("fp32", f"--amp on this CPU: a bf16 step took {ratio:.2f}x the time of fp32's ({how}: the "
                    "CPU emulates bfloat16), so training in fp32; --amp-dtype bf16 forces bf16")


def decide_compile(choice: str, device: torch.device, planned_batches: int) -> Decision:
    """Whether to compile, and why, for --compile `choice` ("auto", "on", "off") and the micro-batches
    the run plans per GPU."""
    if choice == "off":
        return Decision(False, "off (--compile off)")
    if not compat.HAS_COMPILE:
        return Decision(False, f"off: PyTorch {torch.__version__} has no torch.compile (it arrived in 2.0)"
                        + ("" if choice == "on" else "; auto means off here"))
    if choice == "on":
        return Decision(True, "on (--compile on)")
    if device.type != "cuda":
        return Decision(False, f"auto: off on {device.type} (compiling pays on a GPU; --compile on to compile "
                        "anyway)")
    if planned_batches < COMPILE_MIN_BATCHES:
        return Decision(False, f"auto: off, {planned_batches:,} planned micro-batches per GPU are under the "
                        f"{COMPILE_MIN_BATCHES:,} that repay the compile time (--compile on to compile anyway)")
    return Decision(True, f"auto: on, {planned_batches:,} planned micro-batches per GPU repay the compile time "
                    f"(from {COMPILE_MIN_BATCHES:,}; --compile off to run eagerly)")


def start_ratio(cfg: Any) -> float:
    """The fraction of blocks checkpointed before the batch is known: every block for auto (what
    `checkpoint_ratio` then narrows, and what --batch-size auto fills the card with)."""
    return 1.0 if cfg.checkpoint_ratio == "auto" else float(cfg.checkpoint_ratio)


def cpu_checkpoint_ratio(blocks: int) -> Decision:
    """The fraction of `blocks` recomputed for --checkpoint --checkpoint-ratio auto on a CPU (none), and why.
    Checkpointing trades compute for memory, and a CPU run is rarely short of memory: each recomputed
    block runs its forward twice (docs/benchmarks.md has the cost measured)."""
    return Decision(0.0, f"auto: none of {blocks} blocks on a CPU: recomputing a block costs its forward again, to "
                    "save memory a CPU run rarely lacks; --checkpoint-ratio 1 recomputes them all")


def checkpoint_ratio(cfg: Any, blocks: int, probe: Probe, micro_batch: int,
                     say: Callable[[str], None]) -> Decision | None:
    """The fraction of the model's `blocks` repeated blocks --checkpoint recomputes, and why; None without
    --checkpoint. Auto says its answer (`say`) for a model with blocks (one without was said already)."""
    if not cfg.checkpoint:
        return None
    ratio = _checkpoint_ratio(cfg, blocks, probe, micro_batch)
    if cfg.checkpoint_ratio == "auto" and blocks:
        say(f"--checkpoint-ratio {ratio.why}")
    return ratio


def _checkpoint_ratio(cfg: Any, n: int, probe: Probe, micro_batch: int) -> Decision:
    if cfg.checkpoint_ratio != "auto":
        return Decision(float(cfg.checkpoint_ratio), f"--checkpoint-ratio {cfg.checkpoint_ratio:g}")
    if n == 0:
        return Decision(1.0, "auto: the model has no repeated blocks")
    device = probe.device
    if device.type == "cpu":
        return cpu_checkpoint_ratio(n)
    if cfg.batch_size in ("auto", "max"):
        return Decision(1.0, f"auto: all {n} blocks (--batch-size {cfg.batch_size} measures the batch with every "
                             "block checkpointed)")

    # what the input keeps on the GPU during training (--synthetic's batch) is held while probing
    held = torch.empty(probe.resident, dtype=torch.uint8, device=device) if probe.resident else None
    try:
        found = checkpointsearch.fewest_checkpoint_blocks(probe.build, probe.precision, probe.img_size,
                                                          probe.num_classes, device, micro_batch,
                                                          channels_last=probe.channels_last)
        blocks = found.blocks
    except RuntimeError as e:  # the probe's own model or optimizer did not fit: the least memory, then
        if not compat.is_oom(e):
            raise
        found, blocks = None, n
    finally:
        del held
    k = int(distributed.agree(blocks, "max"))  # every rank recomputes the same blocks
    gpu = torch.cuda.get_device_name(device)
    if k == 0:
        why = f"auto: 0 of {n} blocks, batch {micro_batch} fits on {gpu} without recompute"
    elif k < n or (found is not None and found.fits_all):
        why = f"auto: {k} of {n} blocks let batch {micro_batch} fit on {gpu}"
    else:
        why = (f"auto: all {n} blocks, and batch {micro_batch} may still not fit on {gpu}; "
               "a smaller --batch-size or --batch-size auto would")
    return Decision(k / n, why)


def auto_batch(probe: Probe, checkpoint: float | bool, upper: int, say: Callable[[str], None],
               mode: str = "auto") -> int:
    """The micro-batch `--batch-size auto` (the fastest per image among those that fit) or `max` (the largest
    that fits) measures on this GPU (dlenv.engine.autobatch), made even (when over 2) so that a CUDA out-of-memory
    error later in the run can halve it exactly (dlenv.train.fit)."""
    if probe.device.type != "cuda":
        raise UserError(f"--batch-size {mode} measures GPU memory and needs a CUDA device; "
                        "give a number, e.g. --batch-size 32")

    trial = stepprobe.make_train_step_probe(probe.build, probe.precision, checkpoint, probe.img_size, probe.num_classes,
                                           probe.device, channels_last=probe.channels_last)
    held = torch.empty(probe.resident, dtype=torch.uint8, device=probe.device) if probe.resident else None
    try:
        if mode == "max":
            n, why = autobatch.find_max_batch(trial, start=8, upper=upper, what=probe.name), "the largest that fits"
        else:
            chosen = autobatch.fastest_batch(trial.rate, start=8, upper=upper, what=probe.name)
            n, why = chosen.batch, chosen.why
    finally:
        trial.close()
        del held
    n -= n % 2 if n > 2 else 0
    say(f"--batch-size {mode}: {n} ({why}; {probe.precision}, checkpointing {'on' if checkpoint else 'off'}, "
        f"{probe.img_size} px). The learning rate is not rescaled for it, except SGD's default (0.1 x batch/256)"
        + ("" if mode == "max" else "; --batch-size max takes the largest that fits"))
    return n
