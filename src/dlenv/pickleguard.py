"""The pickle inside a .pth file, judged against an allowlist: torch's unpickler never sees it.

A .pth file is a pickle (in a zip since PyTorch 1.6; before, a run of pickles followed by raw storage
bytes; dlenv.torchfile reads both formats), and unpickling can run code. torch.load(weights_only=True)
restricts what it rebuilds, but its unpickler could be beaten before PyTorch 2.10 (CVE-2025-32434;
CVE-2026-24747, memory corruption), and the default profile runs 1.13.1. So dlenv reads the pickle's
opcodes with `pickletools.genops` (which parses and runs nothing) and plays them on a stack machine of
its own. A file passes only when it holds what a state dict or a dlenv checkpoint needs:

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
one short reason (`Refused`; `Damaged` for a broken file, `Forged` for one built to be read two ways);
dlenv.weights turns it into the line the user sees.

The machine also builds what it checks: it asks a `Builder` for each storage, tensor, parameter and
dtype once its arguments have passed. The inert one here only checks; dlenv.torchfile's builds real
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
import pickletools
import re
from collections.abc import Callable
from typing import Any, BinaryIO

#: bounds on what is read into memory to check it: a data.pkl (a state dict of 10,000 tensors is ~2 MB)
PICKLE_LIMIT = 256 * 2**20
MAX_DIMS = 64
#: opcodes in one pickle: a state dict takes ~20 per tensor; the bound keeps a 256 MiB pickle of one-byte
#: EMPTY_LIST opcodes from taking minutes and tens of GB (each builds an object of ~80 bytes)
MAX_OPS = 2**22
#: nesting of containers: a checkpoint is a few levels deep; code that walks what it loaded recurses
MAX_DEPTH = 64
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
    for letter case, a storage or tensor past the bytes that hold it): torch.save never writes such a
    file, so it is never handed to torch, not even with --trust-pickle."""


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
    """What the checked values stand for. This one is inert (a check builds nothing); dlenv.torchfile's
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


# ---------------------------------------------------------------------------------------------------
# The stack machine


_DATA = {  # opcodes that push their argument as it is (genops has decoded it)
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING",
    "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"}
_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_NOOP = {"PROTO", "FRAME"}


def play(data: Any, persistent: Any, allow_globals: bool = True, build: Builder = _INERT) -> Any:
    """Play one pickle's opcodes on inert values; returns what it would return. `persistent(pid)`
    stands for a persistent id. Raises Refused for anything outside the allowlist."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}

    def pop() -> Any:
        if not stack or (marks and len(stack) <= marks[-1]):
            raise Damaged("a malformed pickle (stack underflow)")
        return stack.pop()

    def pop_mark() -> list[Any]:
        if not marks:
            raise Damaged("a malformed pickle (no mark)")
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def top() -> Any:
        if not stack or (marks and len(stack) <= marks[-1]):
            raise Damaged("a malformed pickle (empty stack)")
        return stack[-1]

    try:
        for count, (op, arg, _pos) in enumerate(pickletools.genops(data)):
            if count >= MAX_OPS:
                raise Refused(f"a pickle of more than {MAX_OPS:,} opcodes, more than a checkpoint needs")
            name = op.name
            if name in _DATA:
                stack.append(arg)
            elif name in _CONST:
                stack.append(_CONST[name])
            elif name in _NOOP:
                if name == "PROTO" and not (0 <= arg <= 5):
                    raise Refused(f"pickle protocol {arg}")
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "STOP":
                return _plain(pop())
            elif name == "POP":
                pop()
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(top())
            elif name in ("EMPTY_LIST",):
                stack.append([])
            elif name == "EMPTY_DICT":
                stack.append({})
            elif name == "EMPTY_TUPLE":
                stack.append(())
            elif name == "EMPTY_SET":
                stack.append(set())
            elif name in ("LIST", "TUPLE", "DICT", "FROZENSET"):
                items = pop_mark()
                if name == "LIST":
                    stack.append(items)
                elif name == "TUPLE":
                    stack.append(tuple(items))
                elif name == "FROZENSET":
                    stack.append(frozenset(items))
                else:
                    if len(items) % 2:
                        raise Damaged("a malformed pickle (odd DICT)")
                    stack.append(dict(zip(items[::2], items[1::2], strict=True)))
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(name[-1])
                items = [pop() for _ in range(n)][::-1]
                stack.append(tuple(items))
            elif name == "APPEND":
                value = pop()
                target = top()
                if not isinstance(target, list):
                    raise Refused("APPEND to something other than a list")
                target.append(value)
            elif name == "APPENDS":
                items = pop_mark()
                target = top()
                if not isinstance(target, list):
                    raise Refused("APPENDS to something other than a list")
                target.extend(items)
            elif name == "SETITEM":
                value, key = pop(), pop()
                target = top()
                if not isinstance(target, dict):
                    raise Refused("SETITEM on something other than a dict")
                target[key] = value
            elif name == "SETITEMS":
                items = pop_mark()
                target = top()
                if not isinstance(target, dict) or len(items) % 2:
                    raise Refused("SETITEMS on something other than a dict")
                for k, v in zip(items[::2], items[1::2], strict=True):
                    target[k] = v
            elif name == "ADDITEMS":
                items = pop_mark()
                target = top()
                if not isinstance(target, set):
                    raise Refused("ADDITEMS on something other than a set")
                target.update(items)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = top()
            elif name == "MEMOIZE":
                memo[len(memo)] = top()
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if int(arg) not in memo:
                    raise Damaged("a malformed pickle (a memo entry that was never stored)")
                stack.append(memo[int(arg)])
            elif name == "GLOBAL" and allow_globals:
                module, _, attr = str(arg).partition(" ")
                stack.append(_global(module, attr, build))
            elif name == "STACK_GLOBAL" and allow_globals:
                attr, module = pop(), pop()
                stack.append(_global(module, attr, build))
            elif name == "REDUCE" and allow_globals:
                args, func = pop(), pop()
                stack.append(_call(func, args, build))
            elif name == "BUILD" and allow_globals:
                state = pop()
                inst = top()
                if not (type(inst) is collections.OrderedDict and isinstance(state, dict)
                        and all(isinstance(k, str) for k in state)):
                    raise Refused("BUILD (setting the state of an object) on something other than a state dict")
                if "_metadata" in state:  # the one attribute a state dict carries (load_state_dict reads it)
                    meta = state["_metadata"]  # {module prefix: {"version": n}}: load_state_dict calls .get
                    if not (type(meta) in (dict, collections.OrderedDict) and all(
                            isinstance(k, str) and type(v) is dict and all(
                                isinstance(a, str) and (b is None or isinstance(b, (int, str))) for a, b in v.items())
                            for k, v in meta.items())):
                        raise Refused("a state dict whose _metadata is not a table of module versions")
                    inst._metadata = meta
            elif name == "BINPERSID" and allow_globals:
                stack.append(persistent(pop()))
            elif name in ("GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "BINPERSID"):
                raise Refused(f"{name} where only plain data belongs")
            else:  # INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4, PERSID, buffers: never in a file of weights
                raise Refused(f"the pickle opcode {name}, which a file of weights does not use")
    except Refused:
        raise
    except TypeError:  # an unhashable key or set member: the real unpickler would fail too
        raise Damaged("a malformed pickle (a key that cannot be a key)") from None
    except (ValueError, EOFError, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        # genops: an unknown opcode, a truncated argument; a pickle without STOP
        raise Damaged(f"a malformed or truncated pickle ({str(e)[:80] or type(e).__name__})") from None
    raise Damaged("a pickle without its end (STOP)")


def _plain(value: Any) -> Any:
    """`value` once no container in it holds itself or nests deeper than MAX_DEPTH (code that walks a
    checkpoint recurses) and no stand-in for a global, storage type or bare storage is left in it as a
    value (only a tensor's arguments may be one; a dtype may be a value)."""
    depth: dict[int, int] = {}  # id -> how deep below it containers go (each container visited once)
    path: set[int] = set()
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        v, done = todo.pop()
        if isinstance(v, (Storage, StorageType)) or type(v) is _Global:
            raise Refused("a storage or a global left as a value, not rebuilt into a tensor")
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            continue
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)
        if done:
            path.discard(id(v))
            depth[id(v)] = 1 + max((depth.get(id(x), 0) for x in items), default=0)
            if depth[id(v)] > MAX_DEPTH:
                raise Refused(f"containers nested more than {MAX_DEPTH} deep")
            continue
        if id(v) in path:
            raise Refused("a container that holds itself")
        if id(v) in depth:
            continue
        path.add(id(v))
        todo.append((v, True))
        todo.extend((x, False) for x in items if id(x) not in depth)
    return value


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
