"""--device for every command: 'auto' | 'cpu' | 'cuda' | 'cuda:N' -> a torch.device, checked.

One place so train, val, prune, export and the benchmarks accept the same names and fail with the same
line when a device is not there.
"""

from __future__ import annotations

import torch

from dlenv.errors import UserError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' -> this process's GPU if CUDA is available, else the CPU; 'cuda' -> cuda:<local_rank>.

    `local_rank` is the GPU a torchrun process owns (0 outside torchrun). Raises UserError for a name
    that is no device, a device type other than cuda/cpu, or a GPU this machine does not have.
    """
    name = str(name).strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is not a device; use cuda, cuda:N, cpu or auto") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UserError(f"--device {name!r}: only cuda, cuda:N, cpu or auto are supported")
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available here (torch {torch.__version__}); "
                        "use --device cpu, or run verify-env to see why")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else local_rank
    if index >= count:
        raise UserError(f"--device {name}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)
