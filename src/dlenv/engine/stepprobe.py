"""The probe of a batch size: real training steps of a model on random data, False where they run out of memory.

`TrainStepProbe` is the `try_step` of the searches for the batch (dlenv.engine.autobatch) and for the
fewest checkpointed blocks (dlenv.engine.checkpointsearch): it trains its own copy of the model with the
trainer's own step (dlenv.engine.step.train_step) at the run's precision, checkpointing and memory format,
and frees what a try left before the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dlenv.compat import is_oom
from dlenv.engine import memory
from dlenv.engine.optim import probe_optimizer
from dlenv.engine.precision import Precision
from dlenv.engine.step import Parts, train_step
from dlenv.model.checkpointing import apply_checkpointing


class TrainStepProbe:
    """A `try_step` for `find_max_batch`: real training steps on random data at a given batch size.

    Call it with a batch size: it runs `steps` of the trainer's own training step
    (dlenv.engine.step.train_step: forward, backward, optimizer step) and returns True, or False on CUDA
    out of memory; other errors propagate. The optimizer's state (momentum; AdamW's two moments) is
    made by the first step that succeeds and then kept, as in training, so one step per try meets the
    same peak as a training step. After each call the
    gradients and the cached blocks are freed and the peak statistics reset, so a failed try does
    not weigh on the next.

    cuDNN autotuning is off during tries (`autotune=False`): it would benchmark every new batch
    shape, seconds per try, and where memory is short it only picks kernels with smaller workspaces.
    The probe trains its own model (from `model_factory`); call `close()` before building the real
    one so its memory is returned.
    """

    def __init__(self, model_factory: Callable[[], Any], precision_mode: str, checkpoint: bool | float,
                 img_size: int, num_classes: int, device: Any, channels_last: bool = False,
                 steps: int = 1, optimizer: str = "sgd", autotune: bool = False):
        self.device = torch.device(device)
        self.img_size, self.num_classes, self.steps, self.autotune = img_size, num_classes, steps, autotune
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        model = model_factory()
        if checkpoint:
            apply_checkpointing(model, ratio=1.0 if checkpoint is True else float(checkpoint))
        model = model.to(self.device, memory_format=self.memory_format).train()
        opt = probe_optimizer(model.parameters(), optimizer)
        self.parts = Parts.plain(model, opt, Precision(precision_mode, self.device), self.memory_format)

    def _train(self, batch: int) -> None:
        # every tensor of a try is local to this frame, so an OOM's traceback frees them with it;
        # until the optimizer has state, one more step makes it (its memory is part of every later peak)
        for _ in range(self.steps + (0 if self.parts.optimizer.state else 1)):
            x = torch.randn(batch, 3, self.img_size, self.img_size, device=self.device)
            x = x.contiguous(memory_format=self.memory_format)
            y = torch.randint(0, self.num_classes, (batch,), device=self.device)
            train_step(self.parts, x, y)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, batch: int) -> bool:
        ok = True
        autotune = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.autotune
        try:
            self._train(batch)
        except Exception as e:
            if not is_oom(e):
                raise
            ok = False
        finally:
            torch.backends.cudnn.benchmark = autotune
        # outside the except block: the exception and its frames (activations, grads) are gone now
        self.free()
        return ok

    def rate(self, batch: int, timed: int = 3) -> float | bool:
        """img/s of `timed` training steps at `batch` after one untimed step (the first pays for new
        shapes), or False on out of memory; what `fastest_batch` compares."""
        autotune = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.autotune
        steps, self.steps = self.steps, 1
        try:
            self._train(batch)
            self.steps = timed
            t = time.perf_counter()
            self._train(batch)  # ends with a synchronize on CUDA
            return batch * timed / max(time.perf_counter() - t, 1e-9)
        except Exception as e:
            if not is_oom(e):
                raise
            return False
        finally:
            self.steps = steps
            torch.backends.cudnn.benchmark = autotune
            self.free()

    def free(self) -> None:
        """Drop gradients and cached blocks; reset peak statistics."""
        self.parts.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        """Release the probe's model, optimizer state and their GPU memory."""
        self.parts = None
        if self.device.type == "cuda":
            memory.release_cached()


def make_train_step_probe(model_factory: Callable[[], Any], precision_mode: str, checkpoint: bool | float,
                          img_size: int, num_classes: int, device: Any, channels_last: bool = False,
                          steps: int = 1, optimizer: str = "sgd") -> TrainStepProbe:
    """A callable(batch) -> bool that runs real training steps and returns False on out of memory.

    `checkpoint` is False, True or a ratio of blocks to checkpoint; `precision_mode` is "fp32",
    "fp16" or "bf16" (see dlenv.engine.precision). See `TrainStepProbe`.
    """
    return TrainStepProbe(model_factory, precision_mode, checkpoint, img_size, num_classes, device,
                          channels_last=channels_last, steps=steps, optimizer=optimizer)
