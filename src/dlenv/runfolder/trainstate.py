"""What the trainer keeps in a run's files, saved and restored side by side: its counters (`TrainState`),
the saves of an epoch, config.yaml, and a --resume put back into a new run.

`payload` is what last.pth holds (the format: dlenv.files.runstate), `slim` the part of it best_model.pth
keeps (the weights people share, with the classes and the config: no optimizer, schedule or RNG
state); `save_last` and `save_best` write them (atomically, through runstate); `open_resume` reads a
--resume file and the options it was trained with, and `restore` puts its state into the new run's
objects. The RNG states are handed back rather than set: the trainer sets them last, after
everything that draws random numbers while it is being built (the model's initialisation).

Each rank of a run draws its own random numbers (seeded `seed + rank`: dropout, augmentation on the
device), so last.pth keeps every rank's states (`rng_ranks`, gathered to rank 0 by the trainer; `rng` is
rank 0's, as a single process saves it), and a resume gives each rank its own. Where that cannot be exact
(another number of ranks, a file from before `rng_ranks`), `Resume.limits` says so in one line.

A kill between the two saves of an improving epoch (last.pth first, then best_model.pth) leaves a
last.pth that records a best metric best_model.pth does not hold. Its state is then exactly the best
one (`best_epoch` is its epoch), so `settle_best`, at the start of the resumed run, writes
best_model.pth again from it; it also removes the temporary files killed writes left.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv import runfolder
from dlenv.engine.optim import load_optimizer_state, set_scheduled_lr
from dlenv.engine.step import NonFiniteLoss, Parts
from dlenv.errors import UserError
from dlenv.files import runstate, weights
from dlenv.files.atomic import remove_leftover_temps, write_text
from dlenv.model import modelsource, statedict
from dlenv.options import config
from dlenv.options.config import TrainConfig

#: Options a resumed run takes from the new command: where it runs, not what it computes.
RESUME_FROM_COMMAND = ("device", "workers", "gpus", "nnodes", "node_rank", "master_addr", "master_port",
                       "dist_timeout", "trust_pickle")
#: ... except when the command leaves them at their default: then the run's own value (the printed resume
#: command names neither): the run goes on where it was (a CPU run on the CPU, even where no GPU is
#: visible) at the speed it had
RESUME_FROM_RUN_UNLESS_GIVEN = ("workers", "device")
#: Options a resumed run takes from the new command when given: its end (`--epochs N`). The schedule is then
#: re-planned: the warmup-cosine of an N-epoch run, from the saved step on (`Resume.new_end`, `restore`)
RESUME_CHANGES = ("epochs",)
#: of those, the ones whose other value changes the numbers (another device computes in other kernels;
#: another worker count draws the same augmentation, dlenv.data.sampler.SeededDraws)
CHANGES_NUMBERS = ("device",)


@dataclass
class TrainState:
    """Counters of a run. `micro_batch` x `accum_steps` images per optimizer step per GPU (an OOM retry
    re-plans both: half the micro-batch, twice the accumulation)."""

    micro_batch: int
    accum_steps: int
    epoch: int = 0              # completed epochs
    step: int = 0               # optimizer steps done
    batch_in_epoch: int = 0     # loader batches trained on in the current epoch
    position: int = 0           # samples of the current epoch trained on (the sampler position)
    best_metric: float | None = None
    best_epoch: int | None = None   # the epoch whose end set best_metric (best_model.pth's weights)
    oom_retries: int = 0        # re-plans at half the micro-batch after CUDA out of memory
    skipped_run: int = 0        # consecutive skipped (fp16 overflow) optimizer steps
    # (sum, count) of the finite losses of the current epoch's micro-batches before this process took it up: a
    # mid-epoch save keeps them, so the resumed epoch's train_loss is the whole epoch's mean
    epoch_loss: tuple[float, int] = (0.0, 0)

    def saved(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "accum_steps": self.accum_steps, "oom_retries": self.oom_retries}


# ---------------------------------------------------------------------------------------------------
# Saving.


def payload(parts: Parts, state: TrainState, sampler: Any, meta: dict[str, Any],
            rng: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything a resume needs, now, as tensors and plain types (loads with weights_only=True). `rng`:
    every rank's RNG states in rank order (default: this process's, a run of one)."""
    rng = rng or [runstate.rng_state()]
    return {
        "format": runstate.FORMAT,
        "model": parts.bare.state_dict(),
        **meta,
        "epoch": state.epoch, "step": state.step, "batch_in_epoch": state.batch_in_epoch,
        "epoch_loss": [float(state.epoch_loss[0]), int(state.epoch_loss[1])],
        "best_metric": state.best_metric, "best_epoch": state.best_epoch,
        "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.precision.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "sampler": sampler.state_dict(state.position) if sampler is not None else None,
        "train_state": state.saved(),
        "rng": rng[0],
        **({"rng_ranks": rng} if len(rng) > 1 else {}),
        "env": runstate.environment(),
    }


def weights_finite(model: nn.Module) -> bool:
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True


def save_last(parts: Parts, state: TrainState, sampler: Any, meta: dict[str, Any], path: Path,
              rng: list[dict[str, Any]] | None = None) -> None:
    """Save last.pth (with `rng`, every rank's RNG states, see `payload`) unless the weights went
    non-finite (then the previous file stays the good one and NonFiniteLoss is raised)."""
    if not weights_finite(parts.bare):
        raise NonFiniteLoss(f"the weights became non-finite (epoch {state.epoch}, step {state.step})")
    runstate.save_state(payload(parts, state, sampler, meta, rng), path)


#: what best_model.pth keeps of last.pth: the weights and what it takes to use them (classes, size,
#: config); the optimizer, schedule, EMA, sampler and RNG states (most of last.pth) only resume a run
BEST_KEYS = ("format", "model", "model_name", "model_source", "num_classes", "class_names", "img_size", "config",
             "world_size", "epoch", "step", "best_metric", "best_epoch", "env")


def slim(full: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """best_model.pth's content: `full` (a last.pth payload) cut to BEST_KEYS, holding `weights`."""
    best = {k: full[k] for k in BEST_KEYS if k in full}
    best["model"] = weights
    return best


def save_best(parts: Parts, state: TrainState, sampler: Any, meta: dict[str, Any], path: Path) -> None:
    """Save best_model.pth: the weights that were validated (the EMA's, if any), classes and config."""
    weights = parts.ema.module.state_dict() if parts.ema is not None else parts.bare.state_dict()
    runstate.save_state(slim(payload(parts, state, sampler, meta), weights), path)


def _recorded_best(path: Path) -> float | None:
    """The best metric best_model.pth records; None when it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        run_file = runstate.load_state(path)
    except UserError:
        return None
    return run_file.get("best_metric") if isinstance(run_file, dict) else None


def settle_best(run_dir: Path, resume: Resume | None, best_metric: float | None,
                say: Callable[[str], None]) -> None:
    """At the start of a run in `run_dir` (holding its lock): remove the temporary files of killed writes
    and, on a resume, make best_model.pth hold the best metric last.pth records (see the module doc)."""
    removed = remove_leftover_temps(run_dir)
    if removed:
        say(f"removed {len(removed)} temporary file(s) that interrupted writes left in {run_dir}: "
            f"{', '.join(removed)}")
    if resume is None or best_metric is None:
        return
    path = run_dir / runfolder.BEST
    if _recorded_best(path) == best_metric:
        return
    if resume.best is None:  # the file was changed by hand: last.pth is past the best epoch
        say(f"note: {path} does not hold the best metric ({best_metric:.2f}) that {resume.path.name} records, "
            "and cannot be rebuilt from it; it is left as it is")
        return
    runstate.save_state(resume.best, path)
    resume.best = None
    say(f"wrote {path} again from {resume.path.name} (a stop interrupted its last save)")


def last_good(path: Path | None) -> str:
    """A sentence naming the last good run file, for the messages of a run that stops."""
    if path is not None and path.is_file():
        return f"The last good run file is {path}."
    return "No run file was written yet."


def write_config_yaml(path: Path, options: dict[str, Any], notes: dict[str, Any], started: float | None = None
                      ) -> None:
    """config.yaml: the resolved options (reusable with --cfg) and, as comments, when the run started (`started`:
    the start the file records already, else now; what `runfolder.newest` orders runs by) and what the options
    resolved to."""
    import yaml

    if started is None:
        started = runfolder.recorded_start(path.parent)[0] or time.time()
    head = ["# dlenv train: the options of this run, resolved; rerun with: dlenv train --cfg <this file>",
            f"# {runfolder.STARTED}: {runfolder.started_note(started)}"]
    head += [f"# {k}: {v}" for k, v in notes.items()]
    write_text(path, "\n".join(head) + "\n" + yaml.safe_dump(options, sort_keys=False))


def read_config_notes(path: Path) -> dict[str, str]:
    """The `# key: value` notes `write_config_yaml` put above the options (what auto chose, and why)."""
    return runfolder.config_notes(Path(path).read_text(encoding="utf-8"))


def nothing_trained(run_dir: Path | None) -> str | None:
    """For a new run's folder that its failure leaves before the first epoch's files (results.csv, last.pth):
    the words that say where it is and what it holds; None for no folder or one with results."""
    if run_dir is None or (run_dir / "results.csv").exists() or (run_dir / "last.pth").exists():
        return None
    return (f"nothing was trained: the run folder {run_dir} holds no results, only this attempt's config.yaml; "
            "delete it, or keep it as the record of this attempt")


# ---------------------------------------------------------------------------------------------------
# Resuming.


@dataclass
class Resume:
    """A --resume file being continued: its contents until `restore` took them, and where it lives."""

    run_file: dict[str, Any] | None
    path: Path
    ignored: list[str]          # flags given that a resume cannot change
    inexact: list[str] = dataclasses.field(default_factory=list)  # given flags that make it differ from the run
    best: dict[str, Any] | None = None  # best_model.pth's content when the saved state is the best one
    limits: list[str] = dataclasses.field(default_factory=list)  # why this resume is not exact (`restore`)
    found: str | None = None    # the line naming the file --resume auto chose, and how
    new_end: tuple[int, int] | None = None  # (the run's --epochs, the new one) when --epochs changes its end
    nothing_left: str | None = None  # --epochs N of a run that has trained exactly N epochs: the line that says so

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def saved_world(self) -> int:
        return int(self.run_file.get("world_size", 1))


def open_resume(cfg: TrainConfig) -> tuple[TrainConfig, Resume | None]:
    """(the options to run with, the Resume or None) for --resume. A resumed run keeps its saved options
    except where it runs (RESUME_FROM_COMMAND). Raises UserError for a file that is not a dlenv
    run file to resume (through runstate.load_state, for a missing or unsafe one)."""
    if not cfg.resume:
        return cfg, None
    path, found = runfolder.find_resume_said(cfg.resume, cfg.project)
    run_file = runstate.load_state(path, weights.LoadPolicy.of(cfg))
    modelsource.check_resume(run_file, cfg.model, f"--resume {path}")  # a model of your own: the import rule
    asked, saved_epochs = cfg.epochs, _saved_epochs(run_file)
    cfg, ignored, inexact = resume_config(run_file, cfg, path)
    resume = Resume(run_file, path, ignored, inexact, found=found)
    if saved_epochs is not None and cfg.epochs != saved_epochs:
        resume.new_end = (saved_epochs, cfg.epochs)
    if asked is not None and asked == int(run_file["epoch"]) and not int(run_file.get("batch_in_epoch") or 0):
        resume.nothing_left = (f"--epochs {asked}: {path} has trained {asked} epochs already, so there is nothing "
                               f"to do; give --epochs {asked + 1} or more to train on")
    return cfg, resume


def _saved_epochs(run_file: dict[str, Any]) -> int | None:
    saved = run_file.get("config")
    epochs = saved.get("epochs") if isinstance(saved, dict) else None
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None


def check_new_end(epochs: int, run_file: dict[str, Any], path: Path) -> None:
    """Refuse `--epochs epochs` on a resume of `run_file` that has trained past it (UserError, one line)."""
    done, partial = int(run_file["epoch"]), bool(int(run_file.get("batch_in_epoch") or 0))
    if epochs < done + partial:
        where = f"is in epoch {done + 1}" if partial else f"has trained {done} epochs"
        raise UserError(f"--epochs {epochs}: {path} {where}, past that end; give --epochs {done + partial} or "
                        f"more, or start a new run from its weights with --weights {path}")


def resume_config(run_file: dict[str, Any], given: TrainConfig, path: Path) -> tuple[TrainConfig, list[str], list[str]]:
    """(the saved run's options with only where it runs taken from this command, the flags given that a
    resume cannot change, the flags given that make it differ from the run: 'FLAG N (the run's M)')."""
    if not runstate.is_run_state(run_file) or "config" not in run_file or "optimizer" not in run_file:
        raise UserError(f"--resume {path}: not a dlenv run file to resume (no optimizer state); "
                        "pass a last.pth from runs/<name>/, or start from its weights with --weights")
    saved = _unsplit(config.from_dict(TrainConfig, run_file["config"]), run_file)
    # a value given that differs from both the default and the saved run was asked for, and is ignored
    ignored = [config.flag(f.name) for f in config.options(TrainConfig)
               if f.name not in (*RESUME_FROM_COMMAND, *RESUME_CHANGES, "resume")
               and getattr(given, f.name) != f.default and getattr(given, f.name) != getattr(saved, f.name)]
    kept = {name: getattr(given, name) for name in RESUME_FROM_COMMAND}
    kept.update({name: getattr(given, name) for name in RESUME_CHANGES
                 if getattr(given, name) is not None and getattr(given, name) != getattr(saved, name)})
    if "epochs" in kept:
        check_new_end(kept["epochs"], run_file, path)
    defaults = {f.name: f.default for f in config.options(TrainConfig)}
    inexact = []
    for name in RESUME_FROM_RUN_UNLESS_GIVEN:
        if kept[name] == defaults[name]:
            kept[name] = getattr(saved, name)
        elif kept[name] != getattr(saved, name) and name in CHANGES_NUMBERS:
            inexact.append(f"{config.flag(name)} {kept[name]} (the run's {getattr(saved, name)})")
    return dataclasses.replace(saved, resume=str(path), **kept), ignored, inexact


def _chunks(run_file: dict[str, Any]) -> int:
    """The pieces an OOM retry of an older dlenv split each saved batch into, where they were equal (1:
    none; this dlenv re-plans instead, dlenv.train.fit)."""
    ts, cfg = run_file.get("train_state"), run_file.get("config")
    k = int(ts.get("chunks", 1)) if isinstance(ts, dict) else 1
    batch = cfg.get("batch_size") if isinstance(cfg, dict) else None
    return k if k > 1 and isinstance(batch, int) and batch % k == 0 else 1


def _unsplit(saved: TrainConfig, run_file: dict[str, Any]) -> TrainConfig:
    """A run an older dlenv split after CUDA out of memory continues at the micro-batch it ran at."""
    k = _chunks(run_file)
    if k == 1:
        return saved
    return dataclasses.replace(saved, batch_size=saved.batch_size // k, accum_steps=saved.accum_steps * k)


def restore(resume: Resume, parts: Parts, state: TrainState, sampler: Any, rank: int = 0,
            world: int = 1) -> dict[str, Any]:
    """Load the saved model, optimizer, schedule, scaler, EMA, counters and sampler position into this
    run; returns this rank's saved RNG states (for the caller to set last) and frees the file's tensors.
    What keeps the resume from being exact goes to `resume.limits`.

    Raises UserError when the optimizer state does not fit this model.
    """

    run_file = resume.run_file
    statedict.load_strict(parts.bare, run_file["model"], resume.path)
    try:
        load_optimizer_state(parts.optimizer, run_file["optimizer"])
    except (ValueError, KeyError, TypeError) as e:  # torch's own check: groups or sizes differ
        raise UserError(f"--resume {resume.path}: its optimizer state does not fit this model ({e}); "
                        f"start a new run from its weights with --weights {resume.path}") from None
    parts.scheduler.load_state_dict(run_file["scheduler"])
    if resume.new_end is not None:  # the schedule of the new length, at the saved step, from this step on
        set_scheduled_lr(parts.scheduler)
    parts.precision.load_state_dict(run_file["scaler"])
    if parts.ema is not None and run_file.get("ema"):
        parts.ema.load_state_dict(run_file["ema"])
    ts = run_file["train_state"]
    state.epoch, state.step = int(run_file["epoch"]), int(run_file["step"])
    state.best_metric, state.best_epoch = run_file.get("best_metric"), run_file.get("best_epoch")
    if state.best_metric is not None and state.best_epoch == state.epoch and not int(run_file["batch_in_epoch"]):
        # saved at the end of the best epoch: what settle_best needs to write best_model.pth again
        resume.best = slim(run_file, run_file["ema"]["module"] if run_file.get("ema") else run_file["model"])
    state.oom_retries = int(ts.get("oom_retries", 0))
    if sampler is not None and run_file.get("sampler"):
        sampler.load_state_dict(run_file["sampler"])
        state.position = sampler.start
        # an older split run counted its batches before the split (`_unsplit`)
        state.batch_in_epoch = int(run_file["batch_in_epoch"]) * _chunks(run_file) if state.position else 0
        # an older run file has none: the resumed epoch's loss is then the mean of the resumed steps
        state.epoch_loss = tuple(run_file.get("epoch_loss") or (0.0, 0)) if state.batch_in_epoch else (0.0, 0)
    resume.run_file = None  # free its tensors
    return _rank_rng(resume, run_file, rank, world)


def _rank_rng(resume: Resume, run_file: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's saved RNG states; where there are none of its own, rank 0's, and a line in `resume.limits`."""
    ranks = run_file.get("rng_ranks")
    if not (isinstance(ranks, list) and all(isinstance(r, dict) and "torch" in r for r in ranks)):
        ranks = None  # none saved (one process, an older dlenv), or not what this dlenv writes
    saved_world = int(run_file.get("world_size", 1))
    if saved_world != world:
        resume.limits.append(f"the run had {saved_world} process(es), this resume has {world}: the epoch it stopped "
                             "in starts again and the ranks' random streams start anew, so it does not end "
                             f"bit-equal to the uninterrupted run (resume with {saved_world} for that)")
    elif world > 1 and not (ranks and len(ranks) == world):
        resume.limits.append(f"{resume.path.name} keeps rank 0's random streams only (written by an older dlenv): "
                             "every rank goes on from them, so it does not end bit-equal to the uninterrupted run")
    if ranks and len(ranks) == world:
        return ranks[rank]
    return run_file["rng"]
