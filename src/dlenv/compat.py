"""Every PyTorch feature check, in one place.

The toolkit runs unchanged on the default profile (PyTorch 1.13.1) and on current 2.x. Code elsewhere
asks this module ("is there torch.compile?", "give me a GradScaler") instead of testing versions
itself, so the differences between releases are visible here and nowhere else.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import warnings
from typing import Any

import torch


def _version(v: str) -> tuple[int, int]:
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = _version(torch.__version__)

#: torch.compile exists (PyTorch 2.0+); 1.13 has none.
HAS_COMPILE = hasattr(torch, "compile")

#: PYTORCH_CUDA_ALLOC_CONF knows expandable_segments (PyTorch 2.1+).
HAS_EXPANDABLE_SEGMENTS = TORCH_VERSION >= (2, 1)

#: torch.amp.GradScaler("cuda") replaces the deprecated torch.cuda.amp.GradScaler (2.3+).
_HAS_AMP_GRADSCALER = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")


def grad_scaler(enabled: bool, **kwargs: Any) -> Any:
    """A CUDA GradScaler; a disabled one is a no-op (scale() returns the loss, step() just steps).

    kwargs (init_scale, growth_interval, ...) go to the GradScaler.
    """
    if _HAS_AMP_GRADSCALER:
        return torch.amp.GradScaler("cuda", enabled=enabled, **kwargs)
    return torch.cuda.amp.GradScaler(enabled=enabled, **kwargs)


def autocast(device_type: str, dtype: torch.dtype | None, enabled: bool):
    """torch.autocast for 'cuda' or 'cpu' (1.13 and 2.x share this signature)."""
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)


#: torch.get_autocast_dtype(device) / is_autocast_enabled(device) (2.4+) replace 1.13's per-device getters.
_HAS_AUTOCAST_BY_DEVICE = hasattr(torch, "get_autocast_dtype")


def autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    """The autocast setting in force now, {device_type: (enabled, dtype)}, for `autocast_like`."""
    devices = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    if _HAS_AUTOCAST_BY_DEVICE:
        return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices}
    legacy = {"cuda": (torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()),
              "cpu": (torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype())}
    return {d: legacy[d] for d in devices}


def autocast_like(state: dict[str, tuple[bool, torch.dtype]]) -> contextlib.ExitStack:
    """Re-enter the autocast setting `autocast_state()` captured (enabled or explicitly disabled).

    1.13's non-reentrant checkpoint recomputes under CUDA autocast with its default dtype (fp16) and
    ignores CPU autocast; re-entering the forward's own setting makes the recompute match it.
    """
    stack = contextlib.ExitStack()
    for device, (enabled, dtype) in state.items():
        stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled))
    return stack


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """function(*args) with its activations recomputed in backward instead of stored.

    Non-reentrant (exists from 1.13 on): parameters get gradients even when no input needs one, and
    autograd hooks behave as without checkpointing. RNG state is preserved, so dropout and stochastic
    depth draw the same masks in the recompute.
    """
    from torch.utils.checkpoint import checkpoint as _checkpoint

    return _checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


# torch.compiler.is_compiling (2.3+), torch._dynamo.is_compiling (2.0-2.2); 1.13 never compiles.
_IS_COMPILING = (getattr(getattr(torch, "compiler", None), "is_compiling", None)
                 or getattr(getattr(torch, "_dynamo", None), "is_compiling", None) or (lambda: False))


def is_compiling() -> bool:
    """Whether torch.compile is tracing the code that calls this (dynamo answers True while tracing)."""
    return bool(_IS_COMPILING())


#: torch.load(weights_only=True) can be trusted with a file from anyone: before 2.10 a crafted file can
#: run code through it (CVE-2025-32434, fixed in 2.6; CVE-2026-24747, fixed in 2.10). dlenv.files.weights
#: asks for consent (or its own signature) before unpickling where this is False.
WEIGHTS_ONLY_TRUSTED = TORCH_VERSION >= (2, 10)


def load_weights_only(path: Any, map_location: Any = "cpu") -> Any:
    """torch.load(..., weights_only=True) of a path or an open binary file: tensors and plain types only.

    weights_only exists from 1.13 on; 2.6 made it the default, we always pass it. It refuses arbitrary
    globals, but see WEIGHTS_ONLY_TRUSTED for what it does not stop before 2.10.
    """
    return torch.load(path, map_location=map_location, weights_only=True)


#: a torch.device is a context manager that builds tensors there (PyTorch 2.0+)
_DEVICE_CONTEXT = hasattr(torch.device("cpu"), "__enter__")


def build_on_meta(build: Any) -> torch.nn.Module:
    """`build()` on the meta device (shapes only: no memory, no random initialisation) where PyTorch can;
    on 1.13, or for a model that refuses meta tensors, on the CPU. For reading a model's structure."""
    if _DEVICE_CONTEXT:
        try:
            with torch.device("meta"):
                return build()
        except Exception:  # noqa: BLE001 (a factory that computes with its tensors: build it for real)
            pass
    return build()


def compile_model(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch.compile(model) where it exists; raises RuntimeError on PyTorch 1.x."""
    if not HAS_COMPILE:
        raise RuntimeError(f"PyTorch {torch.__version__} has no torch.compile (it arrived in 2.0)")
    return torch.compile(model, **kwargs)


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (0 on 1.13): a step during
    which it grew spent its time compiling."""
    if not HAS_COMPILE:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_counters() -> dict[str, int]:
    """torch.compile's work in this process so far (zeros on 1.13): 'frames' compiled by dynamo (each
    recompile of a frame counts once more), 'graphs' it produced, and 'cache_misses', the graphs Inductor
    compiled afresh rather than loading from its FX-graph cache. Differences between two readings say what
    compiled in between (scripts/bench_pipeline.py reads them per epoch)."""
    if not HAS_COMPILE:
        return {"frames": 0, "graphs": 0, "cache_misses": 0}
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def cause_chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """`exc` and what it wraps, outermost first: dynamo keeps a backend's error as `inner_exception`,
    others chain it as `__cause__` (at most `limit`, against a cycle)."""
    chain = [exc]
    while len(chain) < limit:
        inner = getattr(chain[-1], "inner_exception", None) or chain[-1].__cause__
        if not isinstance(inner, BaseException):
            break
        chain.append(inner)
    return chain


def is_compile_error(exc: BaseException) -> bool:
    """Whether an exception comes from torch.compile's machinery (dynamo, AOT autograd, inductor, a
    backend compiler) rather than from the model's own code or the GPU: then eager mode still runs."""
    return any(type(e).__module__.startswith(("torch._dynamo", "torch._inductor", "torch._functorch"))
               for e in cause_chain(exc))


def arch_list_supports(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether an arch list like torch.cuda.get_arch_list()'s has kernels for a compute capability."""
    want = capability[0] * 10 + capability[1]

    def number(arch: str) -> int:  # 'sm_90a' -> 90: arch-specific variants count as their base
        return int("".join(ch for ch in arch.split("_")[1] if ch.isdigit()))

    sass = {number(a) for a in archs if a.startswith("sm_")}
    ptx = {number(a) for a in archs if a.startswith("compute_")}
    # SASS runs on the same major generation with a minor >= its own; PTX JITs for anything newer.
    if any(a // 10 == want // 10 and a <= want for a in sass):
        return True
    return any(a <= want for a in ptx)


def nccl_timeout_env() -> dict[str, str]:
    """Environment that makes NCCL collectives honour the process-group timeout (set before init).

    1.13 checks a stuck collective against the timeout only with NCCL_ASYNC_ERROR_HANDLING=1 (off by
    default: a dead rank hangs the others for ever). 2.2 renamed it TORCH_NCCL_ASYNC_ERROR_HANDLING
    (the old name only warns there) and defaults to 3, tearing the process down; nothing to set.
    """
    if TORCH_VERSION >= (2, 2):
        return {}
    return {"NCCL_ASYNC_ERROR_HANDLING": "1"}


def optimizer_kernels(cls: type, on_cuda: bool) -> dict[str, bool]:
    """Keyword arguments that make torch.optim's `cls` step in few kernels on CUDA: AdamW's fused kernel
    (2.0+), else the multi-tensor (foreach) path, which 1.13 leaves off. A per-parameter step costs the
    CPU a dozen launches per tensor, and with --checkpoint's recompute the step is launch-bound
    (measured: docs/benchmarks.md). {} off CUDA (the defaults)."""
    if not on_cuda:
        return {}
    names = inspect.signature(cls).parameters
    if cls is torch.optim.AdamW and "fused" in names and TORCH_VERSION >= (2, 0):
        return {"fused": True}
    return {"foreach": True} if "foreach" in names else {}


#: The CUDA out-of-memory exception class (a RuntimeError subclass in 1.13 and 2.x).
_OOM_ERROR = getattr(torch.cuda, "OutOfMemoryError", None) or getattr(torch, "OutOfMemoryError", None)

# Allocation failures that cuBLAS/cuDNN report as their own status instead of an OutOfMemoryError.
_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(exc: BaseException) -> bool:
    """Whether an exception means the GPU ran out of memory (and a smaller step may succeed)."""
    if _OOM_ERROR is not None and isinstance(exc, _OOM_ERROR):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def clear_blas_workspaces() -> None:
    """Give back the cuBLAS/cuBLASLt workspaces PyTorch 2.x keeps in the caching allocator (about 65 MiB
    per stream on an H100 or H200, counted in memory_allocated); the next matmul takes them again.
    PyTorch 1.13 allocates them outside the allocator and has no call for it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        clear()


# ---------------------------------------------------------------------------------------------------
# int8 quantization and ONNX export (dlenv.compress).


def _quant_module() -> Any:
    """torch.ao.quantization (1.10+), else the older torch.quantization alias; None if neither."""
    for name in ("torch.ao.quantization", "torch.quantization"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


@contextlib.contextmanager
def _quiet_deprecations():
    """Silence the 'torch.ao.quantization / torch.jit is deprecated' notices of 2.9+: those APIs still
    work there and docs/compress.md says where they are heading; users need no warning per call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        # 1.13's default observers and 2.10+'s quantized tensors announce the same future as UserWarnings
        warnings.filterwarnings("ignore", message=".*reduce_range will be deprecated.*")
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        yield


def quantization_unavailable() -> str | None:
    """Why int8 quantization cannot run with this PyTorch (a one-line reason), or None if it can."""
    q = _quant_module()
    if q is None or not hasattr(q, "quantize_dynamic"):
        return f"PyTorch {torch.__version__} has no torch.ao.quantization"
    if not quant_backend():
        return f"PyTorch {torch.__version__} has no int8 CPU engine (fbgemm, x86 or qnnpack)"
    return None


def quant_backend() -> str | None:
    """The int8 CPU engine to use: 'x86' (2.x on x86), else 'fbgemm', else 'qnnpack' (ARM); or None.

    1.13 introduced the 'x86' engine but its oneDNN path fails on some real batches of a calibrated
    ResNet ("could not create a primitive descriptor for a reorder primitive"); fbgemm is 1.13's
    well-trodden engine.
    """
    engines = torch.backends.quantized.supported_engines
    order = ("x86", "fbgemm", "qnnpack") if TORCH_VERSION >= (2, 0) else ("fbgemm", "x86", "qnnpack")
    for name in order:
        if name in engines:
            return name
    return None


def quantize_dynamic(model: torch.nn.Module, layer_types: set) -> torch.nn.Module:
    """Dynamic int8 quantization (weights int8, activations quantized on the fly) of `layer_types`."""
    q = _quant_module()
    torch.backends.quantized.engine = quant_backend()
    with _quiet_deprecations():
        return q.quantize_dynamic(model, layer_types, dtype=torch.qint8)


def prepare_fx(model: torch.nn.Module, example_inputs: tuple) -> torch.nn.Module:
    """FX graph mode post-training static quantization, step 1: fuse and insert observers.

    Uses the default qconfig mapping of `quant_backend()`. Raises torch.fx's TraceError for models
    whose forward cannot be traced symbolically.
    """
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_fx as _prepare

    backend = quant_backend()
    torch.backends.quantized.engine = backend
    with _quiet_deprecations():
        return _prepare(model, get_default_qconfig_mapping(backend), example_inputs=example_inputs)


def convert_fx(prepared: torch.nn.Module) -> torch.nn.Module:
    """FX static quantization, step 2: turn a calibrated, prepared model into an int8 model."""
    from torch.ao.quantization.quantize_fx import convert_fx as _convert

    with _quiet_deprecations():
        return _convert(prepared)


def jit_trace(model: torch.nn.Module, example: Any) -> Any:
    """torch.jit.trace without the per-call deprecation notice of 2.9+ (TorchScript still works).

    The tracer's warnings about constants are silenced too: callers check the traced outputs.
    """
    with _quiet_deprecations(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(model, example, check_trace=False)


def jit_save(module: Any, f: Any) -> None:
    """torch.jit.save (a path or a file object), without 2.9+'s deprecation notice."""
    with _quiet_deprecations():
        torch.jit.save(module, f)


def jit_load(path: Any, map_location: Any = None) -> Any:
    """torch.jit.load, without 2.9+'s deprecation notice."""
    with _quiet_deprecations():
        return torch.jit.load(str(path), map_location=map_location)


def _onnx_export_params() -> set:
    return set(inspect.signature(torch.onnx.export).parameters)


def onnx_max_opset() -> int | None:
    """The newest ONNX opset `onnx_export` writes here (17 on 1.13; 2.x's TorchScript-based exporter stops
    below its dynamo one), or None where this PyTorch does not say."""
    try:
        from torch.onnx import _constants  # private: torch.onnx.export raises a bare ValueError past it
    except ImportError:
        return None
    found = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", getattr(_constants, "ONNX_MAX_OPSET", None))
    return found if isinstance(found, int) else None


def onnx_export_unavailable() -> str | None:
    """Why this environment cannot export ONNX (one line), or None if it can.

    1.13 to 2.x keep the TorchScript-based exporter (2.9+ behind dynamo=False); the dynamo exporter
    needs the onnxscript package, which dlenv does not install. Both need the onnx package.
    """
    if importlib.util.find_spec("onnx") is None:
        return "the onnx package is not installed (it is in requirements.txt: pip install -r requirements.txt)"
    legacy = "dynamo" not in _onnx_export_params() or (
        importlib.util.find_spec("torch.onnx._internal.torchscript_exporter") is not None
        or importlib.util.find_spec("torch.onnx.utils") is not None)
    if legacy or importlib.util.find_spec("onnxscript") is not None:
        return None
    return (f"PyTorch {torch.__version__} has only the dynamo ONNX exporter and the onnxscript package "
            "is not installed; pip install onnxscript, or use --format torchscript")


def onnx_export(model: torch.nn.Module, example: torch.Tensor, path: Any, opset: int,
                input_name: str = "input", output_name: str = "logits") -> None:
    """Export `model` to ONNX at `path` with a dynamic batch axis, using the TorchScript-based exporter.

    On 2.x `dynamo=False` keeps the exporter that 1.13 has (the dynamo one needs onnxscript and
    handles dynamic axes differently). Where only the dynamo exporter is left and onnxscript is
    installed, that one is used with a dynamic batch dimension.
    """
    params = _onnx_export_params()
    kwargs: dict[str, Any] = dict(input_names=[input_name], output_names=[output_name],
                                  opset_version=opset, do_constant_folding=True)
    dynamic_axes = {input_name: {0: "batch"}, output_name: {0: "batch"}}
    with _quiet_deprecations():
        if "dynamo" in params:
            try:
                torch.onnx.export(model, (example,), str(path), dynamo=False, dynamic_axes=dynamic_axes,
                                  **kwargs)
                return
            except ImportError:
                if importlib.util.find_spec("onnxscript") is None:
                    raise
            batch = torch.export.Dim("batch")
            kwargs.pop("do_constant_folding")
            torch.onnx.export(model, (example,), str(path), dynamo=True,
                              dynamic_shapes=({0: batch},), **kwargs)
            return
        torch.onnx.export(model, (example,), str(path), dynamic_axes=dynamic_axes, **kwargs)


# ---------------------------------------------------------------------------------------------------
# JPEG decoding with torchvision.io (dlenv.data.decode, dlenv.data.sources).


def _decode_jpeg_params() -> set:
    import torchvision.io

    return set(inspect.signature(torchvision.io.decode_jpeg).parameters)


def decode_jpeg(data: Any, device: Any = "cpu") -> Any:
    """torchvision.io.decode_jpeg to 3-channel RGB uint8 (C, H, W), EXIF orientation applied where this
    torchvision can (0.17+, on the CPU; nvJPEG on CUDA ignores it: see decode.upright). `data` is a
    uint8 tensor of file bytes, or a list of them (a batch: on CUDA only with torchvision 0.19+, see
    `cuda_jpeg_batch_decode`). Raises RuntimeError for a file it cannot decode."""
    import torchvision.io

    kwargs: dict[str, Any] = {"mode": torchvision.io.ImageReadMode.RGB}
    if str(device) != "cpu":
        kwargs["device"] = device
    elif "apply_exif_orientation" in _decode_jpeg_params():
        kwargs["apply_exif_orientation"] = True
    return torchvision.io.decode_jpeg(data, **kwargs)


def decode_jpeg_applies_exif() -> bool:
    """Whether `decode_jpeg` on the CPU applies EXIF orientation (torchvision 0.17+)."""
    return "apply_exif_orientation" in _decode_jpeg_params()


_CUDA_JPEG: dict[str, str | None] = {}


def cuda_jpeg_unavailable(device: Any = "cuda") -> str | None:
    """Why torchvision.io.decode_jpeg cannot decode JPEGs on this CUDA device (one line), or None.

    Tried once per device on a tiny JPEG made in memory: a torchvision built without nvJPEG, or one
    whose kernels do not run on this GPU, fails here rather than in the middle of a run.
    """
    key = str(device)
    if key in _CUDA_JPEG:
        return _CUDA_JPEG[key]
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA GPU is visible"
    elif "device" not in _decode_jpeg_params():
        import torchvision

        reason = f"torchvision {torchvision.__version__} cannot decode JPEGs on the GPU"
    else:
        try:
            import io

            from PIL import Image

            buf = io.BytesIO()
            Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="JPEG")
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            out = decode_jpeg(data, device=device)
            torch.cuda.synchronize(device)
            if tuple(out.shape) != (3, 16, 16):
                reason = f"torchvision.io.decode_jpeg on {device} returned shape {tuple(out.shape)}"
        except Exception as e:  # any failure of the library means: do not use it
            reason = f"torchvision.io.decode_jpeg on {device} failed ({' '.join(str(e).split())[:120]})"
    _CUDA_JPEG[key] = reason
    return reason


def cuda_jpeg_batch_decode() -> bool:
    """Whether decode_jpeg takes a list of images and decodes them as one batch on CUDA (torchvision 0.19+)."""
    import torchvision

    return _version(torchvision.__version__) >= (0, 19)


def cuda_jpeg_overlap_unavailable() -> str | None:
    """Why decode_jpeg on CUDA cannot overlap other work on the GPU (one line), or None (torchvision 0.19+).

    Before 0.19 (the image's 0.14 among them) torchvision decodes one image per call and creates and
    destroys an nvJPEG state for each (its decode_jpeg_cuda.cpp); the state's buffers go back with cudaFree,
    which waits for the whole GPU, so a decoding thread would stall the model once per image. Read from
    the source, not measured. 0.19+ decodes a batch per call with a decoder it keeps."""
    if cuda_jpeg_batch_decode():
        return None
    import torchvision

    return (f"torchvision {torchvision.__version__} decodes one JPEG per call on the GPU, freeing its nvJPEG "
            "state after each, which waits for the whole GPU; 0.19+ decodes batches")
