"""Models of your own: `--model FILE.py:factory` and `--model package.module:factory`.

The file is resolved against the working folder (a project mounted at /root/workspace just works).
`factory(num_classes, **model_args)` returns an nn.Module mapping images [N, 3, H, W] to logits
[N, num_classes]. The trainer records where the model came from ({ref, sha256, args, file}) in
config.yaml and the run-state files, so val, prune and export rebuild it the same way.

Importing a file runs its code: a reference typed on the command line (--model) is the user's choice;
when one read from a weights file is imported is dlenv.model.modelsource's rule.
No torch import at module level. --model-args is parsed in dlenv.options.values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, first_line
from dlenv.files import requirements

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z_]\w*\Z")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


# ---------------------------------------------------------------------------------------------------
# References and model arguments


def is_reference(name: Any) -> bool:
    """Whether a --model value names a model of your own (FILE.py:factory, package.module:factory)."""
    return isinstance(name, str) and (":" in name or name.strip().endswith(".py"))


@dataclass(frozen=True)
class Reference:
    """A parsed reference: the text as given, the file path or module name, the factory's name."""

    text: str
    target: str
    factory: str
    is_file: bool

    def path(self) -> Path:
        """The file, resolved against the working folder (symlinks followed)."""
        return (Path.cwd() / Path(self.target).expanduser()).resolve()


def parse_reference(text: str) -> Reference:
    """Parse 'models/net.py:build' or 'mypkg.nets:build'. Raises UserError for any other form."""
    s = str(text).strip()
    target, sep, factory = s.rpartition(":")
    if not sep:
        raise UserError(f"--model {text!r} names a file but not the function that builds the model; "
                        f"add it, e.g. --model {s}:build")
    if not _NAME.match(factory):
        raise UserError(f"--model {text!r}: {factory!r} is not a Python name; use FILE.py:factory or "
                        "package.module:factory (e.g. models/net.py:build)")
    if target.endswith(".py"):
        return Reference(s, target, factory, True)
    if _MODULE.match(target):
        return Reference(s, target, factory, False)
    raise UserError(f"--model {text!r} is neither FILE.py:factory nor package.module:factory "
                    "(e.g. models/net.py:build or mypkg.nets:build)")


def same_reference(a: Reference, b: Reference) -> bool:
    """Whether two references name the same factory (files compared after resolving)."""
    if a.is_file != b.is_file or a.factory != b.factory:
        return False
    return a.path() == b.path() if a.is_file else a.target == b.target


# ---------------------------------------------------------------------------------------------------
# Importing the factory


@dataclass(frozen=True)
class Loaded:
    """An imported factory, its file and the file's sha256 (None for a module without a file)."""

    ref: Reference
    factory: Any
    file: Path | None
    sha256: str | None


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _on_path(folder: Path) -> None:
    # As `python script.py` would: the project folder (for `from utils.x import y` and package
    # references) and the file's own folder (for sibling modules) are importable.
    s = str(folder)
    if s not in sys.path:
        sys.path.insert(0, s)


def shown(path: Path) -> str:
    """A path as the user would write it: relative to the working folder where it lies inside."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def where(e: BaseException, file: Path | None) -> str:
    """' at line N of FILE' for the deepest frame of `e` in the user's file, or ''."""
    if file is None:
        return ""
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename) == file and e.lineno:
        return f" at line {e.lineno} of {shown(file)}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == file]
    return f" at line {lines[-1]} of {shown(file)}" if lines else ""


def _missing(e: BaseException) -> str:
    """For a module the model's code imports and this Python lacks (einops): whether requirements.txt lists it."""
    if isinstance(e, ModuleNotFoundError) and e.name:
        return requirements.missing_module_hint(e.name)
    return ""


def _import_file(ref: Reference) -> tuple[Any, Path, str]:
    path = ref.path()
    if not path.is_file():
        raise UserError(f"--model {ref.text}: {ref.target} not found in {Path.cwd()}; paths are relative to "
                        "the working folder (your project, /root/workspace in the image)")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    # One module per file and content: a changed file is a new module, the same one is imported once.
    key = hashlib.sha256(f"{path}\0{sha}".encode()).hexdigest()[:16]
    name = f"_dlenv_model_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{key}"
    module = sys.modules.get(name)
    if module is None:
        _on_path(Path.cwd())
        _on_path(path.parent)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses and pickling look it up there
        try:
            exec(compile(data, str(path), "exec"), module.__dict__)  # the bytes that were hashed
        except (Exception, SystemExit) as e:
            del sys.modules[name]
            raise UserError(f"--model {ref.text}: importing {ref.target} failed{where(e, path)}: "
                            f"{first_line(e)}{_missing(e)}") from None
    return module, path, sha


def _import_module(ref: Reference) -> tuple[Any, Path | None, str | None]:
    _on_path(Path.cwd())
    try:
        module = importlib.import_module(ref.target)
    except ModuleNotFoundError as e:
        if e.name and (ref.target == e.name or ref.target.startswith(e.name + ".")):
            raise UserError(f"--model {ref.text}: no module {e.name!r} in {Path.cwd()} or the installed "
                            "packages; run from your project folder, or name a file: --model "
                            f"path/to/file.py:{ref.factory}") from None
        raise UserError(f"--model {ref.text}: importing {ref.target} failed: {first_line(e)}{_missing(e)}") from None
    except (Exception, SystemExit) as e:
        raise UserError(f"--model {ref.text}: importing {ref.target} failed: {first_line(e)}") from None
    origin = getattr(module, "__file__", None)
    file = Path(origin).resolve() if origin and Path(origin).is_file() else None
    return module, file, file_sha256(file) if file else None


def load(ref: Reference) -> Loaded:
    """Import the reference's file or module and find its factory. Raises UserError for a file or
    module that is missing or fails to import (naming the line), and a factory missing or not callable."""
    module, file, sha = _import_file(ref) if ref.is_file else _import_module(ref)
    factory = getattr(module, ref.factory, None)
    if factory is None:
        defined = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                   and getattr(v, "__module__", None) == module.__name__]
        has = f"it defines {', '.join(defined[:8])}" if defined else "it defines no functions or classes"
        raise UserError(f"--model {ref.text}: {ref.target} has no {ref.factory!r}; {has}")
    if not callable(factory):
        raise UserError(f"--model {ref.text}: {ref.factory} in {ref.target} is a {type(factory).__name__}, "
                        "not a function or class; name the function that returns the model")
    return Loaded(ref, factory, file, sha)


def _signature(factory: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C extensions have none
        return None


def takes_img_size(factory: Any) -> bool:
    """Whether the factory has an img_size parameter."""
    sig = _signature(factory)
    return sig is not None and "img_size" in sig.parameters


# ---------------------------------------------------------------------------------------------------
# Building the model


def declared_img_size(name: str) -> int | None:
    """The image size a factory declares: its `img_size` attribute, or its img_size parameter's
    default. None for torchvision names and factories that declare none. Raises UserError for a
    declared size that is not an integer >= 16."""
    if not is_reference(name):
        return None
    factory = load(parse_reference(name)).factory
    size = getattr(factory, "img_size", None)
    if size is None and takes_img_size(factory):
        default = _signature(factory).parameters["img_size"].default
        size = None if default is inspect.Parameter.empty else default
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise UserError(f"--model {name}: it declares img_size {size!r}; an image size is an integer >= 16 "
                        "(or pass --img-size)")
    return size


def factory_args(name: str, args: dict[str, Any], img_size: int | None) -> dict[str, Any]:
    """The keyword arguments the factory of your own `name` is called with: `args` (--model-args), plus
    img_size when the factory has an img_size parameter and a size is given (dlenv.model.models.factory_kwargs
    decides every model's)."""
    if img_size is not None and takes_img_size(load(parse_reference(name)).factory):
        return {**args, "img_size": int(img_size)}
    return dict(args)


#: parameter names a factory may give the class count, tried in this order (an int or no default)
CLASS_COUNT_NAMES = ("num_classes", "n_classes", "num_class", "n_class", "nclasses", "classes", "class_num",
                     "num_labels")


@dataclass(frozen=True)
class _Call:
    """How dlenv calls a factory: positional and keyword arguments, where the class count went, and the
    one line it prints when that was a guess (None when the factory's signature named it)."""

    args: tuple
    kwargs: dict[str, Any]
    into: str | None            # the parameter that receives the class count; None: not passed
    note: str | None

    def text(self, factory: str) -> str:
        return f"{factory}({', '.join([repr(a) for a in self.args] + [f'{k}={v!r}' for k, v in self.kwargs.items()])})"


def _class_call(factory: Any, name: str, num_classes: int, kwargs: dict[str, Any]) -> _Call:
    """Where the class count goes, as the factory's author wrote it: by keyword into a parameter named in
    CLASS_COUNT_NAMES; else into **kwargs (timm's entrypoints pass them on to the model); else, as a guess,
    into the first free positional parameter without a default or with an int one; else nowhere (kuangliu's
    `ResNet18()` builds its 10 classes itself, and the output check says when that is not the data's)."""
    sig = _signature(factory)
    if sig is None:
        return _Call((num_classes,), kwargs, "the first positional parameter",
                     f"--model {name}: its signature cannot be read; called {name.rpartition(':')[2]}({num_classes}"
                     f"{''.join(f', {k}={v!r}' for k, v in kwargs.items())}) with the class count first (a guess)")
    params = sig.parameters
    named = [n for n in CLASS_COUNT_NAMES if n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY
             and (params[n].default is inspect.Parameter.empty
                  or (isinstance(params[n].default, int) and not isinstance(params[n].default, bool)))]
    if set(CLASS_COUNT_NAMES) & set(kwargs):
        return _Call((), kwargs, None, None)  # --model-args gave it: the user's own choice
    if named:
        return _Call((), {named[0]: num_classes, **kwargs}, named[0], None)
    factory_name = name.rpartition(":")[2]
    accepted = ", ".join(CLASS_COUNT_NAMES[:4]) + ", ..."
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        call = _Call((), {**kwargs, "num_classes": num_classes}, "**kwargs", None)
        return dataclasses.replace(call, note=(
            f"--model {name}: called {call.text(factory_name)}; it names no class-count parameter ({accepted}), "
            "so num_classes went into its **kwargs"))
    free = [p for p in params.values() if p.name not in kwargs
            and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if free and (free[0].default is inspect.Parameter.empty
                 or (isinstance(free[0].default, int) and not isinstance(free[0].default, bool))):
        first = free[0]
        if first.kind is inspect.Parameter.POSITIONAL_ONLY or first is next(iter(params.values())):
            call = _Call((num_classes,), kwargs, first.name, None)
        else:
            call = _Call((), {**kwargs, first.name: num_classes}, first.name, None)
        return dataclasses.replace(call, note=(
            f"--model {name}: called {call.text(factory_name)}; it names no class-count parameter ({accepted}), "
            f"so the class count went into {first.name!r} (a guess; name it num_classes to be sure)"))
    call = _Call((), kwargs, None, None)
    return dataclasses.replace(call, note=(
        f"--model {name}: called {call.text(factory_name)} without the class count ({factory_name}{sig} takes "
        f"none of {accepted}); its output must already have {num_classes} classes"))


def default_classes(name: str, model_args: dict[str, Any] | None = None) -> int | None:
    """The class count a factory builds when given none: the int default of the parameter `_class_call`
    puts the count into (kuangliu's `MobileNetV2(num_classes=10)`: 10); None where that parameter has no
    default, the count goes into **kwargs, or nowhere (the model's own output says then)."""
    factory = load(parse_reference(name)).factory
    sig = _signature(factory)
    how = _class_call(factory, name, 0, dict(model_args or {}))
    if sig is None or how.into not in sig.parameters:
        return None
    default = sig.parameters[how.into].default
    return default if isinstance(default, int) and not isinstance(default, bool) and default >= 1 else None


def build(name: str, num_classes: int, /, **kwargs: Any) -> Any:
    """The model of the reference `name`: its factory called the way its author wrote it (`_class_call`:
    the class count by keyword where the signature names it), checked to be an nn.Module. When dlenv had
    to guess where the class count goes, one line shows the call and the parameter. (`name` and
    `num_classes` are positional-only: a factory may take keyword arguments of any name, `name` too.)

    Raises UserError for arguments the factory does not take, an exception inside it (naming the line
    of your file and where the class count went) and a result that is not an nn.Module.
    """
    from torch import nn

    loaded = load(parse_reference(name))
    ref = loaded.ref
    how = _class_call(loaded.factory, ref.text, num_classes, kwargs)
    call = how.text(ref.factory)
    landed = (f"; the class count went into {how.into!r} (a guess)" if how.note and how.into else
              "; dlenv passed no class count" if how.into is None and how.note else "")
    sig = _signature(loaded.factory)
    if sig is not None:
        try:
            sig.bind(*how.args, **how.kwargs)
        except TypeError as e:
            raise UserError(f"--model {ref.text}: cannot call {call}: {e}{landed}; --model-args must name its "
                            f"keyword arguments ({ref.factory}{sig})") from None
    if how.note:
        log.warning("%s", how.note)
    try:
        model = loaded.factory(*how.args, **how.kwargs)
    except UserError:
        raise
    except Exception as e:
        fix = (f"; give {ref.factory}'s own arguments with --model-args (e.g. {how.into}=...)" if how.note and how.into
               and how.into != "**kwargs" else "")
        raise UserError(f"--model {ref.text}: {call} failed{where(e, loaded.file)}: {first_line(e)}{landed}{fix}"
                        ) from None
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {ref.text}: {call} returned a {type(model).__name__}, not a torch.nn.Module; "
                        "return the model")
    return model


def first_conv_channels(model: Any) -> int | None:
    """The input channels of the model's first 2-D convolution (in registration order), or None."""
    from torch import nn

    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return None if conv is None else int(conv.in_channels)


def channels_hint(model: Any, channels: int) -> str:
    """'; its first convolution takes 1 channel(s), dlenv fed 3: add --channels 1' where they differ, else ''."""
    takes = first_conv_channels(model)
    if takes is None or takes == channels or takes not in (1, 3):
        return ""
    what = "grayscale" if takes == 1 else "RGB"
    return (f"; its first convolution takes {takes} channel(s) and dlenv fed {channels}: add --channels {takes} "
            f"(dlenv then feeds {what} images)")


def probe_output(model: Any, name: str, img_size: int, channels: int = 3) -> Any:
    """One training-mode forward of 2 random images [2, channels, img_size, img_size] without gradients, the
    model's buffers (BatchNorm statistics) and the RNG put back; returns what the model returned. Raises
    UserError naming the error and its line in the user's file (and --channels where the first convolution
    takes another count)."""
    import torch

    from dlenv import compat

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    shape = f"2 images of {channels}x{img_size}x{img_size}"
    file = parse_reference(name).path() if is_reference(name) and parse_reference(name).is_file else None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        try:
            return model(torch.randn(2, channels, img_size, img_size, device=device))
        except Exception as e:
            if compat.is_oom(e):
                raise
            raise UserError(f"--model {name}: the model's forward failed on {shape}{where(e, file)}: "
                            f"{first_line(e)}{channels_hint(model, channels)}") from None
        finally:
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])


def _logits_shape_error(out: Any, name: str, shape: str, expected: str) -> UserError:
    import torch

    what = (f"a tensor of shape [{', '.join(map(str, out.shape))}]"
            + ("" if out.is_floating_point() else f" of {out.dtype}")) if torch.is_tensor(out) else (
        f"a {type(out).__name__}")
    return UserError(f"--model {name}: the model returned {what} for {shape}; its forward must "
                     f"return logits of shape [N, num_classes] = {expected} (in training mode too)")


def check_output(model: Any, name: str, num_classes: int, img_size: int, channels: int = 3) -> None:
    """For a model of your own: one training-mode forward of 2 random images without gradients must give
    logits [2, num_classes] (`probe_output`). Raises UserError naming what came back, or the error and its
    line. Does nothing for torchvision names. (Log-probabilities, as a log_softmax output, count as logits:
    cross-entropy of log-probabilities is their negative log-likelihood, and their argmax is the class.)"""
    if not is_reference(name):
        return
    import torch

    out = probe_output(model, name, img_size, channels)
    if not (torch.is_tensor(out) and out.is_floating_point() and tuple(out.shape) == (2, num_classes)):
        raise _logits_shape_error(out, name, f"2 images of {channels}x{img_size}x{img_size}",
                                  f"[2, {num_classes}]")


def output_classes(model: Any, name: str, img_size: int, channels: int = 3) -> int:
    """The class count a model's own head gives: the width of its logits for 2 random images
    (`probe_output`), for a measurement that must use the model as it is (bench-memory). Raises
    UserError when the output is not logits [2, K]."""
    import torch

    out = probe_output(model, name, img_size, channels)
    if not (torch.is_tensor(out) and out.is_floating_point() and out.dim() == 2 and out.shape[0] == 2):
        raise _logits_shape_error(out, name, f"2 images of {channels}x{img_size}x{img_size}", "[2, K]")
    return int(out.shape[1])


def provenance(name: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Where the model came from, for config.yaml and run-state files: {"ref", "sha256", "args",
    "file"} (plain types), or None for a torchvision name."""
    if not is_reference(name):
        return None
    loaded = load(parse_reference(name))
    return {"ref": loaded.ref.text, "sha256": loaded.sha256, "args": dict(kwargs),
            "file": str(loaded.file) if loaded.file else None}


# ---------------------------------------------------------------------------------------------------
# Blocks a model names itself


def declared_blocks(model: Any) -> list | None:
    """The blocks `model.checkpoint_blocks` lists (modules, or names as in named_modules), in order; None
    without that attribute. Raises UserError for an unknown name, a non-module, or a nested block."""
    from torch import nn

    own = getattr(model, "checkpoint_blocks", None)
    if own is None:
        return None
    what = f"{type(model).__name__}.checkpoint_blocks"
    if isinstance(own, (str, nn.Module)) and not isinstance(own, (nn.ModuleList, nn.Sequential)):
        own = [own]
    blocks: list = []
    for entry in own:
        if isinstance(entry, str):
            try:
                entry = model.get_submodule(entry)
            except AttributeError:
                raise UserError(f"{what} names {entry!r}, which the model does not have; use names from "
                                "model.named_modules(), e.g. 'blocks.0'") from None
        if not isinstance(entry, nn.Module):
            raise UserError(f"{what} holds a {type(entry).__name__}; list modules or their names")
        if not any(entry is b for b in blocks):
            blocks.append(entry)
    for b in blocks:
        inner = [m for m in b.modules() if m is not b and any(m is o for o in blocks)]
        if inner:
            raise UserError(f"{what} lists a {type(inner[0]).__name__} inside a listed {type(b).__name__}; "
                            "list each block once, not also its parts")
    return blocks
