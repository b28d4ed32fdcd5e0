"""Opening a trained model: `open_trained`, the one way `val`, `predict`, `prune` and `export` get a model
out of a file.

It returns a frozen `Trained`: the model (on the CPU, in eval mode), its class names, its preprocessing
(image size, normalisation, resampling), the precision it trained in, and the kind of file it came from:

    run_file     dlenv's own file (best_model.pth, last.pth, a copy, its .safetensors export): the
                 architecture is rebuilt by name (a channel-pruned one at the widths it records, see
                 dlenv.model.shrink) and everything else read from it, every number bounded (dlenv.files.runstate)
                 and the saved training options checked (`check_saved_options`)
    state_dict   another tool's weights: the architecture from --model, classes "0".."N-1"
    torchscript  a program: torch.jit.load runs the code it holds, so only with --trust-pickle, and with
                 --classes and --img-size, which the file does not carry
    onnx         run by onnxruntime (dlenv.files.onnxmodel); class names, size and normalisation from the
                 metadata `dlenv export` writes into it, else --classes and --img-size

A command names the kinds it takes; a file of another kind is refused in one line saying what to pass.
This module sits beside dlenv.files.runstate rather than in it: rebuilding a model needs dlenv.model.models, which
itself reads files through dlenv.files.runstate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlenv import compat, invocation
from dlenv.errors import UserError, printable
from dlenv.files import onnxmodel
from dlenv.files.runstate import is_bare_state_dict, is_run_state, load_state
from dlenv.files.weights import LoadPolicy, TorchScriptExport
from dlenv.model import pretrained
from dlenv.model.models import model_from_state
from dlenv.options import config
from dlenv.runfolder import preprocess

RUN_FILE, STATE_DICT, TORCHSCRIPT, ONNX = "run_file", "state_dict", "torchscript", "onnx"
#: every kind of file `open_trained` opens
ALL_KINDS = (RUN_FILE, STATE_DICT, TORCHSCRIPT, ONNX)
#: the image size taken when a file does not say
DEFAULT_SIZE = preprocess.DEFAULTS["img_size"]


@dataclass(frozen=True)
class Trained:
    """A trained model, ready to run on images prepared as it was trained."""

    path: Path
    kind: str                          # RUN_FILE, STATE_DICT, TORCHSCRIPT or ONNX
    model: torch.nn.Module             # on the CPU, in eval mode
    class_names: tuple[str, ...]       # in the model's output order
    img_size: int
    norm: tuple[tuple, tuple] | None   # (mean, std); None: ImageNet's
    interpolation: str                 # the resampling of the resize
    precision: str | None              # as trained: fp32, amp (the device's dtype), fp16, bf16; None: not said
    run_file: dict[str, Any] = field(default_factory=dict, repr=False)  # a run file's own entries ({}: other kinds)
    resize: str = "crop"               # crop (dlenv's centre crop) or full (the whole image to the size)

    @property
    def config(self) -> dict[str, Any]:
        """The training options the run file was saved with ({} when the file has none)."""
        cfg = self.run_file.get("config")
        return dict(cfg) if isinstance(cfg, dict) else {}


def trained_precision(config: dict[str, Any]) -> str | None:
    """The precision saved training options say a model trained in: fp32, amp (the device's choice),
    fp16, bf16; None for no options ({}: the file does not say)."""
    if not config:
        return None
    if not config.get("amp"):
        return "fp32"
    dtype = str(config.get("amp_dtype") or "auto")
    return dtype if dtype in ("fp16", "bf16") else "amp"


def check_saved_options(run_file: Any, path: Path | str) -> None:
    """Refuse a dlenv run file whose saved training options are not valid ones (dlenv.options.config's types and
    bounds), before anything reads them (its data folder, val split, seed, precision)."""

    if not (is_run_state(run_file) and isinstance(run_file.get("config"), dict)):
        return
    try:
        config.from_dict(config.TrainConfig, run_file["config"])
    except UserError as e:
        raise UserError(f"{path}: its saved training options are not valid ({e}); the file was edited "
                        "or written by another dlenv version, use another run file") from None


def is_onnx(path: Path) -> bool:
    return path.suffix.lower() == ".onnx"


def class_names_for(given: tuple | list | None, own: list[str], named: bool, shown: str) -> tuple[str, ...]:
    """The class names to report: the file's own when it has them (`given`, --classes, must agree), else
    `given`; `own` is "0".."N-1" for a file without names (`named` False); `shown` the file's path, printable.
    Raises UserError for --classes
    of another count than the model's outputs, or other names than the file's."""
    if given is None:
        return tuple(own)
    given = list(given)
    if len(given) != len(own):
        raise UserError(f"--classes names {len(given)} classes but {shown} has {len(own)} outputs; "
                        f"pass {len(own)} names in the model's output order")
    if named and given != list(own):
        raise UserError(f"--classes differs from the class names {shown} was trained with "
                        f"({', '.join(own[:5])}{', ...' if len(own) > 5 else ''}); drop --classes")
    return tuple(given)


def _refuse_kind(shown: str, kind: str, verb: str, what: str = "a bare state dict") -> UserError:
    """The line for the file `shown` (its path, printable) of a kind the command does not take (`what` the
    file is, for weights that are no dlenv run file)."""
    if kind == ONNX:
        return UserError(f"{shown} is an ONNX export; {verb} takes the run file it was exported from "
                         "(e.g. runs/exp/best_model.pth)")
    if kind == TORCHSCRIPT:
        return UserError(f"{shown} is a TorchScript export; {verb} takes the run file it was exported from")
    return UserError(f"{shown} is {what}, without class names or image size; {verb} needs a run file "
                     f"written by `{invocation.command('train', '')}` (best_model.pth or last.pth). Make one with "
                     f"{invocation.command('train', f'--weights {shown} --model NAME --data FOLDER --epochs 1')}")


def _open_torchscript(path: Path, shown: str, policy: LoadPolicy, classes: tuple | None,
                      img_size: int | None) -> Trained:
    """A TorchScript export: with consent, and the class names and size the file does not carry."""

    if not policy.trust_pickle:
        raise UserError(f"{shown} is a TorchScript export, a program: loading it runs the code it holds. Pass "
                        "--trust-pickle if you trust where it came from, or use the run file or its "
                        ".safetensors export (no code run)")
    if classes is None or img_size is None:
        raise UserError(f"{shown} is a TorchScript export, which stores no class names or image size; pass "
                        "--classes NAME,NAME,... and --img-size N (or use the run file it was exported from)")
    try:
        model = compat.jit_load(path, map_location="cpu").eval()
    except Exception as e:  # the file is what's wrong: truncated, or written by a newer PyTorch
        first = printable(str(e).strip().splitlines()[0][:160]) if str(e).strip() else type(e).__name__
        raise UserError(f"TorchScript file {shown} could not be loaded ({first}); export it again") from None
    try:
        with torch.inference_mode():
            width = model(torch.zeros(1, 3, img_size, img_size)).shape[-1]
    except Exception as e:
        first = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"{shown} does not run on {img_size}x{img_size} images ({printable(first)}); pass the "
                        "--img-size it was exported at") from None
    names = class_names_for(classes, [str(i) for i in range(int(width))], False, shown)
    return Trained(path, TORCHSCRIPT, model, names, int(img_size), None, "bilinear", None)


def _open_onnx(path: Path, shown: str, classes: tuple | None, img_size: int | None, device: Any) -> Trained:

    opened = onnxmodel.open_file(path, img_size, device)
    names = class_names_for(classes, list(opened.class_names), opened.named, shown)
    return Trained(path, ONNX, opened.module, names, opened.img_size, opened.norm, opened.interpolation, None)


def open_trained(path: str | Path, policy: LoadPolicy, model: str | None = None, *,
                 kinds: tuple[str, ...] = ALL_KINDS, verb: str = "this command", classes: tuple | None = None,
                 img_size: int | None = None, device: Any = None, prep: dict[str, Any] | None = None,
                 say: Callable[[str], Any] = print) -> Trained:
    """The trained model `path` holds, prepared as `prep` (--normalize and --resize) says; see `_open`."""
    given = {"img_size": img_size, **(prep or {})}
    trained = _open(Path(path), policy, model, kinds, verb, classes, given, device)
    if trained.kind == STATE_DICT:  # weights dlenv did not write: what is assumed, and from where
        how = preprocess.for_foreign(trained.path, given, "a bare state dict")
    else:
        own = preprocess.Preprocessing(trained.img_size, trained.norm, trained.resize, "")
        how = preprocess.overridden(own, given)
    if how.said:
        say(how.said)
    return dataclasses.replace(trained, img_size=how.img_size, norm=how.norm, resize=how.resize)


def _open(path: Path, policy: LoadPolicy, model: str | None, kinds: tuple[str, ...], verb: str,
          classes: tuple | None, given: dict[str, Any], device: Any) -> Trained:
    """The trained model `path` holds, opened under `policy` (what --trust-pickle allows).

    `model` is --model (a bare state dict's architecture, or a model of your own named again); `kinds`
    the kinds of file the command (`verb`, for messages) takes; `classes` is --classes (a file's own class
    names must agree with it); `given` holds --img-size, which wins over a file's size (and --normalize,
    --resize: open_trained's); `device` where an ONNX file will run (its onnxruntime provider). Raises
    UserError for a missing, foreign, unsafe or corrupt file, a kind the command does not take, a bare
    state dict without --model, weights that do not fit their architecture, invalid saved options,
    and --classes that do not fit the model.
    """

    img_size = given.get("img_size")
    shown = printable(str(path))
    if is_onnx(path):
        if ONNX not in kinds:
            raise _refuse_kind(shown, ONNX, verb)
        return _open_onnx(path, shown, classes, img_size, device)
    try:
        run_file = load_state(path, policy)
    except TorchScriptExport:  # the file's first bytes said so: nothing of it was read as weights
        if TORCHSCRIPT not in kinds:
            raise  # its line names the run file to pass instead
        return _open_torchscript(path, shown, policy, classes, img_size)
    check_saved_options(run_file, path)
    named = is_run_state(run_file)
    if not named and STATE_DICT not in kinds:
        raise _refuse_kind(shown, STATE_DICT, verb,
                           "a bare state dict" if is_bare_state_dict(run_file) else "not a dlenv run file")
    net, names, size = model_from_state(run_file, model, source=str(path))
    size = img_size or size or DEFAULT_SIZE  # a bare state dict's: decided by open_trained (preprocess)
    saved = dict(run_file.get("config") or {}) if named else {}
    return Trained(path, RUN_FILE if named else STATE_DICT, net.cpu().eval(),
                   class_names_for(classes, list(names), named, shown), int(size), pretrained.norm_of(run_file),
                   pretrained.interpolation_of(run_file), trained_precision(saved), dict(run_file) if named else {})
