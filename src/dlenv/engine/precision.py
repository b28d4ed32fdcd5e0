"""The one mixed-precision path: fp32, fp16 with a GradScaler, or bf16, chosen once.

The training loop holds one `Precision` and calls the same four things whatever the mode:

    with precision.autocast():
        loss = criterion(model(x), y) / accum_steps
    precision.backward(loss)
    if last_micro_batch:
        stepped = precision.step(optimizer, clip=1.0)   # unscale, clip, step; False if fp16 skipped it
        optimizer.zero_grad(set_to_none=True)

In fp32 the autocast is a no-op and the scaler is a disabled GradScaler (scale() returns the loss,
step() just steps), so "off" is the same code, not a branch. bf16 has fp32's exponent range and needs
no loss scaling; fp16 does, and its scaler skips a step whose gradients overflowed.

`resolve_precision` turns --amp / --amp-dtype into a mode for a device. What --amp becomes on a CPU,
where bf16 may be emulated and slower, is the trainer's decision (dlenv.train.auto.decide_precision).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from dlenv import compat
from dlenv.errors import UserError

MODES = ("fp32", "fp16", "bf16")
#: each mode's compute dtype: the one table of it
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _device_type(device: Any) -> str:
    return torch.device(device).type


def resolve_precision(amp: bool, amp_dtype: str, device: Any) -> str:
    """The precision mode for --amp / --amp-dtype on `device`: "fp32", "fp16" or "bf16".

    No AMP is fp32. On CUDA, auto is bf16 where the GPU supports it (Ampere and newer), else fp16.
    On CPU, AMP is bf16 (CPU autocast has no fp16). Raises UserError for fp16 on CPU, bf16 on a GPU
    without it, or an unknown dtype.
    """
    if amp_dtype not in ("auto", "fp16", "bf16"):
        raise UserError(f"--amp-dtype {amp_dtype!r} is not one of auto, fp16, bf16")
    if not amp:
        return "fp32"
    kind = _device_type(device)
    if kind == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if amp_dtype == "auto":
            return "bf16" if bf16_ok else "fp16"
        if amp_dtype == "bf16" and not bf16_ok:
            raise UserError(f"--amp-dtype bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
                            "use --amp-dtype fp16 (or auto)")
        return amp_dtype
    if kind == "cpu":
        if amp_dtype == "fp16":
            raise UserError("--amp-dtype fp16 on the CPU: CPU autocast computes in bfloat16; "
                            "use --amp-dtype bf16 (or auto), or train on a GPU for fp16")
        return "bf16"
    raise UserError(f"--amp on device {device!s}: mixed precision here supports cuda and cpu only")


class Precision:
    """Autocast, loss scaling and the optimizer step for one precision mode.

    `mode` is "fp32", "fp16" or "bf16"; `device` where the model runs. `scaler` replaces the default
    GradScaler for fp16 (e.g. another init_scale); bf16 and fp32 take none. Raises ValueError for an
    unknown mode, fp16 on the CPU, or a scaler given to bf16/fp32.
    """

    def __init__(self, mode: str, device: Any = "cuda", scaler: Any = None):
        if mode not in MODES:
            raise ValueError(f"precision mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.device_type = _device_type(device)
        self.dtype = DTYPES[mode]
        if mode == "fp16" and self.device_type != "cuda":
            raise ValueError(f"fp16 precision needs a CUDA device, not {device!s} (CPU autocast is bf16)")
        if scaler is not None and mode != "fp16":
            raise ValueError(f"{mode} precision takes no GradScaler: only fp16 needs loss scaling")
        self.scaler = scaler if scaler is not None else compat.grad_scaler(enabled=mode == "fp16")

    def __repr__(self) -> str:
        return f"Precision({self.mode!r}, {self.device_type!r})"

    def autocast(self) -> Any:
        """The forward's context: autocast to fp16/bf16, or a no-op for fp32."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        return compat.autocast(self.device_type, self.dtype, enabled=True)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), on the scaled loss in fp16 so small gradients don't flush to zero."""
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: float | None = None,
             parameters: Iterable[torch.Tensor] | None = None) -> bool:
        """Unscale the gradients, clip their total norm to `clip` if given, step the optimizer.

        `parameters` are the ones to clip (default: all in the optimizer). Returns False when fp16
        skipped the step because a gradient was inf/NaN (the scaler then lowers its scale), else True.
        Does not zero the gradients.
        """
        if clip is not None:
            # Clip the true gradients: in fp16 they are still multiplied by the loss scale here.
            self.scaler.unscale_(optimizer)
            if parameters is None:
                parameters = [p for g in optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(parameters, clip)
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it found inf/NaN and skipped optimizer.step().
        return self.scaler.get_scale() >= scale

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (fp16), {} for fp32 and bf16."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what state_dict() gave; an empty state (from an fp32/bf16 run) keeps the fresh scaler."""
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
