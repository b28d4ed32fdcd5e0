"""dlenv.engine.stepprobe: the real probe on a GPU (a capped allocator stands in for a small card); on a CPU its
tries are the checkpoint search's (test_checkpointsearch.py)."""

from __future__ import annotations

import pytest

from dlenv.engine.autobatch import search_max_batch
from dlenv.engine.stepprobe import make_train_step_probe


@pytest.mark.gpu  # shares the card: it runs a 2 GiB card of its own out of memory
def test_gpu_probe_fits_then_ooms_and_frees_its_memory():
    import torch

    from dlenv.compat import is_oom
    from dlenv.model.models import build_model

    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 1024 ** 3 / total, dev)
    try:
        probe = make_train_step_probe(lambda: build_model("resnet18", 10), "fp32", False, 64, 10, dev)
        assert probe(4) is True
        base = torch.cuda.memory_allocated(dev)  # weights, momentum, cuBLAS workspaces
        assert probe(100_000) is False  # far beyond 2 GiB: an OOM, caught
        assert torch.cuda.memory_allocated(dev) == base  # nothing of the failed try is left
        assert probe(4) is True
        res = search_max_batch(probe, start=8, tolerance=0.0)
        assert probe(res.largest_fit) and not probe(res.largest_fit + 1)
        probe.close()
        with pytest.raises(Exception) as info:
            torch.empty(10 ** 13, dtype=torch.uint8, device=dev)
        assert is_oom(info.value)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
