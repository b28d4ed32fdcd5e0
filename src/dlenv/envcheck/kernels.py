"""Real kernel runs on a GPU: conv2d and matmul, forward and backward, in fp32, fp16 and (from sm_80)
bf16, compared with the same inputs computed in fp32 on the CPU. torch is imported inside the
functions: verify-env reports a broken torch install instead of failing on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlenv.errors import first_line

#: Worst relative error allowed against the CPU fp32 reference, max|out - ref| / max|ref|, over the
#: output and both gradients. fp32 leaves room for TF32, which Ampere+ convolutions use by default
#: (10-bit mantissa); fp16 and bf16 round every output to 11 and 8 significant bits.
TOLERANCE = {"fp32": 5e-3, "fp16": 1e-2, "bf16": 4e-2}


@dataclass
class Kernel:
    """One kernel check: `op` forward and backward in `dtype` on a GPU against the CPU fp32 result."""

    op: str
    dtype: str
    passed: bool
    error: float | None = None  # worst relative error; None when the op raised
    message: str = ""  # the exception's first line, when it raised


def relative_error(out: Any, ref: Any) -> float:
    """max|out - ref| / max|ref| of two tensors (out cast to fp32 on the CPU); inf if out is not finite."""
    import torch

    out = out.detach().float().cpu()
    ref = ref.detach().float().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    scale = ref.abs().max().clamp_min(1e-12)
    return float((out - ref).abs().max() / scale)


def cases() -> dict[str, tuple[tuple[int, ...], tuple[int, ...], Any]]:
    import torch.nn.functional as F

    return {
        "conv2d": ((8, 16, 32, 32), (32, 16, 3, 3), lambda x, w: F.conv2d(x, w, padding=1)),
        "matmul": ((256, 256), (256, 256), lambda a, b: a @ b),
    }


def kernel_check(device: str, op: str, dtype: str) -> Kernel:
    """Run `op` forward and backward on `device` in `dtype`; compare with fp32 on the CPU.

    The inputs are rounded to `dtype` first and the reference uses those same values, so the error
    measures the kernels, not the rounding of the inputs. Never raises for a failing kernel: the
    failure is the result.
    """
    import torch

    from dlenv.engine.precision import DTYPES

    dt = DTYPES[dtype]
    shape_a, shape_b, fn = cases()[op]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(shape_a, generator=gen).to(dt)
    b = torch.randn(shape_b, generator=gen).to(dt)
    with torch.no_grad():
        out_shape = fn(a.float(), b.float()).shape
    grad = torch.randn(out_shape, generator=gen).to(dt)

    def run(dev: str, run_dtype: Any) -> list[Any]:
        x = a.to(dev, run_dtype).requires_grad_()
        y = b.to(dev, run_dtype).requires_grad_()
        out = fn(x, y)
        out.backward(grad.to(dev, run_dtype))
        return [out, x.grad, y.grad]

    try:
        got = run(device, dt)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        ref = run("cpu", torch.float32)
        error = max(relative_error(g, r) for g, r in zip(got, ref, strict=True))
    except Exception as e:  # 'no kernel image is available', cuBLAS/cuDNN failures, AcceleratorError...
        return Kernel(op, dtype, passed=False, message=first_line(e))
    return Kernel(op, dtype, passed=error <= TOLERANCE[dtype], error=error)


def kernel_dtypes(capability: tuple[int, int]) -> list[str]:
    """The dtypes to check on a GPU: fp32 and fp16 everywhere, bf16 from sm_80 (Ampere) on."""
    return ["fp32", "fp16"] + (["bf16"] if capability >= (8, 0) else [])
