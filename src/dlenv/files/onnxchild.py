"""An ONNX graph from elsewhere, run by onnxruntime in a child process with limits (for dlenv.files.onnxmodel).

onnxruntime works in C++ and acts on no signal meanwhile: a model-local function that calls itself overflows its
stack (SIGSEGV, no line at all), functions that call the previous one twice 60 deep or Ifs nested 30 deep never
finish building the session, an Expand or a Resize asks for any memory, 2,000 chained MatMuls run for hours.
onnxmodel.check_graph's refused forms are the fast first answer; this is the wall. `Child` starts a new
interpreter (exec, never a fork of a process that may hold CUDA) through dlenv.invocation.python_module, so the
working folder is not on its sys.path; it imports numpy and onnxruntime, not torch, and runs `serve`:

- it dies with its parent (PR_SET_PDEATHSIG on Linux, then a check that the parent is still the one that started
  it), and ignores SIGINT: Ctrl-C reaches the whole process group, and the parent ends the child itself;
- each request runs under an address-space limit (RLIMIT_AS) and a CPU-time limit (RLIMIT_CPU) that the child sets
  before reading its payload, from `Limits` and the request's size; the parent waits no longer than the request's
  wall-clock limit for the answer, then kills the child.

One child serves a whole predict run: a batch goes down a pipe as raw float32 bytes after a JSON header, the
scores come back the same way. A child that crashes, runs past a limit or out of memory is one UserError line
naming the file and the limit (exit 2). The parent's SIGTERM or SIGINT is a BaseException (dlenv.errors.Stopped,
KeyboardInterrupt) raised while it waits in select(), and `close` kills the child on the way out.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

import numpy as np

from dlenv.errors import UserError, broken_library, first_line, printable
from dlenv.invocation import python_module

#: the metadata keys the parent reads (dlenv.files.onnxmodel.read_metadata); no other key crosses the pipe
META_KEYS = ("format", "class_names", "img_size", "interpolation", "mean", "std")
#: a metadata value longer than this is cut here; onnxmodel reads one over 2**26 characters as damaged anyway
_META_CHARS = 2**26 + 1
#: the largest JSON header the parent reads from the child
_MAX_HEADER = 2**28
#: where the image area of `Limits.per_image` is counted from: one 224x224 image
_BASE_SIDE = 224
#: the user's own limits (README: DLENV_ONNX_LIMITS=seconds=60,per_image=10,memory_gib=8)
ENV = "DLENV_ONNX_LIMITS"
_GIB = 2**30
#: onnxruntime's words for an allocation that failed (under RLIMIT_AS, malloc and mmap return nothing)
_NO_MEMORY = re.compile(r"bad.alloc|bad allocation|failed to allocate|out of memory|cannot allocate", re.I)
#: the same said by Python or the loader while the child starts (a library that cannot be mapped)
_STARVED = re.compile(_NO_MEMORY.pattern + r"|MemoryError|failed to map", re.I)


@dataclass(frozen=True)
class Limits:
    """What one request of the child may use. For a batch of n images of side S, with
    area = max(1, (S / 224)**2) and F the file's bytes:

        wall-clock  = seconds + per_image * n * area               (loading: seconds + 1 s per 10 MB of F)
        CPU time    = wall-clock * the CPUs this process may use    (onnxruntime's threads run at once)
        address     = memory_gib + 4 * F + n * 64 * (3 * S * S * 4 bytes)   (an input's bytes, 64 times over)

    The defaults leave a ResNet-152 on one slow core several times the time it needs, and stop a graph that
    asks for 6 GB from a 400-byte file. DLENV_ONNX_LIMITS=seconds=..,per_image=..,memory_gib=.. sets them."""

    seconds: float = 30.0
    per_image: float = 4.0
    memory_gib: float = 2.0

    @classmethod
    def from_env(cls) -> Limits:
        """The defaults, with what DLENV_ONNX_LIMITS sets; UserError naming a bad entry."""
        given = os.environ.get(ENV, "").strip()
        if not given:
            return cls()
        names, values = [f.name for f in fields(cls)], {}
        for part in given.split(","):
            key, _, value = part.partition("=")
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if key.strip() not in names or not (0 < number < 1e6):
                raise UserError(f"{ENV}={printable(given[:80])}: {printable(part[:40])!r} is not one of "
                                f"{', '.join(n + '=NUMBER' for n in names)} (each above 0)")
            values[key.strip()] = number
        return cls(**values)

    def loading(self, file_bytes: int) -> tuple[float, int]:
        """(wall-clock seconds, address-space bytes) for building the session of a file of `file_bytes`."""
        return self.seconds + file_bytes / 10e6, self._memory(file_bytes)

    def batch(self, n: int, side: int, file_bytes: int) -> tuple[float, int]:
        """(wall-clock seconds, address-space bytes) for running `n` images of `side` x `side` pixels."""
        area = max(1.0, (side / _BASE_SIDE) ** 2)
        return self.seconds + self.per_image * n * area, self._memory(file_bytes) + n * 64 * 12 * side * side

    def cpu(self, wall: float, threads: int) -> float:
        """The CPU-time limit of a request of `wall` seconds on `threads` threads (all busy all along, and a
        second for the interpreter)."""
        return wall * threads + 1

    def _memory(self, file_bytes: int) -> int:
        return int(self.memory_gib * _GIB) + 4 * file_bytes


def cpus() -> int:
    """The CPUs this process may run on (its affinity), which onnxruntime's threads are held to."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------------
# The pipe: a 4-byte length, a JSON header (with "nbytes"), then that many bytes of payload.


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def send(fd: int, header: dict[str, Any], payload: Any = b"") -> None:
    """Write one message: `header` as JSON, then `payload` (bytes or a C-contiguous array)."""
    view = memoryview(payload).cast("B")
    head = json.dumps({**header, "nbytes": view.nbytes}).encode()
    _write_all(fd, struct.pack("<I", len(head)) + head)
    _write_all(fd, view)


class ChildFailed(UserError):
    """The child crashed, ran past a limit or ran out of memory: one line naming the file and the limit."""


class _Closed(Exception):
    """The other end of the pipe closed (the child died, or the parent is done)."""


def _read_into(fd: int, view: memoryview, deadline: float | None) -> None:
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                if time.monotonic() >= deadline:
                    raise TimeoutError
                continue
        got = os.readv(fd, [view])
        if got == 0:
            raise _Closed
        view = view[got:]


def receive_header(fd: int, deadline: float | None = None) -> dict[str, Any]:
    """One message's header (its payload, header["nbytes"] bytes, follows on the pipe)."""
    size = bytearray(4)
    _read_into(fd, memoryview(size), deadline)
    (n,) = struct.unpack("<I", size)
    if n > _MAX_HEADER:
        raise _Closed
    head = bytearray(n)
    _read_into(fd, memoryview(head), deadline)
    return json.loads(head)


# ---------------------------------------------------------------------------------------------------
# The child.


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies (Linux; elsewhere the parent's `close` and finalizer are all), and exit
    now if it already has (it died before the request was made)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _limit(memory: int | None, cpu_seconds: float) -> None:
    """Set this process's soft RLIMIT_AS to `memory` bytes (None: unchanged) and its soft RLIMIT_CPU to
    `cpu_seconds` past what it has used; the hard limits stay, so the next request may raise both again."""
    import resource

    if memory is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (memory if hard == resource.RLIM_INFINITY else min(memory, hard),
                                                hard))
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(used.ru_utime + used.ru_stime + cpu_seconds)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _failure(kind: str, e: BaseException) -> dict[str, Any]:
    if isinstance(e, MemoryError) or _NO_MEMORY.search(str(e)):
        kind = "memory"
    return {"ok": False, "kind": kind, "error": first_line(e, 160, named=False)}


def _nodes(args: Any) -> list[dict[str, Any]]:
    return [{"name": a.name, "type": a.type, "shape": [d if isinstance(d, (int, str)) else None for d in a.shape]
             if isinstance(a.shape, (list, tuple)) else None} for a in args]


def _open(request: dict[str, Any], data: bytes) -> tuple[Any, dict[str, Any]]:
    try:
        import onnxruntime as ort
    except Exception as e:  # not there, or built for another NumPy (RuntimeError, SystemError, ...)
        return None, {"ok": False, "kind": "import", "error": first_line(e, 160)}
    ort.set_default_logger_severity(4)  # fatal only: its errors, in colour, are said in dlenv's line
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.intra_op_num_threads = opts.inter_op_num_threads = request["threads"]
    providers: list[Any] = ["CPUExecutionProvider"]
    if request["cuda"] and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, ("CUDAExecutionProvider", {"gpu_mem_limit": str(request["gpu_memory"])}))
    try:
        sess = ort.InferenceSession(data, sess_options=opts, providers=providers)
    except Exception as e:  # Fail / InvalidProtobuf / InvalidGraph: the file is what is wrong
        return None, _failure("load", e)
    meta = dict(sess.get_modelmeta().custom_metadata_map or {})
    return sess, {"ok": True, "inputs": _nodes(sess.get_inputs()), "outputs": _nodes(sess.get_outputs()),
                  "providers": sess.get_providers(),
                  "meta": {k: str(v)[:_META_CHARS] for k, v in meta.items() if k in META_KEYS}}


def _run(sess: Any, x: np.ndarray) -> tuple[dict[str, Any], Any]:
    inp = sess.get_inputs()[0]
    try:
        out = sess.run(None, {inp.name: x.astype(np.float16) if inp.type == "tensor(float16)" else x})[0]
        out = np.asarray(out)
    except Exception as e:  # onnxruntime's Fail, RuntimeException, InvalidArgument: the file's graph
        return _failure("run", e), b""
    if out.ndim != 2 or out.shape[0] != len(x) or out.dtype.kind not in "fiu":
        return {"ok": False, "kind": "output", "error": f"gave {out.dtype} outputs of shape {tuple(out.shape)[:8]} "
                f"for a batch of {len(x)} images, not one row of class scores per image"}, b""
    out = np.ascontiguousarray(out, dtype=np.float32)
    return {"ok": True, "shape": list(out.shape)}, out


def serve(parent: int) -> int:
    """The child's loop: answer `open` once, then `run` requests, until the parent closes the pipe."""
    import resource

    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))  # a crash: no core
    answers = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    sess = None
    while True:
        try:
            request = receive_header(0)
        except _Closed:
            return 0
        _limit(None if request.get("cuda") else request["memory"], request["cpu_seconds"])
        payload = bytearray(request["nbytes"])
        _read_into(0, memoryview(payload), None)
        if request["op"] == "open":
            sess, answer = _open(request, bytes(payload))
            send(answers, answer)
        else:
            x = np.frombuffer(payload, dtype=np.float32).reshape(request["shape"])
            answer, out = _run(sess, x)
            send(answers, answer, out)


# ---------------------------------------------------------------------------------------------------
# The parent's side.


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class Child:
    """An onnxruntime session of `data` (the bytes of the file `name`) in a child process, with the parts of
    InferenceSession's interface that dlenv uses: get_inputs, get_outputs, get_modelmeta, get_providers, run.
    Raises UserError (one line naming the file and the limit) for a child that crashes, runs past a limit,
    runs out of memory, or cannot import onnxruntime; and for a file onnxruntime refuses."""

    def __init__(self, data: bytes, name: str, cuda: bool = False, limits: Limits | None = None):
        self.name, self.file_bytes = name, len(data)
        self.limits = limits or Limits.from_env()
        self.threads = cpus()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (the child's stderr, closed with this object)
        self.proc = subprocess.Popen([*python_module("dlenv.files.onnxchild"), str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, bufsize=0,
                                     cwd="/", env={**os.environ, "MALLOC_ARENA_MAX": "2"})
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self.cuda = cuda
        try:
            wall, memory = self.limits.loading(len(data))
            info, _ = self._ask({"op": "open"}, data, wall, memory, "while loading it")
        except BaseException:
            self.close()
            raise
        node = lambda d: SimpleNamespace(**d)  # noqa: E731 (onnxruntime's NodeArg: name, type, shape)
        self._inputs = [node(d) for d in info["inputs"]]
        self._outputs = [node(d) for d in info["outputs"]]
        self._providers = info["providers"]
        self._meta = SimpleNamespace(custom_metadata_map=info["meta"])

    def get_inputs(self) -> list[Any]:
        return self._inputs

    def get_outputs(self) -> list[Any]:
        return self._outputs

    def get_providers(self) -> list[str]:
        return self._providers

    def get_modelmeta(self) -> Any:
        return self._meta

    def run(self, output_names: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """[class scores, float32 N x K] of the one input in `feeds`; RuntimeError with onnxruntime's line for a
        graph that fails on it; UserError for a limit, a crash, or outputs that are not N x K scores."""
        from dlenv.files.runstate import MAX_CLASSES  # lazy: the child imports this module and needs none of it

        x = np.ascontiguousarray(next(iter(feeds.values())), dtype=np.float32)
        side = int(x.shape[-1]) if x.ndim == 4 else _BASE_SIDE
        wall, memory = self.limits.batch(len(x), side, self.file_bytes)
        what = f"on a batch of {len(x)} image{'s' if len(x) != 1 else ''}"
        head, fd = self._ask({"op": "run", "shape": list(x.shape)}, x, wall, memory, what)
        shape = head.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2 and shape[0] == len(x) and 0 < shape[1] <= MAX_CLASSES
                and head["nbytes"] == shape[0] * shape[1] * 4):
            self.close()
            raise UserError(f"{self.name} gives outputs of shape {shape!r:.60} for a batch of {len(x)} images, not "
                            f"one row of up to {MAX_CLASSES:,} class scores per image")
        out = np.empty(shape, dtype=np.float32)
        self._receive_payload(fd, out, wall, what)
        return [out]

    def close(self) -> None:
        """End the child now (it holds nothing to save)."""
        self._finalizer()

    # -----------------------------------------------------------------------------------------------

    def _ask(self, request: dict[str, Any], payload: Any, wall: float, memory: int,
             what: str) -> tuple[dict[str, Any], int]:
        """Send one request under its limits and wait for the answer's header, at most `wall` seconds.
        Returns (header, the answers' fd). A failure of the file (the child answered with onnxruntime's line)
        raises RuntimeError for a run and UserError for a load; a limit or crash, UserError."""
        if self.proc.poll() is not None:
            raise self._ended(what, wall, memory)
        self._deadline = time.monotonic() + wall
        request = {**request, "memory": memory, "cpu_seconds": self.limits.cpu(wall, self.threads), "cuda": self.cuda,
                   "gpu_memory": memory, "threads": self.threads}
        try:
            send(self.proc.stdin.fileno(), request, payload)
            head = receive_header(self.proc.stdout.fileno(), self._deadline)
        except TimeoutError:
            self.close()
            raise ChildFailed(f"{self.name}: onnxruntime ran past its wall-clock limit of {wall:.0f} s {what} "
                            f"({_HOW}); the graph does far more work than an image classifier, so it was "
                            f"stopped. {_RAISE}") from None
        except (_Closed, BrokenPipeError):
            raise self._ended(what, wall, memory) from None
        if head.get("ok"):
            return head, self.proc.stdout.fileno()
        error = printable(head.get("error", ""))
        if head.get("kind") == "memory":
            self.close()
            raise ChildFailed(f"{self.name}: onnxruntime ran out of its memory limit of {_gib(memory)} {what} "
                              f"({_HOW}); the graph asks for far more than an image classifier. {_RAISE}")
        if head.get("kind") == "import":
            self.close()
            if error.startswith("ModuleNotFoundError: No module named 'onnxruntime'"):
                raise UserError("running an ONNX file needs onnxruntime (in requirements.txt: pip install -r "
                                "requirements.txt); or pass the run file it was exported from")
            if _STARVED.search(error):  # its libraries could not be mapped under the address-space limit
                raise self._starved(what, memory)
            raise broken_library("onnxruntime", head.get("error", ""))
        if head.get("kind") == "output":
            raise UserError(f"{self.name} {error}")
        if request["op"] == "open":
            self.close()
            raise UserError(f"{self.name} is not an ONNX model onnxruntime can load ({error}); export it again")
        raise RuntimeError(head.get("error", ""))

    def _receive_payload(self, fd: int, out: np.ndarray, wall: float, what: str) -> None:
        try:
            _read_into(fd, memoryview(out).cast("B"), self._deadline)
        except TimeoutError:
            self.close()
            raise ChildFailed(f"{self.name}: onnxruntime ran past its wall-clock limit of {wall:.0f} s {what} "
                              f"({_HOW}). {_RAISE}") from None
        except _Closed:
            raise self._ended(what, wall, 0) from None

    def _starved(self, what: str, memory: int) -> ChildFailed:
        """The line for a child whose limit left onnxruntime no room to start (DLENV_ONNX_LIMITS=memory_gib=0.001)."""
        return ChildFailed(f"{self.name}: the process running onnxruntime ran out of its {_gib(memory)} {what}, "
                           f"before any graph ran ({_HOW}). {_RAISE}")

    def _ended(self, what: str, wall: float, memory: int) -> ChildFailed:
        """The one line for a child that died: by a signal (a crash, or the CPU-time limit) or with a status."""
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        self.close()
        if code is not None and -code == getattr(signal, "SIGXCPU", 24):
            return ChildFailed(f"{self.name}: onnxruntime ran past its CPU-time limit of "
                               f"{self.limits.cpu(wall, self.threads):.0f} "
                             f"s {what} ({_HOW}); the graph does far more work than an image classifier, so it was "
                             f"stopped. {_RAISE}")
        if code is not None and code < 0:
            sig = _signal_name(-code)
            return ChildFailed(f"{self.name}: onnxruntime crashed ({sig}) {what}, within its limits of {_gib(memory)} "
                             f"and {wall:.0f} s ({_HOW}); the graph is damaged or made to crash it (e.g. a function "
                             "that calls itself), so dlenv does not run it")
        self._log.seek(0)
        last = [line for line in self._log.read()[-4000:].decode("utf-8", "replace").splitlines() if line.strip()]
        said = f": {printable(last[-1][:160])}" if last else ""
        if last and _STARVED.search(last[-1]):  # the limit, before any graph ran
            return self._starved(what, memory)
        return ChildFailed(f"{self.name}: the process running onnxruntime ended with status {code} {what}{said}; "
                         "run pip check, or export the model again")


#: how a file from elsewhere is run, for the lines above
_HOW = "a graph from elsewhere runs in a child process with memory, CPU-time and wall-clock limits"
_RAISE = (f"If you trust the file and it is this slow or large, raise the limits: "
          f"{ENV}=seconds=..,per_image=..,memory_gib=..")


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB of address space" if n else "memory"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
