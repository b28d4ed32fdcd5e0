"""Every PyTorch feature check, in one place.

The toolkit runs unchanged on the default profile (PyTorch 1.13.1) and on current 2.x. Code elsewhere
asks this module ("is there torch.compile?", "give me a GradScaler") instead of testing versions
itself, so the differences between releases are visible here and nowhere else.
"""

from __future__ import annotations

import os
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


def grad_scaler(enabled: bool) -> Any:
    """A CUDA GradScaler; a disabled one is a no-op (scale() returns the loss, step() just steps)."""
    if _HAS_AMP_GRADSCALER:
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def autocast(device_type: str, dtype: torch.dtype | None, enabled: bool):
    """torch.autocast for 'cuda' or 'cpu' (1.13 and 2.x share this signature)."""
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)


def load_weights_only(path: Any, map_location: Any = "cpu") -> Any:
    """torch.load(..., weights_only=True): tensors and plain types only, never arbitrary pickles.

    weights_only exists from 1.13 on; 2.6 made it the default, we always pass it.
    """
    return torch.load(path, map_location=map_location, weights_only=True)


def compile_model(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch.compile(model) where it exists; raises RuntimeError on PyTorch 1.x."""
    if not HAS_COMPILE:
        raise RuntimeError(f"PyTorch {torch.__version__} has no torch.compile (it arrived in 2.0)")
    return torch.compile(model, **kwargs)


def cuda_arch_supported(capability: tuple[int, int]) -> bool:
    """Whether this torch build carries kernels (SASS, or PTX it can JIT) for a compute capability."""
    archs = torch.cuda.get_arch_list() if torch.cuda.is_available() else []
    want = capability[0] * 10 + capability[1]
    sass = {int(a.split("_")[1]) for a in archs if a.startswith("sm_")}
    ptx = {int(a.split("_")[1]) for a in archs if a.startswith("compute_")}
    # SASS runs on the same major generation with a minor >= its own; PTX JITs for anything newer.
    if any(a // 10 == want // 10 and a <= want for a in sass):
        return True
    return any(a <= want for a in ptx)


def set_allocator_conf(conf: str) -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF; only takes effect before CUDA is first initialised."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
