"""Models of your own: `--model FILE.py:factory` and `--model package.module:factory`.

The file is resolved against the working folder (a project mounted at /root/workspace just works).
`factory(num_classes, **model_args)` returns an nn.Module mapping images [N, 3, H, W] to logits
[N, num_classes]. The trainer records where the model came from ({ref, sha256, args, file}) in
config.yaml and the run-state files, so val, prune and export rebuild it the same way.

Importing a file runs its code. A reference typed on the command line (--model) is the user's choice.
One read from a weights file (its model_name, model_source) is imported only when it is the model this
project trained with (`project_model`): a relative path without `..` (or a package.module) whose files
all lie inside the working folder (symlinks resolved), none under data/ (where `unpack` puts what
archives hold), and whose file is byte for byte the one the run recorded (sha256 in model_source).
Anything else is refused in one line, before any import, naming --model as the way to vouch for it.
Numbers and names a file gives for the factory's arguments are bounded (`read_source`).
No torch import at module level (dlenv.config imports this).
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

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z_]\w*\Z")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
# Given by dlenv itself: the data's class count, and --img-size to a factory that takes img_size.
_RESERVED = {"num_classes": "it comes from the data", "img_size": "pass --img-size instead"}
#: where `unpack` writes by default: code under it came out of an archive, not from the project's author
DATA_DIR = "data"
#: bounds on factory arguments read from a file (typed ones are the user's own)
MAX_ARGS = 32
MAX_INT = 65536
MAX_FLOAT = 1e6
MAX_TEXT = 256


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


def _value(raw: str) -> Any:
    """'32' -> 32, '0.1' -> 0.1, 'true' -> True, 'none' -> None, "'32'" -> '32', 'gelu' -> 'gelu'."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return raw


def parse_model_args(value: Any) -> dict[str, Any]:
    """'width=32,drop=0.1,act=gelu' (or a mapping, from a YAML file) -> {'width': 32, 'drop': 0.1, ...}.

    Values become int, float, bool (true/false), None (none) or str; quotes keep a string ('"32"').
    Raises ValueError naming the bad item.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        items = list(value.items())
        for k, v in items:
            if not isinstance(v, (int, float, str, bool, type(None))):
                raise ValueError(f"{k}: {v!r} is not a number, string, true/false or none")
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            key, eq, raw = part.partition("=")
            if not eq or not raw.strip():
                raise ValueError(f"{part.strip()!r} is not key=value (e.g. width=32,drop=0.1)")
            items.append((key.strip(), _value(raw.strip())))
    out: dict[str, Any] = {}
    for k, v in items:
        if not isinstance(k, str) or not _NAME.match(k):
            raise ValueError(f"{k!r} is not a keyword argument name")
        if k in _RESERVED:
            raise ValueError(f"{k} is not a model argument: {_RESERVED[k]}")
        if k in out:
            raise ValueError(f"{k} is given twice")
        out[k] = v
    return out


def _text(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "none"}[v]
    if isinstance(v, str):
        if "," in v:
            raise ValueError(f"{v!r}: a value cannot hold a comma")
        return v if _value(v) == v and v.strip() == v else f"'{v}'"
    return repr(v)


def model_args_text(value: Any) -> str:
    """The canonical 'k=v,...' form of --model-args (what config.yaml and checkpoints hold).

    Raises ValueError for a malformed value (dlenv.config turns it into a one-line UserError)."""
    return ",".join(f"{k}={_text(v)}" for k, v in parse_model_args(value).items())


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


def _shown(path: Path) -> str:
    """A path as the user would write it: relative to the working folder where it lies inside."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _where(e: BaseException, file: Path | None) -> str:
    """' at line N of FILE' for the deepest frame of `e` in the user's file, or ''."""
    if file is None:
        return ""
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename) == file and e.lineno:
        return f" at line {e.lineno} of {_shown(file)}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == file]
    return f" at line {lines[-1]} of {_shown(file)}" if lines else ""


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
            raise UserError(f"--model {ref.text}: importing {ref.target} failed{_where(e, path)}: "
                            f"{first_line(e)}") from None
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
        raise UserError(f"--model {ref.text}: importing {ref.target} failed: {first_line(e)}") from None
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


def _takes_img_size(factory: Any) -> bool:
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
    if size is None and _takes_img_size(factory):
        default = _signature(factory).parameters["img_size"].default
        size = None if default is inspect.Parameter.empty else default
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise UserError(f"--model {name}: it declares img_size {size!r}; an image size is an integer >= 16 "
                        "(or pass --img-size)")
    return size


def factory_kwargs(name: str, model_args: Any, img_size: int | None) -> dict[str, Any]:
    """The keyword arguments the factory is called with: --model-args, plus img_size when the factory
    has an img_size parameter (for timm/<arch>: when the architecture's input size is fixed, as a ViT's).
    {} for a torchvision name; UserError when --model-args is given to one."""
    from dlenv import pretrained

    args = parse_model_args(model_args)
    if pretrained.is_timm(name):
        if img_size is not None and pretrained.timm_fixed_size(name):
            args["img_size"] = int(img_size)
        return args
    if not is_reference(name):
        if args:
            raise UserError(f"--model-args is for models of your own (--model FILE.py:factory) and timm's "
                            f"(--model timm/ARCH); {name} takes none")
        return {}
    if img_size is not None and _takes_img_size(load(parse_reference(name)).factory):
        args["img_size"] = int(img_size)
    return args


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
        raise UserError(f"--model {ref.text}: {call} failed{_where(e, loaded.file)}: {first_line(e)}{landed}{fix}"
                        ) from None
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {ref.text}: {call} returned a {type(model).__name__}, not a torch.nn.Module; "
                        "return the model")
    return model


def check_output(model: Any, name: str, num_classes: int, img_size: int) -> None:
    """For a model of your own: one training-mode forward of 2 random images without gradients must give
    logits [2, num_classes]; buffers (BatchNorm statistics) and the RNG are put back. Raises UserError
    naming what came back, or the error and its line. Does nothing for torchvision names."""
    if not is_reference(name):
        return
    import torch

    from dlenv import compat

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    shape = f"2 images of 3x{img_size}x{img_size}"
    file = parse_reference(name).path() if parse_reference(name).is_file else None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        try:
            out = model(torch.randn(2, 3, img_size, img_size, device=device))
        except Exception as e:
            if compat.is_oom(e):
                raise
            raise UserError(f"--model {name}: the model's forward failed on {shape}{_where(e, file)}: "
                            f"{first_line(e)}") from None
        finally:
            for k, b in model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
    if not (torch.is_tensor(out) and out.is_floating_point() and tuple(out.shape) == (2, num_classes)):
        what = (f"a tensor of shape [{', '.join(map(str, out.shape))}]"
                + ("" if out.is_floating_point() else f" of {out.dtype}")) if torch.is_tensor(out) else (
            f"a {type(out).__name__}")
        raise UserError(f"--model {name}: the model returned {what} for {shape}; its forward must "
                        f"return logits of shape [N, num_classes] = [2, {num_classes}] (in training mode too)")


def provenance(name: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Where the model came from, for config.yaml and run-state files: {"ref", "sha256", "args",
    "file"} (plain types), or None for a torchvision name."""
    if not is_reference(name):
        return None
    loaded = load(parse_reference(name))
    return {"ref": loaded.ref.text, "sha256": loaded.sha256, "args": dict(kwargs),
            "file": str(loaded.file) if loaded.file else None}


# ---------------------------------------------------------------------------------------------------
# Rebuilding from a checkpoint, and the trust rule


def _arg_ok(v: Any) -> bool:
    if isinstance(v, bool) or v is None:
        return True
    if isinstance(v, int):
        return abs(v) <= MAX_INT
    if isinstance(v, float):
        return v == v and abs(v) <= MAX_FLOAT
    return isinstance(v, str) and len(v) <= MAX_TEXT


def read_source(source: Any, what: str) -> tuple[str, str | None, dict[str, Any]]:
    """(reference, sha256 or None, factory arguments) of a file's model_source entry, every value
    bounded. Raises UserError naming the entry, the value and the bound."""
    if not (isinstance(source, dict) and isinstance(source.get("ref"), str) and len(source["ref"]) <= MAX_TEXT
            and isinstance(source.get("args") or {}, dict)):
        raise UserError(f"{what}: its 'model_source' entry is malformed; pass the model again with "
                        "--model FILE.py:factory")
    sha = source.get("sha256")
    args = dict(source.get("args") or {})
    if len(args) > MAX_ARGS:
        raise UserError(f"{what}: its model_source gives {len(args)} factory arguments, more than {MAX_ARGS}; "
                        "the file was edited or damaged, use another checkpoint")
    for k, v in args.items():
        if not (isinstance(k, str) and _NAME.match(k) and k not in _RESERVED):
            raise UserError(f"{what}: its model_source names the factory argument {str(k)[:40]!r}, not a keyword "
                            "argument name; the file was edited or damaged, use another checkpoint")
        if not _arg_ok(v):
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise UserError(f"{what}: its model_source gives {k}={shown}, beyond the bounds for a value read "
                            f"from a file (numbers within +-{MAX_INT} (integers) or +-{MAX_FLOAT:g}, text up to "
                            f"{MAX_TEXT} characters); the file was edited or damaged, use another checkpoint")
    return source["ref"], sha if isinstance(sha, str) else None, args


def _module_files(target: str) -> list[Path] | None:
    """The files importing `target` (a.b.c) from the working folder would run (a/__init__.py,
    a/b/__init__.py, a/b/c.py), found without running any of them; None when it is not there."""
    from importlib.machinery import PathFinder

    search: list[str] | None = [str(Path.cwd())]
    parts = target.split(".")
    files = []
    for n in range(1, len(parts) + 1):
        spec = PathFinder.find_spec(".".join(parts[:n]), search)
        if spec is None or not spec.has_location or not spec.origin:
            return None  # not in the project folder, or a namespace package
        files.append(Path(spec.origin))
        search = list(spec.submodule_search_locations or [])
        if n < len(parts) and not search:
            return None
    return files


def project_model(ref: Reference, sha: str | None) -> str | None:
    """Why the reference `ref` read from a file is not the model this project trained with (see the
    module doc), or None when it is. Runs nothing: reads paths and the file's bytes only."""
    cwd = Path.cwd().resolve()
    if ref.is_file:
        rel = Path(ref.target)
        if rel.is_absolute() or ref.target.startswith("~"):
            return "an absolute path"
        if ".." in rel.parts:
            return "a path that climbs out of the working folder with '..'"
        files: list[Path] | None = [cwd / rel]
    else:
        files = _module_files(ref.target)
        if files is None:
            return f"a module not found in the working folder {cwd}"
    for f in files:
        if not f.is_file():
            return f"{_shown(f)} not found in the working folder {cwd}"
        real = f.resolve()
        if not real.is_relative_to(cwd):
            return f"{_shown(f)}, which leads outside the working folder {cwd}"
        if real.relative_to(cwd).parts[:1] == (DATA_DIR,):
            return f"{_shown(real)}, under {DATA_DIR}/ where unpacked archives go"
    if not sha:
        return "without the sha256 of the file it was trained with"
    if file_sha256(files[-1]) != sha:
        return (f"and {_shown(files[-1])} is not the file it was trained with (sha256 {sha[:12]} then, "
                f"{file_sha256(files[-1])[:12]} now)")
    return None


def check_source(source: Any, given: str | None, what: str) -> Reference:
    """The import rule for a file's model source; returns the reference to build (nothing imported yet).

    A reference `given` with --model is the user's choice and used (a one-line warning when its file
    differs from the recorded one); else the file's own is used only when `project_model` accepts it.
    Raises UserError, naming why and --model as the way to vouch for it."""
    saved, sha, _ = read_source(source, what)
    if given and is_reference(given):
        ref = parse_reference(given)
        now = load(ref).sha256
        if sha and now and now != sha:
            log.warning("%s: %s differs from the file this checkpoint was trained with (sha256 %s then, %s now); "
                        "building the model from it as it is", what, ref.target, sha[:12], now[:12])
        return ref
    ref = parse_reference(saved)
    why = project_model(ref, sha)
    if why:
        raise UserError(f"{what} names --model {saved}, {why}; importing it would run its code, so it is not "
                        f"imported. If you trust it, pass --model {saved} (or where that file is now) yourself")
    return ref


def rebuild(source: Any, name: str, num_classes: int, given: str | None, what: str) -> Any:
    """A checkpoint's model of your own, from its factory and recorded arguments, after `check_source`.
    Without a source (a bare state dict, a file that names a reference but not its origin) only a
    reference the user gave with --model is built."""
    if source is None:
        if not (given and is_reference(given)):
            raise UserError(f"{what} names --model {name} but not where it came from (no model_source); "
                            f"importing it would run its code, so it is not imported. If you trust it, pass "
                            f"--model {name} yourself")
        return build(given, num_classes)
    ref = check_source(source, given, what)
    return build(ref.text, num_classes, **read_source(source, what)[2])


def check_resume(ckpt: Any, given: str | None, what: str) -> None:
    """`check_source` before a resume builds the saved run's model; as a resume always builds the saved
    reference, only that one (in any spelling) counts as given again."""
    source = ckpt.get("model_source") if isinstance(ckpt, dict) else None
    if not source:
        name = ckpt.get("model_name") if isinstance(ckpt, dict) else None
        if is_reference(name) and not (given and is_reference(given)):
            rebuild(None, name, 1, None, what)  # refuses: a reference with no origin
        return
    saved, _, _ = read_source(source, what)
    same = bool(given) and is_reference(given) and same_reference(parse_reference(given), parse_reference(saved))
    check_source(source, saved if same else None, what)


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
