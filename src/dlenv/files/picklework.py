"""The stack machine that plays a .pth file's pickle against dlenv.files.pickleguard's allowlist, counting its work.

`play` reads the opcodes with `pickletools.genops` (which parses and runs nothing) and plays them on inert
values, one method per family of opcodes (data, the stack and its marks, containers, the memo, the few
objects a run file holds). One `Budget` per file counts every opcode, value stored, key hashed and value
a walk through the result would visit (dlenv.files.pickleguard's module doc says why: a few KB can describe 2**50
steps); nesting is refused as containers are built, keys are checked before Python hashes them. No torch.
"""

from __future__ import annotations

import collections
import pickletools
from collections.abc import Callable
from typing import Any

from dlenv.files.pickleguard import (
    _INERT,
    MAX_ALIKE,
    MAX_DEPTH,
    MAX_OPS,
    MAX_WORK,
    Builder,
    Damaged,
    Forged,
    Refused,
    Storage,
    StorageType,
    Unbounded,
    _call,
    _Dtype,
    _Global,
    _global,
)

# ---------------------------------------------------------------------------------------------------
# The work a pickle may cost


class Budget:
    """The work reading one file may cost, in steps: an opcode, a value put into a container, a value of a
    key hashed (a tuple's hash is not cached: each insertion hashes it in full again), a value a walk through
    the result visits. `spent` is what it cost so far; past `limit`, `spend` refuses the file (Unbounded)."""

    def __init__(self, limit: int = MAX_WORK):
        self.limit, self.spent = limit, 0

    def spend(self, n: int, what: str) -> None:
        self.spent += n
        if self.spent > self.limit:
            raise Unbounded(f"{what}: reading it would take more than {self.limit:,} steps, more than a "
                            "weights file does")


class _Shape:
    """What the machine knows of a container it built: how deep it nests (a lower bound for a list, dict or
    set, which may grow after it was put into another; exact for a tuple or frozenset), how many values
    hashing it visits (`weight`, tuples and frozensets only), and whether it may be a key. It holds the
    container, so no id is reused while the pickle plays."""

    __slots__ = ("obj", "depth", "weight", "key")

    def __init__(self, obj: Any, depth: int, weight: int, key: bool):
        self.obj, self.depth, self.weight, self.key = obj, depth, weight, key


#: the values a key may be (besides the tuples and frozensets of them); a tensor as a key is hashed by identity
_KEY_SCALARS = (str, bytes, int, float, bool, type(None))


class _Machine:
    """Plays one pickle's opcodes on inert values (`play`), one method per family of opcodes: data, the
    stack and its marks, containers, the memo, and the few objects a run file holds (globals, calls,
    BUILD, persistent ids). Every container it builds is shaped (`_Shape`), every key is checked before it
    is hashed, and all of it is counted against `budget`."""

    def __init__(self, persistent: Any, allow_globals: bool, build: Builder, budget: Budget):
        self.persistent, self.allow_globals, self.build, self.budget = persistent, allow_globals, build, budget
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.shapes: dict[int, _Shape] = {}
        self.alike: dict[int, list[Any]] = {}  # hash value -> the different keys seen with it
        self.family: dict[str, Callable[[str, Any], None]] = {
            **dict.fromkeys(_DATA | set(_CONST) | _NOOP, self._data),
            **dict.fromkeys(("MARK", "POP", "POP_MARK", "DUP"), self._stack),
            **dict.fromkeys(_CONTAINERS, self._container),
            **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "GET", "BINGET", "LONG_BINGET"), self._memo),
            **dict.fromkeys(("GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "BINPERSID"), self._object),
        }

    def run(self, data: Any) -> Any:
        for count, (op, arg, _pos) in enumerate(pickletools.genops(data)):
            if count >= MAX_OPS:
                raise Refused(f"a pickle of more than {MAX_OPS:,} opcodes, more than a weights file needs")
            self.budget.spend(1, "its opcodes")
            if op.name == "STOP":
                return _plain(self._pop(), self.budget)
            family = self.family.get(op.name)
            if family is None:  # INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4, PERSID, buffers: never in a file of weights
                raise Refused(f"the pickle opcode {op.name}, which a file of weights does not use")
            family(op.name, arg)
        raise Damaged("a pickle without its end (STOP)")

    # --- the stack

    def _pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise Forged("a malformed pickle (stack underflow)")
        return self.stack.pop()

    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise Forged("a malformed pickle (no mark)")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def _top(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise Forged("a malformed pickle (empty stack)")
        return self.stack[-1]

    def _data(self, name: str, arg: Any) -> None:
        if name in _DATA:
            self.stack.append(arg)
        elif name in _CONST:
            self.stack.append(_CONST[name])
        elif name == "PROTO" and not (0 <= arg <= 5):
            raise Refused(f"pickle protocol {arg}")

    def _stack(self, name: str, arg: Any) -> None:
        if name == "MARK":
            self.marks.append(len(self.stack))
        elif name == "POP":
            self._pop()
        elif name == "POP_MARK":
            self._pop_mark()
        else:  # DUP
            self.stack.append(self._top())

    # --- containers

    def _depth(self, v: Any) -> int:
        shape = self.shapes.get(id(v))
        return shape.depth if shape is not None else 0

    def _made(self, obj: Any, items: list[Any] | tuple[Any, ...] = ()) -> Any:
        """`obj`, a container just built of `items`, shaped and pushed; refused past MAX_DEPTH before any
        code walks it (a tuple 300,000 deep used as a key crashed the interpreter in hash())."""
        shapes = [self.shapes.get(id(v)) for v in items]
        depth = 1 + max((s.depth for s in shapes if s is not None), default=0)
        if depth > MAX_DEPTH:
            raise Refused(f"containers nested more than {MAX_DEPTH} deep")
        frozen = isinstance(obj, (tuple, frozenset))
        weight = min(1 + sum(s.weight if s is not None else 1 for s in shapes), MAX_WORK + 1) if frozen else 1
        key = frozen and all(s.key if s is not None else isinstance(v, _KEY_SCALARS)
                             for s, v in zip(shapes, items, strict=True))
        self.shapes[id(obj)] = _Shape(obj, depth, weight, key)
        self.stack.append(obj)
        return obj

    def _grown(self, target: Any, items: list[Any]) -> None:
        """`items` went into mutable `target`: its depth is at least one more than theirs."""
        shape = self.shapes.get(id(target))
        deepest = 1 + max((self._depth(v) for v in items), default=0)
        if shape is not None and deepest > shape.depth:
            if deepest > MAX_DEPTH:
                raise Refused(f"containers nested more than {MAX_DEPTH} deep")
            shape.depth = deepest

    def _keys(self, keys: list[Any]) -> None:
        """Check each of `keys` before Python hashes it: a string, number, bool, None, tensor, or a tuple
        or frozenset of those, whose hashing costs its weight from the budget; and no more than MAX_ALIKE
        different keys in the whole file may share one hash value (ints that differ by multiples of
        2**61 - 1 all hash alike, and each insertion of one compares it with all the others)."""
        for k in keys:
            shape = self.shapes.get(id(k))
            if shape is not None:
                if not shape.key:
                    raise Forged("a malformed pickle (a key that cannot be a key)")
                self.budget.spend(shape.weight, f"keys of {shape.weight:,} values each, hashed at every use"
                                  if shape.weight <= MAX_WORK else f"a key of more than {MAX_WORK:,} values "
                                  "(tuples shared inside it), hashed at every use")
            elif self.build.is_tensor(k) or isinstance(k, _Dtype):
                self.budget.spend(1, "its keys")
                continue  # hashed by identity: no file can make two alike
            elif not isinstance(k, _KEY_SCALARS):
                raise Refused(f"a key of type {type(k).__name__}, which a file of weights does not use")
            else:
                self.budget.spend(1, "its keys")
            seen = self.alike.setdefault(hash(k), [])
            if not any(x is k or x == k for x in seen):
                seen.append(k)
                if len(seen) > MAX_ALIKE:
                    raise Unbounded(f"more than {MAX_ALIKE} different keys that hash alike (made to collide: "
                                    "each insertion compares a key with all the others)")

    def _container(self, name: str, arg: Any) -> None:
        if name in _EMPTY:
            self._made(_EMPTY[name]())
        elif name in ("LIST", "TUPLE", "FROZENSET", "DICT"):
            items = self._pop_mark()
            self.budget.spend(len(items), "its containers")
            if name == "DICT":
                if len(items) % 2:
                    raise Forged("a malformed pickle (odd DICT)")
                self._keys(items[::2])
                self._made(dict(zip(items[::2], items[1::2], strict=True)), items)
            elif name == "FROZENSET":
                self._keys(items)
                self._made(frozenset(items), items)
            else:
                self._made(items if name == "LIST" else tuple(items), items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            items = [self._pop() for _ in range(int(name[-1]))][::-1]
            self._made(tuple(items), items)
        else:  # APPEND(S), SETITEM(S), ADDITEMS: into the container below the mark
            items = self._pop_mark() if name.endswith("S") else [self._pop() for _ in range(_ONE[name])][::-1]
            self.budget.spend(len(items), "its containers")
            target = self._top()
            kind = list if name.startswith("APPEND") else set if name == "ADDITEMS" else dict
            if not isinstance(target, kind) or (kind is dict and len(items) % 2):
                raise Refused(f"{name} on something other than a {kind.__name__}")
            if kind is list:
                target.extend(items)
            elif kind is set:
                self._keys(items)
                target.update(items)
            else:
                self._keys(items[::2])
                for k, v in zip(items[::2], items[1::2], strict=True):
                    target[k] = v
            self._grown(target, items)

    # --- the memo

    def _memo(self, name: str, arg: Any) -> None:
        if name == "MEMOIZE":
            self.memo[len(self.memo)] = self._top()
            return
        index = int(arg)
        if not 0 <= index < 2**32:  # the binary opcodes' own bound; a text PUT could name ints that hash alike
            raise Refused("a memo index past 2**32")
        if name.endswith("PUT"):
            self.memo[index] = self._top()
        elif index not in self.memo:
            raise Forged("a malformed pickle (a memo entry that was never stored)")
        else:
            self.stack.append(self.memo[index])

    # --- globals, calls, BUILD, persistent ids

    def _object(self, name: str, arg: Any) -> None:
        if not self.allow_globals:
            raise Refused(f"{name} where only plain data belongs")
        if name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            self.stack.append(_global(module, attr, self.build))
        elif name == "STACK_GLOBAL":
            attr, module = self._pop(), self._pop()
            self.stack.append(_global(module, attr, self.build))
        elif name == "REDUCE":
            args, func = self._pop(), self._pop()
            if isinstance(func, _Global) and func.name == "collections.OrderedDict" and len(args) == 1 \
                    and isinstance(args[0], (list, tuple)):
                self._keys([p[0] for p in args[0] if isinstance(p, tuple) and len(p) == 2])
            made = _call(func, args, self.build)
            if isinstance(made, collections.OrderedDict):
                self._made(made, [v for p in args[0] for v in p] if args else [])
            else:
                self.stack.append(made)
        elif name == "BUILD":
            self._build_state(self._pop(), self._top())
        else:  # BINPERSID
            self.stack.append(self.persistent(self._pop()))

    def _build_state(self, state: Any, inst: Any) -> None:
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


_DATA = {  # opcodes that push their argument as it is (genops has decoded it)
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING",
    "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"}
_CONST = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_NOOP = {"PROTO", "FRAME"}
_EMPTY: dict[str, Callable[[], Any]] = {"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_TUPLE": tuple,
                                        "EMPTY_SET": set}
_ONE = {"APPEND": 1, "SETITEM": 2}  # values APPEND and SETITEM take off the stack
_CONTAINERS = {*_EMPTY, "LIST", "TUPLE", "DICT", "FROZENSET", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS",
               "SETITEM", "SETITEMS", "ADDITEMS"}


def play(data: Any, persistent: Any, allow_globals: bool = True, build: Builder = _INERT,
         budget: Budget | None = None) -> Any:
    """Play one pickle's opcodes on inert values; returns what it would return. `persistent(pid)`
    stands for a persistent id; `budget` is the file's (the older format plays five pickles on one).
    Raises Refused for anything outside the allowlist (Unbounded past the budget, Forged for a pickle that
    pickle never writes, Damaged for one cut short)."""
    machine = _Machine(persistent, allow_globals, build, budget or Budget())
    try:
        return machine.run(data)
    except Refused:
        raise
    except TypeError:  # an unhashable set member the checks let through: the real unpickler would fail too
        raise Forged("a malformed pickle (a key that cannot be a key)") from None
    except (ValueError, EOFError, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        # genops: an unknown opcode, a truncated argument; a pickle without STOP
        raise Damaged(f"a malformed or truncated pickle ({str(e)[:80] or type(e).__name__})") from None


def _plain(value: Any, budget: Budget) -> Any:
    """`value` once no container in it holds itself or nests deeper than MAX_DEPTH (code that walks a
    run file recurses), a walk through it visits at most MAX_OPS values however its containers are
    shared (50 dicts each holding the next twice make a walk of 2**50 steps: every container is visited
    once here, and counts the values below it), and no stand-in for a global, storage type or bare storage
    is left in it as a value (only a tensor's arguments may be one; a dtype may be a value)."""
    depth: dict[int, int] = {}  # id -> how deep below it containers go (each container visited once)
    walk: dict[int, int] = {}  # id -> values a walk from it visits, shared containers each time they are met
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
            walk[id(v)] = min(1 + sum(walk.get(id(x), 1) for x in items), MAX_OPS + 1)
            if walk[id(v)] > MAX_OPS:
                raise Unbounded(f"containers shared so that a walk through them visits more than {MAX_OPS:,} "
                                "values")
            continue
        if id(v) in path:
            raise Refused("a container that holds itself")
        if id(v) in depth:
            continue
        budget.spend(1 + len(items), "walking its values")
        path.add(id(v))
        todo.append((v, True))
        todo.extend((x, False) for x in items if id(x) not in depth)
    return value
