"""The trainer's setup as a plan: every decision made once, each with the sentence that says why.

    setup = plan.resolve(cfg, resume, dist, device, say)   # TrainPlan, and the model and data it measured
    parts = run.build_parts(setup.plan, setup.model, ...)  # optimizer, schedule, DDP, EMA, compile
    fit(...)                                               # the epochs

As data/pipeline.py does for the input, `resolve` turns the options into plain values, in the order
each needs the last: the precision; the model (`ModelSpec`: name, the factory's arguments, the image
size, where it came from); the memory format; the batch split (micro-batch x accumulation, measured
for --batch-size auto); the input plan and the loaders; the checkpoint ratio (measured with the data
on the GPU); whether to compile (it needs the run's length); the optimizer. Three of these can only
be decided by building or measuring something (the memory format asks the built model whether it is
convolutional; --checkpoint-ratio auto probes with the data's memory in use), so `resolve` hands
back the model and the data it built along with the plan. Everything after reads the plan:
config.yaml records it (`options`, `notes`), the start line prints it, the parts are built from it.

A new decision is a field of `TrainPlan` holding an `auto.Decision` (value, why), made in `resolve`
and written to config.yaml by `notes` as `<name>_rule`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from dlenv import autobatch, compat, config, distributed, finetune, usermodel, weights
from dlenv.config import TrainConfig
from dlenv.data import pipeline
from dlenv.train import auto
from dlenv.train.auto import Decision


@dataclass(frozen=True)
class ModelSpec:
    """The model a run trains: a torchvision name or FILE.py:factory, its class count, the factory's
    keyword arguments, the image size it sees (and why), where it came from (models of your own), and
    the --weights a fresh run starts from (a resume loads its own)."""

    name: str
    num_classes: int
    args: dict[str, Any]            # {} for torchvision names
    img_size: Decision
    provenance: dict[str, Any] | None
    weights: str | None = None
    pretrained: finetune.Plan | None = None  # --pretrained: the weights and the fine-tuning recipe
    load_policy: Any = None         # what --trust-pickle allows for --weights (dlenv.weights.LoadPolicy)

    @classmethod
    def resolve(cls, cfg: TrainConfig, located: pipeline.Located, fresh: bool) -> ModelSpec:
        """The spec for `cfg`'s model on `located` data: the one place the trainer asks dlenv.usermodel
        about a model of your own. Raises UserError for arguments or a size the model refuses."""
        tune = finetune.Plan.of(cfg, fresh)
        size = _img_size(cfg.img_size, cfg.model, located, tune)
        args = usermodel.factory_kwargs(cfg.model, cfg.model_args, size.value)
        return cls(cfg.model, len(located.classes), args, size, usermodel.provenance(cfg.model, args),
                   cfg.weights if fresh else None, tune, weights.LoadPolicy.of(cfg))

    def build(self, with_weights: bool = True) -> nn.Module:
        """A new model on the CPU (with --weights or --pretrained unless `with_weights` is False: the
        probes')."""
        from dlenv.models import build_model

        tune = self.pretrained if with_weights else None
        model = build_model(self.name, self.num_classes, weights=self.weights if with_weights else None,
                            pretrained_state=tune.state() if tune else None, model_args=self.args,
                            load_policy=self.load_policy)
        if tune:
            tune.prepare(model, self.num_classes)  # the head, the backbone's learning rate, frozen epochs
        return model

    def probe(self, precision: str, device: torch.device, channels_last: bool) -> auto.Probe:
        """What the auto probes train: this model built afresh (without --weights), as the run builds it."""
        return auto.Probe(self.name, lambda: self.build(with_weights=False), self.num_classes, self.img_size.value,
                          precision, device, channels_last)

    @property
    def norm(self) -> tuple[tuple, tuple] | None:
        """(mean, std) the pretrained weights were trained with, for the input pipeline; None: ImageNet's."""
        w = self.pretrained.weights if self.pretrained else None
        return (tuple(w.mean), tuple(w.std)) if w else None

    @property
    def interpolation(self) -> str:
        """The resampling the pretrained weights were trained with, for the input pipeline; else bilinear."""
        return self.pretrained.weights.interpolation if self.pretrained else "bilinear"

    def check(self, model: nn.Module) -> None:
        """A model of your own must return logits [N, classes] (dlenv.usermodel.check_output)."""
        usermodel.check_output(model, self.name, self.num_classes, self.img_size.value)


def _img_size(given: int | None, model: str, located: pipeline.Located, tune: finetune.Plan | None) -> Decision:
    if given:
        return Decision(given, f"--img-size {given}")
    if tune:
        return Decision(tune.weights.img_size, f"{tune.weights.name} was trained at {tune.weights.img_size} px")
    declared = usermodel.declared_img_size(model)
    if declared:
        return Decision(declared, f"{model} declares img_size {declared}")
    return Decision(*pipeline.auto_img_size(located))  # the data's typical size, capped


class Split(NamedTuple):
    """Images per optimizer step per GPU: `micro` per forward, `accum` forwards per step."""

    micro: int
    accum: int


@dataclass(frozen=True)
class OptimizerChoice:
    """What the optimizer options resolved to."""

    name: str
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class TrainPlan:
    """Every decision of a run's setup, resolved once (`resolve`); plain values and their reasons."""

    precision: Decision             # "fp32", "fp16" or "bf16"
    model: ModelSpec
    channels_last: Decision         # bool: the model's and the batches' memory format on the device
    batch: Decision                 # Split: micro-batch per GPU, accumulation steps
    world_size: int
    input: pipeline.InputPlan
    batches_per_epoch: int          # loader batches per epoch per GPU (--max-steps caps it)
    checkpoint_ratio: Decision | None  # the fraction of blocks recomputed; None without --checkpoint
    compile: Decision               # bool
    optimizer: OptimizerChoice
    epochs: int
    oom_retry: bool                 # --batch-size auto on one GPU: an OOM splits the batch instead of stopping
    blocks: int = 0                 # the model's repeated blocks, of which --checkpoint recomputes a fraction

    @property
    def micro_batch(self) -> int:
        return self.batch.value.micro

    @property
    def accum_steps(self) -> int:
        return self.batch.value.accum

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accum_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.batches_per_epoch / self.accum_steps)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last.value else torch.contiguous_format

    @property
    def recomputed_blocks(self) -> int:
        """How many blocks --checkpoint recomputes: the first round(ratio x blocks), as
        dlenv.models.apply_checkpointing wraps them; 0 without --checkpoint, on a CPU's auto, or for a
        model without repeated blocks."""
        return int(round(self.checkpoint_ratio.value * self.blocks)) if self.checkpoint_ratio else 0

    def options(self, cfg: TrainConfig) -> dict[str, Any]:
        """config.yaml's options: `cfg` with every auto resolved, so the file reruns this run."""
        return config.to_dict(dataclasses.replace(
            cfg, batch_size=self.micro_batch, accum_steps=self.accum_steps, effective_batch=None,
            optimizer=self.optimizer.name, lr=self.optimizer.lr, weight_decay=self.optimizer.weight_decay,
            img_size=self.input.img_size, workers=self.input.workers, resume=None,
            amp_dtype=self.precision.value if self.precision.value != "fp32" else cfg.amp_dtype,
            compile="on" if self.compile.value else "off", hflip="on" if self.input.hflip else "off",
            checkpoint_ratio=self.checkpoint_ratio.value if self.checkpoint_ratio else cfg.checkpoint_ratio))

    def notes(self, device: torch.device, data: pipeline.Data) -> dict[str, Any]:
        """config.yaml's comments: what the options resolved to on this machine, and why."""
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {
            "precision": self.precision.value, "device": f"{device} ({gpu})", "world_size": self.world_size,
            "effective_batch": self.effective_batch, "data": data.source, "classes": len(data.classes),
            "input": self.input.describe(device).removeprefix("input: "), "torch": torch.__version__,
            "precision_rule": self.precision.why, "img_size_rule": self.model.img_size.why,
            "batch_rule": self.batch.why, "channels_last_rule": self.channels_last.why,
            "compile_rule": self.compile.why, "hflip_rule": self.input.hflip_why,
            **({"checkpoint_rule": self.checkpoint_ratio.why} if self.checkpoint_ratio else {}),
            **({"pretrained": self.model.pretrained.notes()} if self.model.pretrained else {}),
            **({"model_source": self.model.provenance} if self.model.provenance else {})}

    def start_line(self, data: pipeline.Data, device: torch.device, resuming: bool, run_dir: Any) -> str:
        """The line a run starts with: what trains on what, where, how, and the run folder."""
        return (f"{'resuming' if resuming else 'training'} {self.model.name} on {data.source} "
                f"({len(data.classes)} classes, {self.input.img_size} px) | {device} {self.precision.value}"
                f"{' channels_last' if self.channels_last.value else ''}"
                f"{self._checkpointing()} | batch {self.micro_batch} x "
                f"{self.accum_steps} accum x {self.world_size} GPU = {self.effective_batch}, {self.optimizer.name} "
                f"lr {self.optimizer.lr:g} | {run_dir}")

    def _checkpointing(self) -> str:
        # only blocks really recomputed are named: --checkpoint with none (a CPU's auto, ratio 0, a model
        # without blocks) trains as without it, and the header must not say otherwise
        k = self.recomputed_blocks
        return f" checkpointing {k} of {self.blocks} blocks" if k else ""


@dataclass
class Setup:
    """What `resolve` gives back: the plan, and the model and data that deciding it built."""

    plan: TrainPlan
    model: nn.Module                # on the device, checkpointed as planned
    data: pipeline.Data


def resolve(cfg: TrainConfig, resume: Any, dist: distributed.DistInfo, device: torch.device,
            say: Callable[[str], None]) -> Setup:
    """Every setup decision of the run `cfg` on `device`, in the order each needs the last; prints the
    ones a user should see (as the trainer always has). Raises UserError for options this machine or
    data cannot honour."""
    from dlenv.models import find_blocks

    located = pipeline.locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)
    spec = ModelSpec.resolve(cfg, located, fresh=resume is None)
    precision = _precision(cfg, device, spec)
    if precision.value == "fp32" and cfg.amp:
        say(precision.why)
    model, channels_last = build_model(spec, cfg, device, say)
    probe = spec.probe(precision.value, device, channels_last.value)
    batch = _batch_split(cfg, dist, located, probe, resume, say)
    micro, accum = batch.value
    input_plan = pipeline.decide(pipeline.InputOptions.of(cfg), located, device, micro, spec.img_size.value,
                                 dist.local_world_size, norm=spec.norm, interpolation=spec.interpolation)
    memory_format = torch.channels_last if channels_last.value else torch.contiguous_format
    data = pipeline.build_data(located, input_plan, device, dist, seed=cfg.seed, dtype=_dtype(precision.value),
                               memory_format=memory_format, max_steps=cfg.max_steps, say=say, epochs=cfg.epochs)
    if located.layout is not None:
        say(input_plan.describe(device))
        if cfg.hflip == "auto" and not input_plan.hflip and input_plan.augment != "none":
            say(f"--hflip {input_plan.hflip_why}")  # once: the flips the dataset report advises against
    # after the data: what it keeps on the GPU (--synthetic, --cache ram on the device) counts in the probe
    ratio = auto.checkpoint_ratio(cfg, model, probe, micro, say)
    full_epoch = len(data.train) if data.sampler is None else math.ceil(data.sampler.per_rank / micro)
    batches_per_epoch = min(full_epoch, cfg.max_steps or full_epoch)
    # a resumed run has its saved on/off; auto counts the whole run's micro-batches per GPU
    compiled = auto.decide_compile(cfg.compile, device, cfg.epochs * batches_per_epoch)
    if (cfg.compile == "auto" and (compiled.value or not compat.HAS_COMPILE)) or (
            cfg.compile == "on" and not compiled.value):
        say(f"--compile {compiled.why}")  # once: when it compiles, or cannot
    optimizer = _optimizer(cfg, micro * accum * dist.world_size, cfg.epochs * math.ceil(batches_per_epoch / accum))
    plan = TrainPlan(precision, spec, channels_last, batch, dist.world_size, input_plan, batches_per_epoch, ratio,
                     compiled, optimizer, cfg.epochs, oom_retry=cfg.batch_size == "auto" and dist.world_size == 1,
                     blocks=len(find_blocks(model)) if cfg.checkpoint else 0)
    return Setup(plan, model, data)


def _precision(cfg: TrainConfig, device: torch.device, spec: ModelSpec) -> Decision:
    from dlenv.precision import cpu_amp_cache, cpu_step_seconds, decide_precision

    def step_seconds(mode: str) -> float:  # CPU --amp: bf16 only where it is faster for this model
        return cpu_step_seconds(lambda: spec.build(with_weights=False), mode, spec.img_size.value, spec.num_classes)

    # the CPU's verdict is measured once per machine, model and size, and kept (seconds per start)
    return Decision(*decide_precision(cfg.amp, cfg.amp_dtype, device, step_seconds, cache=cpu_amp_cache(),
                                      what=f"{spec.name} at {spec.img_size.value} px"))


def _dtype(mode: str) -> torch.dtype:
    from dlenv.precision import DTYPES

    return DTYPES[mode]


def build_model(spec: ModelSpec, cfg: TrainConfig, device: torch.device,
                say: Callable[[str], None]) -> tuple[nn.Module, Decision]:
    """(the model on `device`, checkpointed at the starting ratio if asked; whether it is channels_last)."""
    from dlenv.models import apply_checkpointing, is_convolutional

    model = spec.build()
    if not cfg.channels_last:
        channels_last = Decision(False, "--channels-last off")
    elif device.type != "cuda":
        channels_last = Decision(False, f"off on {device.type} (it pays for convolutions on a GPU)")
    elif not is_convolutional(model):
        channels_last = Decision(False, "off: the model is not convolutional")
    else:
        channels_last = Decision(True, "on: a convolutional model on a GPU")
    model = model.to(device, memory_format=torch.channels_last if channels_last.value else torch.contiguous_format)
    spec.check(model)  # logits [N, classes]? (own models)
    if cfg.checkpoint and apply_checkpointing(model, auto.start_ratio(cfg)) == 0:
        say(f"--checkpoint: {cfg.model} has no repeated blocks to checkpoint; training without it")
    return model, channels_last


def _batch_split(cfg: TrainConfig, dist: distributed.DistInfo, located: pipeline.Located, probe: auto.Probe,
                 resume: Any, say: Callable[[str], None]) -> Decision:
    """The Split (micro-batch per GPU, accumulation steps): the options, 'auto' measured on every GPU (all use the
    smallest), and on a resume with another number of GPUs the saved effective batch kept if it divides."""
    def measure() -> int:
        upper = len(located.layout.train) if located.layout is not None else 4096
        n = auto.auto_batch(probe, auto.start_ratio(cfg) if cfg.checkpoint else False, upper, say)
        return int(distributed.agree(n, "min"))

    micro, accum = autobatch.resolve_batch(cfg.batch_size, cfg.accum_steps, cfg.effective_batch, dist.world_size,
                                           measure)
    why = (f"--batch-size {cfg.batch_size}" + (" (measured)" if cfg.batch_size == "auto" else "")
           + (f", --effective-batch {cfg.effective_batch}" if cfg.effective_batch else
              f", --accum-steps {cfg.accum_steps}"))
    if resume is not None:
        micro, accum, note = autobatch.resume_split(micro, accum, resume.saved_world, dist.world_size)
        if note:
            say(note)
            why = note
    return Decision(Split(micro, accum), why)


def _optimizer(cfg: TrainConfig, effective_batch: int, total_steps: int) -> OptimizerChoice:
    from dlenv.optim import default_lr, default_weight_decay, resolve_optimizer

    name = resolve_optimizer(cfg.optimizer, total_steps)
    return OptimizerChoice(name, cfg.lr if cfg.lr is not None else default_lr(name, effective_batch),
                           cfg.weight_decay if cfg.weight_decay is not None else default_weight_decay(name))
