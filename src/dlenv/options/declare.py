"""Declaring an option: `opt` (its default, help line, parser and bounds), `parse_option` (a value checked
against them, refused in one line naming the flag), and the bounds and words several commands' options
share (--batch-size, --img-size, --device, --trust-pickle, --channels, --decode-overlap, the most --workers on
this machine), and the rule that only the command line consents to --trust-pickle (`command_line_consent`).

dlenv.options.config declares every command's options with these (dlenv.options.predict_options and
dlenv.options.server_options too); what a typed value means is dlenv.options.values. No torch here: `dlenv --help` and
`invoke --list` import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

from dlenv.errors import UserError
from dlenv.options.cpus import usable_cpus
from dlenv.options.typos import word_hint
from dlenv.options.values import normalize_value, parse_bool, parse_float, parse_int, parse_str

_PARSERS: dict[type, Callable[[Any], Any]] = {bool: parse_bool, int: parse_int, float: parse_float, str: parse_str}


def opt(default: Any, help: str, *, parse: Callable[[Any], Any] | None = None,
        choices: tuple[str, ...] | None = None, positional: bool = False,
        min: float | None = None, max: float | None = None, why: str | None = None,
        here: Callable[[], tuple[int, str]] | None = None, bare: str | None = None, nargs: int | None = None) -> Any:
    """Declare one option: its default, its help line, and how a string becomes its value.

    `parse` defaults to the type of `default`; give it when the default is None or mixed ('auto'|int).
    `min`/`max` bound numbers (inclusive; each number of a list); `why` ends the line of a value over
    `max`. `here` is a bound that depends on this machine: () -> (most, why), applied to what a user
    gives now (flags, --cfg), not to the options a saved run was made with. `choices` bound strings.
    `bare` is the value of the flag given without one (`--compile` = `--compile on`), for options that
    were once plain switches. `nargs` is how many words the flag takes on the command line (`--compare A B`).
    """
    if parse is None:
        if default is None:
            raise TypeError("an option whose default is None needs parse=")
        parse = _PARSERS[type(default)]
    return field(default=default, metadata={
        "help": help, "parse": parse, "choices": choices, "positional": positional,
        "min": min, "max": max, "why": why, "here": here, "bare": bare, "nargs": nargs,
    })


def flag(name: str) -> str:
    """'batch_size' -> '--batch-size'."""
    return "--" + name.replace("_", "-")


def parse_option(f: Any, value: Any, here: bool = True) -> Any:
    """The value of option `f` (a dataclass field declared by `opt`) from `value`, with its bounds: `here`
    applies the bounds that depend on this machine. Raises UserError naming the flag."""
    md = f.metadata
    if value is None:
        if f.default is None:
            return None
        raise UserError(f"{flag(f.name)} needs a value (default: {f.default})")
    try:
        v = md["parse"](value)
    except (TypeError, ValueError) as e:
        raise UserError(f"{flag(f.name)} {value!r}: {e}; see --help") from None
    if md["choices"] and v not in md["choices"]:
        near = word_hint(str(v), md["choices"])  # `--format onx`: did you mean onnx?
        raise UserError(f"{flag(f.name)} {value!r} is not one of: {', '.join(md['choices'])}{near}")
    numbers = list(v) if isinstance(v, tuple) else [v]  # a list's bounds hold for each of its numbers
    for x in numbers:
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        if md["min"] is not None and x < md["min"]:
            raise UserError(f"{flag(f.name)} {value!r} is below its minimum {md['min']}")
        if md["max"] is not None and x > md["max"]:
            why = f" ({md['why']})" if md["why"] else ""
            raise UserError(f"{flag(f.name)} {value!r} is above its maximum {md['max']:,}{why}")
        if here and md["here"] is not None:
            most, why = md["here"]()
            if x > most:
                raise UserError(f"{flag(f.name)} {value!r} is above {most:,}, {why}")
    return v


#: --workers may be at most max(WORKERS_FLOOR, WORKERS_PER_CPU x the CPUs this process may use):
#: refused, not capped, so a run does what its config.yaml says. Loading waits on files as well as
#: CPUs, so a few workers per CPU can pay; thousands only spawn processes (10,000 were started)
WORKERS_FLOOR, WORKERS_PER_CPU = 64, 4


def workers_here() -> tuple[int, str]:
    """(the most --workers on this machine, why), for `opt(here=)`."""
    cpus = usable_cpus()
    most = max(WORKERS_FLOOR, WORKERS_PER_CPU * cpus)
    return most, (f"the most worker processes dlenv starts here ({WORKERS_PER_CPU} x the {cpus} CPU"
                  f"{'s' if cpus != 1 else ''} this process may use, at least {WORKERS_FLOOR}); use auto "
                  "or a smaller number")


# ---------------------------------------------------------------------------------------------------
# Bounds and words the commands' options share (dlenv.options.config, dlenv.options.predict_options)

DEVICE_HELP = "cuda, cuda:N, cpu or auto (the first GPU if there is one)"
#: the largest --batch-size, --accum-steps and --effective-batch: 2^20 images is far past what any GPU
#: holds at any size; a larger number is a slip of the keyboard (10^12 was accepted and printed)
BATCH_MAX = 2**20
BATCH_WHY = "2^20 images, far more than any GPU holds; use auto for the largest that fits"
#: the largest --img-size (and demo-data --size): the bound dlenv.files.runstate.MAX_IMG_SIZE puts on a
#: run file's img_size (a test holds the two equal; runstate imports torch, so it is not imported
#: here). 1,000,000 px used to reach the model's forward and ask torch for 24 TB
IMG_SIZE_MAX = 2048
IMG_WHY = "the largest image size dlenv trains, validates or reads from a run file"
#: the largest --epochs (and --freeze-epochs, --warmup-epochs, prune's --finetune-epochs): 10^20 was taken, and
#: the schedule, the ETA and the resume state were sized by it
EPOCHS_MAX = 100_000
EPOCHS_WHY = "far more epochs than any run trains; for a long run on a tiny dataset, give each epoch more data"
#: the most classes a command takes (predict's --classes names, bench-memory's --num-classes; dlenv.files.runstate
#: .MAX_CLASSES bounds a run file's the same way): 10^8 asked bench-memory's every configuration for 200 GB
CLASSES_MAX = 100_000
CLASSES_WHY = "the most classes a run file may hold"


def image_channels() -> Any:
    """--channels, declared once for every command that feeds images to a model (train, bench-memory)."""
    def parse(v: Any) -> int:
        n = _PARSERS[int](v)
        if n not in (1, 3):
            raise ValueError("1 (grayscale) or 3 (RGB)")
        return n

    return opt(3, "image channels the model takes: 3 (RGB) or 1 (grayscale: images are converted to one "
                  "channel, normalised with one mean and std), for a model whose first layer takes one channel "
                  "(MNIST's)", parse=parse)


def normalize_option() -> Any:
    """--normalize, declared once for the commands that run a trained model on images (val, predict)."""
    return opt("auto", "the normalisation after ToTensor: imagenet, none, or MEAN,STD (three means and three stds, "
                       "e.g. 0.5,0.5,0.5,0.25,0.25,0.25); auto: the weights' own (a dlenv run file's; a bare state "
                       "dict's preprocess.yaml beside it, else imagenet)", parse=normalize_value)


def resize_option() -> Any:
    """--resize, declared once beside --normalize (val, predict)."""
    return opt("auto", "how an image becomes --img-size square: crop (its shorter side to 8/7 of the size, then "
                       "the centre: dlenv's), full (the whole image squeezed to the size, as "
                       "transforms.Resize((N, N))); auto: the weights' own (preprocess.yaml, else crop)",
               choices=("auto", "crop", "full"))


def decode_overlap() -> Any:
    """--decode-overlap, declared once for the commands that build the training loader (train, bench-data)."""
    return opt("auto", "decode the next batch on the GPU in a thread and CUDA stream of its own while this one is "
                       "augmented, where --decoder nvimgcodec or nvjpeg decodes: on, off, or auto (off: overlapped "
                       "measured slower at 2 and 4 cores on an H200, docs/input-pipeline.md; on to measure it on "
                       "yours)", choices=("auto", "on", "off"))


def trust_pickle() -> Any:
    """--trust-pickle, declared once for every command that reads weights files (dlenv.files.weights)."""
    return opt(False, "hand torch.load(weights_only=True) a .pth that holds more than tensors and plain data, "
                      "or a TorchScript file (dlenv's run files and state dicts never need it; docs/weights.md); "
                      "only for files you trust. Command line only")


def command_line_consent(cfg: Any, given: dict[str, Any]) -> Any:
    """`cfg` with trust_pickle as typed on the command line (`given`: the flags typed): a value from a YAML
    file is dropped, so a config file someone sends cannot switch the check off (nor pass it on to torchrun
    workers). dlenv.files.weights.LoadPolicy.of reads the result."""
    if not hasattr(cfg, "trust_pickle"):
        return cfg
    typed = given.get("trust_pickle", False)
    typed = typed is True or str(typed).strip().lower() in ("1", "true", "yes", "on")
    return dataclasses.replace(cfg, trust_pickle=typed)
