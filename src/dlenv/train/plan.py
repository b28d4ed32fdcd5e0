"""The trainer's plan: every setup decision of a run made once, each with the sentence that says why.

    decided = plan.decide(cfg, resume, dist, device)   # a frozen TrainPlan: plain values and reasons
    model, data, parts = dlenv.train.parts ...         # built from the plan, nothing decided there
    fit(decided, parts, ...)                           # the epochs

As data/plan.py does for the input, `decide` turns the options into plain values, in the order
each needs the last: what the options left to auto become (the demo's CPU recipe); the data's place
and classes; the model (`ModelSpec`: name, the factory's arguments, the image size, where it came
from); the precision; the memory format; the batch split (micro-batch x accumulation, measured for
--batch-size auto); the input plan; the checkpoint ratio; whether to compile (it needs the run's
length); the optimizer, the schedule and the step's options. It builds nothing the run uses and
prints nothing: the lines a user should see are the plan's `said`, printed by the trainer.

What it reads and measures, and only when an option asks: the data folder's listing (and image
headers for --img-size auto and the CPU recipe); the model's structure for --checkpoint and on a GPU
(a copy built without weights, on PyTorch's meta device where it has one); real training steps for
--batch-size auto and --checkpoint-ratio auto on a GPU and for --amp on a CPU (kept per machine,
dlenv.train.cpuprobe); one training step of the model for --amp (a copy, at 2 images); one forward of
a model of your own, built without weights, to check it gives logits before anything is probed. The run's
random streams are left as the seed set them.

A new decision is a field of `TrainPlan` holding an `auto.Decision` (value, why), made in `decide`
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

from dlenv import compat
from dlenv.cluster import distributed
from dlenv.data import pipeline
from dlenv.data.demo import default_data, train_defaults
from dlenv.data.plan import InputOptions, InputPlan
from dlenv.data.sampler import ResumableSampler
from dlenv.engine import batchsplit
from dlenv.engine.optim import default_lr, default_weight_decay, resolve_optimizer
from dlenv.engine.precision import DTYPES
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model import finetune, grayscale, models, usermodel
from dlenv.model.checkpointing import find_blocks
from dlenv.options import config, cpus
from dlenv.options.config import TrainConfig
from dlenv.train import auto, cpuprobe
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
    load_policy: LoadPolicy = SAFE  # what --trust-pickle allows for --weights
    channels: int = 3               # --channels: 1 puts dlenv.model.grayscale's hook on the model

    @classmethod
    def resolve(cls, cfg: TrainConfig, located: pipeline.Located, fresh: bool) -> ModelSpec:
        """The spec for `cfg`'s model on `located` data: the one place the trainer asks dlenv.model.usermodel
        about a model of your own. Raises UserError for arguments or a size the model refuses."""
        tune = finetune.Plan.of(cfg, fresh)
        size = _img_size(cfg.img_size, cfg.model, located, tune)
        args = models.factory_kwargs(cfg.model, cfg.model_args, size.value)
        return cls(cfg.model, len(located.classes), args, size, usermodel.provenance(cfg.model, args),
                   cfg.weights if fresh else None, tune, LoadPolicy.of(cfg), cfg.channels)

    def build(self, with_weights: bool = True) -> nn.Module:
        """A new model on the CPU (with --weights or --pretrained unless `with_weights` is False: the
        probes')."""

        tune = self.pretrained if with_weights else None
        model = models.build_model(self.name, self.num_classes, weights=self.weights if with_weights else None,
                            pretrained_state=tune.state() if tune else None, model_args=self.args,
                            load_policy=self.load_policy)
        if tune:
            tune.prepare(model, self.num_classes)  # the head, the backbone's learning rate, frozen epochs
        return grayscale.apply(model, self.channels)

    def probe(self, precision: str, device: torch.device, channels_last: bool) -> auto.Probe:
        """What the auto probes train: this model built afresh (without --weights), as the run builds it."""
        return auto.Probe(self.name, lambda: self.build(with_weights=False), self.num_classes, self.img_size.value,
                          precision, device, channels_last)

    def structure(self) -> tuple[bool, int, int]:
        """(whether the model is convolutional, its repeated blocks, the bytes of its weights and buffers):
        read from a copy built without weights, on the meta device where PyTorch has one (no memory, no
        initialisation)."""

        model = compat.build_on_meta(lambda: self.build(with_weights=False))
        size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return models.is_convolutional(model), len(find_blocks(model)), size

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
        """A model of your own must return logits [N, classes] (dlenv.model.usermodel.check_output)."""
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
    """What the optimizer and schedule options resolved to: the optimizer, its rate and decay, and the
    warmup-cosine schedule in optimizer steps."""

    name: str
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    warmup_steps: int
    total_steps: int


@dataclass(frozen=True)
class StepChoice:
    """What every step does besides the optimizer: the loss's label smoothing, gradient clipping, the EMA
    of the weights, BatchNorm synchronised over GPUs."""

    label_smoothing: float
    clip_grad: float | None
    ema_decay: float | None         # None: no EMA
    sync_bn: bool


@dataclass(frozen=True)
class TrainPlan:
    """Every decision of a run's setup, resolved once (`decide`); plain values and their reasons."""

    config: TrainConfig             # the options as the run takes them: auto ones filled in (the CPU recipe's)
    data: pipeline.Located          # the dataset: its layout and classes (listed, no image decoded)
    precision: Decision             # "fp32", "fp16" or "bf16"
    model: ModelSpec
    channels_last: Decision         # bool: the model's and the batches' memory format on the device
    batch: Decision                 # Split: micro-batch per GPU, accumulation steps
    world_size: int
    input: InputPlan
    batches_per_epoch: int          # loader batches per epoch per GPU (--max-steps caps it)
    checkpoint_ratio: Decision | None  # the fraction of blocks recomputed; None without --checkpoint
    compile: Decision               # bool
    optimizer: OptimizerChoice
    step: StepChoice
    oom_retry: bool                 # --batch-size auto on one GPU: an OOM re-plans at half the micro-batch
    blocks: int = 0                 # the model's repeated blocks, of which --checkpoint recomputes a fraction
    dataset: Decision = Decision(None, "")  # what --data is: the folder (None: the demo), and why
    threads: Decision = Decision(1, "")     # PyTorch's intra-op threads: the CPUs this process may use (`_threads`)
    said: tuple[str, ...] = ()      # what the user is told of the decisions, in order

    @property
    def epochs(self) -> int:
        return self.config.epochs

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
    def dtype(self) -> torch.dtype:
        """The dtype of the batches on the device path: the precision's compute dtype."""

        return DTYPES[self.precision.value]

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last.value else torch.contiguous_format

    @property
    def recomputed_blocks(self) -> int:
        """How many blocks --checkpoint recomputes: the first round(ratio x blocks), as
        dlenv.model.checkpointing.apply_checkpointing wraps them; 0 without --checkpoint, on a CPU's auto, or for a
        model without repeated blocks."""
        return int(round(self.checkpoint_ratio.value * self.blocks)) if self.checkpoint_ratio else 0

    @property
    def halves(self) -> bool:
        """Whether a CUDA out-of-memory error re-plans the run (`halved`): --batch-size auto on one GPU, and
        a micro-batch that halves exactly into pieces of two or more (BatchNorm needs two samples)."""
        return self.oom_retry and self.micro_batch % 2 == 0 and self.micro_batch >= 4

    def halved(self, samples: int | None) -> TrainPlan:
        """This plan at half the micro-batch and twice the accumulation: the same images per optimizer step
        and the same steps per epoch (`samples`: this rank's samples of an epoch at the new batch, None for
        synthetic data), the input at the new batch."""
        micro, accum = self.micro_batch // 2, self.accum_steps * 2
        cap = self.batches_per_epoch * 2
        why = f"{micro} x {accum}: CUDA ran out of memory at micro-batch {self.micro_batch} ({self.batch.why})"
        return dataclasses.replace(self, batch=Decision(Split(micro, accum), why),
                                   input=dataclasses.replace(self.input, batch_size=micro),
                                   batches_per_epoch=min(math.ceil(samples / micro), cap) if samples else cap)

    def options(self) -> dict[str, Any]:
        """config.yaml's options: the run's options with every auto resolved, so the file reruns this run."""
        cfg = self.config
        return config.to_dict(dataclasses.replace(
            cfg, batch_size=self.micro_batch, accum_steps=self.accum_steps, effective_batch=None,
            optimizer=self.optimizer.name, lr=self.optimizer.lr, weight_decay=self.optimizer.weight_decay,
            img_size=self.input.img_size, workers=self.input.workers, resume=None,
            # the precision decided, not the flags: a CPU --amp run that trains in fp32 (bf16 was slower there)
            # is saved as fp32, so val, predict and export on that machine use what it trained in
            amp=self.precision.value != "fp32",
            amp_dtype=self.precision.value if self.precision.value != "fp32" else cfg.amp_dtype,
            compile="on" if self.compile.value else "off", hflip="on" if self.input.hflip else "off",
            checkpoint_ratio=self.checkpoint_ratio.value if self.checkpoint_ratio else cfg.checkpoint_ratio))

    def notes(self, device: torch.device) -> dict[str, Any]:
        """config.yaml's comments: what the options resolved to on this machine, and why."""
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {
            "precision": self.precision.value, "device": f"{device} ({gpu})", "world_size": self.world_size,
            "effective_batch": self.effective_batch, "data": self.data.source, "classes": len(self.data.classes),
            "input": self.input.describe(device).removeprefix("input: "), "torch": torch.__version__,
            "precision_rule": self.precision.why, "img_size_rule": self.model.img_size.why,
            "batch_rule": self.batch.why, "channels_last_rule": self.channels_last.why,
            "compile_rule": self.compile.why, "hflip_rule": self.input.hflip_why,
            "augment_rule": self.input.augment_why, "data_rule": self.dataset.why,
            "threads": self.threads.value, "threads_rule": self.threads.why,
            **({"workers_rule": self.input.workers_why} if self.input.workers_why else {}),
            **({"checkpoint_rule": self.checkpoint_ratio.why} if self.checkpoint_ratio else {}),
            **({"pretrained": self.model.pretrained.notes()} if self.model.pretrained else {}),
            **({"model_source": self.model.provenance} if self.model.provenance else {})}

    def start_line(self, device: torch.device, resuming: bool, run_dir: Any) -> str:
        """The line a run starts with: what trains on what, where, how, and the run folder."""
        return (f"{'resuming' if resuming else 'training'} {self.model.name} on {self.data.source} "
                f"({len(self.data.classes)} classes, {self.input.img_size} px) | {device} {self.precision.value}"
                f"{f', {self.threads.why}' if self.threads.why else ''}"
                f"{' channels_last' if self.channels_last.value else ''}"
                f"{self._checkpointing()} | batch {self.micro_batch} x "
                f"{self.accum_steps} accum x {self.world_size} GPU = {self.effective_batch}, {self.optimizer.name} "
                f"lr {self.optimizer.lr:g} | {run_dir}")

    def _checkpointing(self) -> str:
        # only blocks really recomputed are named: --checkpoint with none (a CPU's auto, ratio 0, a model
        # without blocks) trains as without it, and the header must not say otherwise
        k = self.recomputed_blocks
        return f" checkpointing {k} of {self.blocks} blocks" if k else ""


def decide(cfg: TrainConfig, resume: Any, dist: distributed.DistInfo, device: torch.device) -> TrainPlan:
    """Every setup decision of the run `cfg` on `device`, in the order each needs the last (see the module
    doc for what it reads and measures); `resume` a dlenv.runfolder.trainstate.Resume or None. Raises UserError for
    options this machine or data cannot honour."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # probes draw from copies: the run's streams stay seeded
        return _decide(cfg, resume, dist, device)


def _decide(cfg: TrainConfig, resume: Any, dist: distributed.DistInfo, device: torch.device) -> TrainPlan:
    said: list[str] = []
    dataset = _dataset(cfg, resume)
    if cfg.data is None and not cfg.synthetic:  # said only when the user did not name it
        said.append(f"data: {dataset.value or 'data/demo, the built-in demo'} ({dataset.why})")
    cfg = dataclasses.replace(cfg, data=dataset.value)
    cfg, recipe = train_defaults(cfg, device.type)  # the options left to auto; the demo's CPU recipe
    if recipe:
        said.append(recipe)
    located = pipeline.locate(cfg.data, cfg.synthetic, cfg.val_split, cfg.seed)
    spec = ModelSpec.resolve(cfg, located, fresh=resume is None)
    if usermodel.is_reference(spec.name):  # a model of your own gives logits [N, classes] before it is probed
        spec.check(spec.build(with_weights=False))
    precision = _precision(cfg, device, spec)
    if precision.value == "fp32" and cfg.amp:
        said.append(precision.why)
    # a GPU's decisions read the model's structure; a CPU's only for --checkpoint
    convolutional, blocks, weights = spec.structure() if cfg.checkpoint or device.type == "cuda" else (False, 0, 0)
    channels_last = _channels_last(cfg, device, convolutional)
    if cfg.checkpoint and blocks == 0:
        said.append(f"--checkpoint: {cfg.model} has no repeated blocks to checkpoint; training without it")
    # the GPU probes keep the margin they had when they ran beside the run's built model: its weights
    probe = dataclasses.replace(spec.probe(precision.value, device, channels_last.value), resident=weights)
    batch = _batch_split(cfg, dist, located, probe, resume, said.append)
    micro, accum = batch.value
    input_plan = InputOptions.of(cfg).decide(located, device, micro, spec.img_size.value, dist.local_world_size,
                                             norm=spec.norm, interpolation=spec.interpolation)
    if located.layout is not None:
        if input_plan.workers_why:
            said.append(input_plan.workers_why)  # /dev/shm held the workers back
        said.append(input_plan.describe(device))
        if cfg.hflip == "auto" and not input_plan.hflip and input_plan.augment != "none":
            said.append(f"--hflip {input_plan.hflip_why}")  # once: the flips the dataset report advises against
        if cfg.augment == "auto" and "characters" in input_plan.augment_why:
            said.append(f"--augment {input_plan.augment_why}")  # the gentle crops of character-like data
    # --synthetic keeps its batch on the device: it counts in the probe (float32 images)
    resident = weights + (micro * 3 * spec.img_size.value ** 2 * 4 if cfg.synthetic else 0)
    ratio = auto.checkpoint_ratio(cfg, blocks, dataclasses.replace(probe, resident=resident), micro, said.append)
    full_epoch = _batches(located, dist, micro, cfg.max_steps)
    batches_per_epoch = min(full_epoch, cfg.max_steps or full_epoch)
    # a resumed run has its saved on/off; auto counts the whole run's micro-batches per GPU
    compiled = auto.decide_compile(cfg.compile, device, cfg.epochs * batches_per_epoch)
    if (cfg.compile == "auto" and (compiled.value or not compat.HAS_COMPILE)) or (
            cfg.compile == "on" and not compiled.value):
        said.append(f"--compile {compiled.why}")  # once: when it compiles, or cannot
    optimizer = _optimizer(cfg, micro * accum * dist.world_size, math.ceil(batches_per_epoch / accum))
    if cfg.img_size is None:
        said.append(f"--img-size auto: {spec.img_size.value} px, {spec.img_size.why}")
    step = StepChoice(cfg.label_smoothing, cfg.clip_grad, cfg.ema_decay if cfg.ema else None, cfg.sync_bn)
    return TrainPlan(cfg, located, precision, spec, channels_last, batch, dist.world_size, input_plan,
                     batches_per_epoch, ratio, compiled, optimizer, step,
                     oom_retry=cfg.batch_size in ("auto", "max") and dist.world_size == 1, blocks=blocks,
                     dataset=dataset, said=tuple(said), threads=_threads(dist.local_world_size))


def _dataset(cfg: TrainConfig, resume: Any) -> Decision:
    """What --data is (dlenv.data.demo.default_data); a resumed run keeps its own, the demo included."""
    if resume is not None:
        return Decision(cfg.data, f"the resumed run's ({cfg.data or 'the built-in demo'})")
    return Decision(*default_data(cfg.data, cfg.synthetic))


def per_rank(located: pipeline.Located, micro: int, rank: int = 0, world_size: int = 1) -> int | None:
    """The training samples of an epoch on `rank` of `world_size` at micro-batch `micro` (the sampler's
    count: never a last batch of one); None for synthetic data."""

    if located.layout is None:
        return None
    return ResumableSampler(len(located.layout.train), rank=rank, world_size=world_size, batch_size=micro).per_rank


def _batches(located: pipeline.Located, dist: Any, micro: int, max_steps: int | None) -> int:
    """Loader batches in a whole epoch on this rank: the sampler's share in micro-batches; --synthetic's
    loader gives --max-steps of them (pipeline.SYNTHETIC_BATCHES without)."""
    n = per_rank(located, micro, dist.rank, dist.world_size)
    return math.ceil(n / micro) if n is not None else (max_steps or pipeline.SYNTHETIC_BATCHES)


def _threads(local_world_size: int) -> Decision:
    """PyTorch's intra-op threads (and OpenMP's in child processes): an OMP_NUM_THREADS the user set, else
    the CPUs this process may use (affinity and cgroup quota: dlenv.options.cpus) shared by the node's
    processes. PyTorch's own default counts the host's cores: on a limited or busy machine its threads
    wait for each other (docs/training.md, "CPU threads")."""
    n, why = cpus.threads()
    if local_world_size > 1 and "yours" not in why:
        n = max(1, n // local_world_size)
        why = f"{n} threads each: {why} shared by {local_world_size} processes"
    return Decision(n, why)


def _channels_last(cfg: TrainConfig, device: torch.device, convolutional: bool) -> Decision:
    """Whether the model and batches are channels_last on `device`: for convolutions on a GPU."""
    if not cfg.channels_last:
        return Decision(False, "--channels-last off")
    if device.type != "cuda":
        return Decision(False, f"off on {device.type} (it pays for convolutions on a GPU)")
    if not convolutional:
        return Decision(False, "off: the model is not convolutional")
    return Decision(True, "on: a convolutional model on a GPU")


def _precision(cfg: TrainConfig, device: torch.device, spec: ModelSpec) -> Decision:
    # CPU --amp: fp32 at once on a CPU without bf16 instructions; else a probe of a second, kept per machine;
    # then, on any device, one step of the run's model in the mode chosen. Each rank decides alone (one may
    # read the verdict another has just kept, or time bf16 a little differently), so all of them then agree
    # once, whatever each decided: fp32 if any chose it. (A collective inside the model's step, which only
    # ranks that chose bf16 reach, hung two CPU processes.)
    def model_step(mode: str) -> str | None:
        return auto.amp_step_error(lambda: spec.build(with_weights=False), mode, device, spec.img_size.value,
                                   spec.num_classes)

    decided = auto.decide_precision(cfg.amp, cfg.amp_dtype, device, cpuprobe.cpu_probe_seconds,
                                    cache=cpuprobe.cpu_amp_cache(),
                                    native=cpuprobe.cpu_bf16_native() if device.type == "cpu" else None,
                                    model_step=model_step)
    if distributed.agree(decided.value == "fp32", "max") and decided.value != "fp32":
        return Decision("fp32", f"--amp: another process of this run trains in fp32 (this one chose "
                        f"{decided.value}: {decided.why}), so every process does")
    return decided


def _batch_split(cfg: TrainConfig, dist: distributed.DistInfo, located: pipeline.Located, probe: auto.Probe,
                 resume: Any, say: Callable[[str], None]) -> Decision:
    """The Split (micro-batch per GPU, accumulation steps): the options, 'auto' measured on every GPU (all use the
    smallest), and on a resume with another number of GPUs the saved effective batch kept if it divides."""
    def measure() -> int:
        upper = len(located.layout.train) if located.layout is not None else 4096
        n = auto.auto_batch(probe, auto.start_ratio(cfg) if cfg.checkpoint else False, upper, say, cfg.batch_size)
        return int(distributed.agree(n, "min"))

    micro, accum = batchsplit.resolve_batch(cfg.batch_size, cfg.accum_steps, cfg.effective_batch, dist.world_size,
                                           measure)
    why = (f"--batch-size {cfg.batch_size}" + (" (measured)" if cfg.batch_size in ("auto", "max") else "")
           + (f", --effective-batch {cfg.effective_batch}" if cfg.effective_batch else
              f", --accum-steps {cfg.accum_steps}"))
    if resume is not None:
        micro, accum, note = batchsplit.resume_split(micro, accum, resume.saved_world, dist.world_size)
        if note:
            say(note)
            why = note
    return Decision(Split(micro, accum), why)


def _optimizer(cfg: TrainConfig, effective_batch: int, steps_per_epoch: int) -> OptimizerChoice:

    total = cfg.epochs * steps_per_epoch
    name = resolve_optimizer(cfg.optimizer, total)
    return OptimizerChoice(name, cfg.lr if cfg.lr is not None else default_lr(name, effective_batch),
                           cfg.weight_decay if cfg.weight_decay is not None else default_weight_decay(name),
                           cfg.momentum, cfg.nesterov, round(cfg.warmup_epochs * steps_per_epoch), total)
