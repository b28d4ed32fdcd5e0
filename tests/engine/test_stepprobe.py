"""dlenv.engine.stepprobe: the real probe on a GPU (a capped allocator stands in for a small card); on a CPU its
tries are the checkpoint search's (test_checkpointsearch.py)."""

from __future__ import annotations

import gpushare
import pytest

from dlenv.engine.autobatch import search_max_batch
from dlenv.engine.stepprobe import make_train_step_probe


@pytest.mark.gpu  # shares the card: it runs a 2 GiB card of its own out of memory, in one of the card's places
def test_gpu_probe_fits_then_ooms_and_frees_its_memory():
    import torch

    from dlenv.compat import is_oom
    from dlenv.model.models import build_model

    dev = torch.device("cuda", torch.cuda.current_device())
    # a place, and the 2 GiB on top of what this worker's earlier tests still hold: a bare cap of 2 GiB
    # let a batch of 4 fail where earlier tests had left more than that (an H100 run)
    with gpushare.card_of(2):
        probe = make_train_step_probe(lambda: build_model("resnet18", 10), "fp32", False, 64, 10, dev)
        assert probe(4) is True
        base = torch.cuda.memory_allocated(dev)  # weights, momentum, cuBLAS workspaces
        assert probe(100_000) is False  # far beyond 2 GiB: an OOM, caught
        assert torch.cuda.memory_allocated(dev) == base  # nothing of the failed try is left
        assert probe(4) is True
        res = search_max_batch(probe, start=8, tolerance=0.0)
        assert res.smallest_fail == res.largest_fit + 1 and 8 < res.largest_fit < 100_000
        # the boundary itself moves by a sample or two with what the allocator and cuDNN hold when a try
        # comes (an H100 run fitted 881 after the search's 888, 884, 882 and 881 had failed), so the
        # checks are: what the search kept fits again, a batch a tenth past its failure fails, and
        # each failed try gives all of its memory back
        assert probe(res.largest_fit) is True
        assert probe(res.smallest_fail + res.smallest_fail // 10) is False
        assert torch.cuda.memory_allocated(dev) == base
        probe.close()
        with pytest.raises(Exception) as info:
            torch.empty(10 ** 13, dtype=torch.uint8, device=dev)
        assert is_oom(info.value)
    torch.cuda.empty_cache()
