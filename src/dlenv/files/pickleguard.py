"""The pickle inside a .pth file, judged against an allowlist: torch's unpickler never sees it.

A .pth file is a pickle (in a zip since PyTorch 1.6; before, a run of pickles followed by raw storage
bytes; dlenv.files.torchfile reads both formats), and unpickling can run code. torch.load(weights_only=True)
restricts what it rebuilds, but its unpickler could be beaten before PyTorch 2.10 (CVE-2025-32434;
CVE-2026-24747, memory corruption), and the default profile runs 1.13.1. So dlenv reads the pickle's
opcodes with `pickletools.genops` (which parses and runs nothing) and plays them on a stack machine of
its own. A file passes only when it holds what a state dict or a dlenv run file needs:

- data: None, bools, ints, floats, strings, bytes, tuples, lists, dicts, sets;
- the globals `collections.OrderedDict`, `torch.Size`, `torch._utils._rebuild_tensor_v2` (and v1),
  `torch._utils._rebuild_parameter`, the plain storage types (torch.FloatStorage, ...), and dtypes
  as values (torch.float16, ...): what torch 1.13 and 2.x write for tensors, parameters and state dicts;
- calls (REDUCE) of those callables only, each with its arguments checked: a tensor's offset, sizes and
  strides must lie inside its storage, and a storage's element count must fit the bytes the file holds
  for it (a count larger than its record is the memory-corruption class of bug);
- BUILD only of an OrderedDict with a dict of names (a state dict's `_metadata`).

Everything else is refused: any other global (os.system, builtins.eval, getattr, ...),
INST/OBJ/NEWOBJ/EXT, persistent ids other than torch's storages, a pickle cut short. A refusal carries
one short reason (`Refused`; `Damaged` for a file cut short, `Forged` for one built to be read two ways or
as pickle never writes, `Unbounded` for one whose reading would take work without bound); dlenv.files.weights
turns it into the line the user sees.

Bounded in work, not only in size: a few KB of allowed opcodes can describe a walk of 2**50 steps (dicts
that share the next one twice), a key whose every hash visits 2**50 values (tuples shared the same way),
keys that all hash alike (ints 2**61 - 1 apart), or a tuple 300,000 deep that crashes `hash()`. So one
`Budget` per file counts every opcode, value stored, key hashed and value a walk would visit; nesting is
refused as containers are built, keys are checked before Python hashes them, and at most MAX_ALIKE keys
may share a hash value; all of it in Python, between opcodes, where a stop signal is acted on. The stack
machine that plays the opcodes and counts that work is dlenv.files.picklework (`play`); this module holds what it
judges against: the allowlist, the stand-ins it plays with, and the refusals.

The machine also builds what it checks: it asks a `Builder` for each storage, tensor, parameter and
dtype once its arguments have passed. The inert one here only checks; dlenv.files.torchfile's builds real
tensors from the records it read through torch's own zip reader, so that what was judged is exactly
what is loaded, and torch.load never sees an untrusted file.

Why not a library: fickling (the maintained pickle analyser) rates a pickle by heuristics over its
decompiled AST and leaves the policy to the caller; what this check needs is narrower and stricter,
twenty allowed names, and the bounds of torch's own storage records, which fickling does not know.
So it is these few hundred lines on the standard library, with no dependency to pin.

No torch import: the opcodes are judged by the standard library alone, whatever torch is installed.
"""

from __future__ import annotations

import collections
import io
import math
import re
from collections.abc import Callable
from typing import Any, BinaryIO

#: bounds on what is read into memory to check it: a data.pkl (a state dict of 10,000 tensors is ~2 MB)
PICKLE_LIMIT = 256 * 2**20
MAX_DIMS = 64
#: opcodes in one pickle: a state dict takes ~20 per tensor; the bound keeps a 256 MiB pickle of one-byte
#: EMPTY_LIST opcodes from taking minutes and tens of GB (each builds an object of ~80 bytes)
MAX_OPS = 2**22
#: nesting of containers: a run file is a few levels deep; code that walks what it loaded recurses, and
#: Python hashes a tuple key recursively in C (a key 300,000 deep crashed the interpreter)
MAX_DEPTH = 64
#: the work reading one file may cost, in steps (`Budget`; what real run files cost: docs/weights.md)
MAX_WORK = 2**24
#: different keys in one file that may share a hash value (strings hash with a per-process seed; ints that
#: differ by multiples of 2**61 - 1 hash alike, 150,000 of them made one dict take quadratic time)
MAX_ALIKE = 16
#: elements one tensor may show: sizes whose product overflows int64 make torch raise, and a stride of 0
#: lets a few bytes stand for petabytes that whoever reads the tensor tries to allocate
MAX_ELEMENTS = 2**40
MAX_REPEATED = 2**28  # elements a tensor may show beyond those its storage holds (an expanded buffer)

#: storage type -> bytes per element (the plain types torch writes; quantized and others are refused)
STORAGES = {f"torch.{n}Storage": s for n, s in (
    ("Double", 8), ("Float", 4), ("Half", 2), ("BFloat16", 2), ("Long", 8), ("Int", 4), ("Short", 2),
    ("Char", 1), ("Byte", 1), ("Bool", 1), ("ComplexFloat", 8), ("ComplexDouble", 16))}
STORAGES.update({"torch.UntypedStorage": 1, "torch._UntypedStorage": 1})
DTYPES = {f"torch.{n}" for n in (
    "float16", "float32", "float64", "bfloat16", "complex32", "complex64", "complex128", "int8", "int16",
    "int32", "int64", "uint8", "bool", "half", "float", "double", "long", "int", "short")}
_LOCATION = re.compile(r"(cpu|cuda(:\d{1,3})?|mps|meta|xpu(:\d{1,3})?)\Z")


class Refused(ValueError):
    """The file is not one the allowlist passes; str() is the short reason."""


class Damaged(Refused):
    """The file is cut short or broken (no zip directory, a pickle without its end, a missing record):
    refused all the same, and reported as damage rather than as content."""


class Forged(Refused):
    """The file is built to be read two ways (two zip readers see different members, two names equal but
    for letter case, a storage or tensor past the bytes that hold it), or as pickle never writes one (a
    stack that runs dry, a memo entry never stored, a list as a key): torch.save never writes such a file,
    so it is never handed to torch, not even with --trust-pickle."""


class Unbounded(Refused):
    """Reading the file would take work out of proportion to its size (containers shared so that a walk
    visits them 2**50 times, keys made to hash alike, a key hashed over and over): refused before that
    work is done, and never handed to torch (whose own unpickler would hang or crash on it), not even
    with --trust-pickle."""


# ---------------------------------------------------------------------------------------------------
# Inert values the stack holds in place of what the real unpickler would build


class _Global:
    def __init__(self, name: str):
        self.name = name


class StorageType:
    def __init__(self, name: str):
        self.name, self.itemsize = name, STORAGES[name]


class Storage:
    """A storage of `numel` elements; `value` is what a builder made of it (None when only checking),
    `base` where it starts in `value` (a legacy file's storage views)."""

    def __init__(self, numel: int, value: Any = None, base: int = 0):
        self.numel, self.value, self.base = numel, value, base


class _Dtype(_Global):
    """A dtype as a value (the inert builder's stand-in for torch.float16, ...)."""


class _Tensor:
    """A tensor as a value (also a dict key: hashed by identity, as torch's are)."""


class Builder:
    """What the checked values stand for. This one is inert (a check builds nothing); dlenv.files.torchfile's
    subclass returns real tensors. Each method is called only after its arguments passed the checks."""

    def storage(self, stype: StorageType, numel: int, data: Callable[[], bytes] | None) -> Storage:
        """A storage of `numel` elements of `stype`: from `data()` (a zip record), or to be filled by
        `fill` (the legacy format, whose bytes follow the pickles)."""
        return Storage(numel)

    def view(self, root: Storage, offset: int, numel: int) -> Storage:
        return Storage(numel, root.value, root.base + offset)

    def fill(self, storage: Storage, fh: BinaryIO, nbytes: int) -> None:
        fh.seek(nbytes, io.SEEK_CUR)

    def tensor(self, storage: Storage, offset: int, size: tuple, stride: tuple, requires_grad: bool) -> Any:
        return _Tensor()

    def parameter(self, tensor: Any, requires_grad: bool) -> Any:
        return _Tensor()

    def dtype(self, name: str) -> Any:
        return _Dtype(name)

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, _Tensor)


_INERT = Builder()

_CALLABLES = {"collections.OrderedDict", "torch.Size", "torch._utils._rebuild_tensor",
              "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter"}


def _global(module: Any, name: Any, build: Builder) -> Any:
    if not (isinstance(module, str) and isinstance(name, str)):
        raise Refused("a global named by something other than text")
    full = f"{module}.{name}"
    if full in STORAGES:
        return StorageType(full)
    if full in DTYPES:
        return build.dtype(full)
    if full in _CALLABLES:
        return _Global(full)
    raise Refused(f"it names the global {full[:80]}, which a file of weights does not need")


def is_count(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _ints(v: Any) -> bool:  # each below 2**62: torch computes in int64, (n - 1) * stride included
    return isinstance(v, tuple) and len(v) <= MAX_DIMS and all(is_count(x) and x < 2**62 for x in v)


def _empty_hooks(v: Any) -> bool:
    return isinstance(v, collections.OrderedDict) and not v


def _tensor(build: Builder, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: bool = False) -> Any:
    if not isinstance(storage, Storage):
        raise Refused("a tensor rebuilt from something other than a storage")
    if not (is_count(offset) and _ints(size) and _ints(stride) and len(size) == len(stride)):
        raise Refused("a tensor whose offset, sizes or strides are not counts")
    shown = math.prod(size)
    if shown > MAX_ELEMENTS or shown > storage.numel + MAX_REPEATED:
        raise Forged(f"a tensor of sizes {size[:8]} that shows {shown:,} elements of a storage of {storage.numel:,}")
    if shown and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= storage.numel:
        raise Forged(f"a tensor of sizes {size[:8]} reaches past the end of its storage of {storage.numel} "
                     "elements")
    if offset > storage.numel:
        raise Forged("a tensor that starts past the end of its storage")
    return build.tensor(storage, offset, size, stride, requires_grad)


def _call(func: Any, args: Any, build: Builder) -> Any:
    """What calling allowed `func` with `args` stands for, after checking the arguments."""
    if not isinstance(func, _Global) or func.name not in _CALLABLES:
        what = func.name if isinstance(func, (_Global, StorageType)) else type(func).__name__
        raise Refused(f"it calls {what}, which a file of weights does not need")
    if not isinstance(args, tuple):
        raise Refused(f"{func.name} called with arguments that are not a tuple")
    name = func.name
    if name == "collections.OrderedDict":
        if args == ():
            return collections.OrderedDict()
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and all(
                isinstance(p, tuple) and len(p) == 2 for p in args[0]):
            try:
                return collections.OrderedDict(args[0])
            except TypeError:
                raise Refused("an OrderedDict with a key that cannot be a key") from None
        raise Refused("an OrderedDict built from other arguments than pairs")
    if name == "torch.Size":
        if len(args) == 1 and _ints(args[0]):
            return args[0]
        raise Refused("a torch.Size of other values than counts")
    if name == "torch._utils._rebuild_parameter":
        if len(args) == 3 and build.is_tensor(args[0]) and isinstance(args[1], bool) and _empty_hooks(args[2]):
            return build.parameter(args[0], args[1])
        raise Refused("a parameter rebuilt from other arguments than a tensor (or with hooks)")
    if name == "torch._utils._rebuild_tensor":
        if len(args) == 4:
            return _tensor(build, *args)
        raise Refused("a tensor rebuilt with other arguments than torch writes")
    # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks[, metadata])
    if len(args) in (6, 7) and isinstance(args[4], bool) and _empty_hooks(args[5]) and (
            len(args) == 6 or (isinstance(args[6], dict)
                               and all(isinstance(k, str) and isinstance(v, bool) for k, v in args[6].items()))):
        return _tensor(build, *args[:5])
    raise Refused("a tensor rebuilt with other arguments than torch writes (or with hooks)")


def storage_pid(pid: Any, extra: int) -> tuple[StorageType, str, int, Any]:
    """(type, key, element count, view) of a storage's persistent id; `extra` 1 for the legacy format's view."""
    if not (isinstance(pid, tuple) and len(pid) == 5 + extra and pid[0] == "storage"):
        raise Refused("a persistent id other than a torch storage")
    _, stype, key, location, numel = pid[:5]
    if not isinstance(stype, StorageType):
        raise Refused("a storage of a type other than the plain ones")
    if not (isinstance(key, str) and len(key) <= 64 and isinstance(location, str) and _LOCATION.match(location)
            and is_count(numel)):
        raise Refused("a storage with a malformed key, location or size")
    return stype, key, numel, pid[5] if extra else None
