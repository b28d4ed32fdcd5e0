"""A pytest plugin for the GPU suite: a census of the CUDA process state after every test (issue 46).

    PYTHONPATH=scripts python3 -m pytest -p census_plugin -m gpu tests/test_train_gpu.py

After each test it writes one line to $CENSUS_OUT (default census.tsv): the allocator's allocated,
reserved and largest cached free block, its OOM and retry counters, cuDNN's benchmark and
deterministic settings, TF32, the allocator settings, and a probe: one ResNet-18 bf16 training step
at a shape no test uses, with cuDNN autotuning on, whose peak above what was allocated before shows
whether the process is in a state where autotuning takes the whole card.
"""

from __future__ import annotations

import os
import time

import pytest

_N = [0]
_T = {}


def _largest_cached_free() -> int:
    import torch

    best = 0
    for seg in torch.cuda.memory_snapshot():
        for b in seg.get("blocks", []):
            if b.get("state") == "inactive":
                best = max(best, int(b.get("size", 0)))
    return best


def _probe() -> tuple[float, float]:
    import torch
    import torchvision

    _N[0] += 1
    size = 96 + 8 * _N[0]  # a new shape each time: cuDNN autotunes it here
    bench = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        m = torchvision.models.resnet18(num_classes=10).cuda().to(memory_format=torch.channels_last)
        x = torch.randn(32, 3, size, size, device="cuda").contiguous(memory_format=torch.channels_last)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            m(x).float().sum().backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        return peak, time.perf_counter() - t
    finally:
        torch.backends.cudnn.benchmark = bench


def _line(name: str, dur: float) -> str:
    import torch

    if not torch.cuda.is_available():
        return f"{name}\tno cuda"
    s = torch.cuda.memory_stats()
    g = 2**30
    frac = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fields = {
        "test": name, "s": f"{dur:.1f}",
        "alloc": f"{torch.cuda.memory_allocated() / g:.2f}", "reserved": f"{torch.cuda.memory_reserved() / g:.2f}",
        "largest_free_cached": f"{_largest_cached_free() / g:.2f}",
        "max_alloc_since_reset": f"{torch.cuda.max_memory_allocated() / g:.2f}",
        "num_ooms": s.get("num_ooms", "-"), "alloc_retries": s.get("num_alloc_retries", "-"),
        "cudnn_bench": torch.backends.cudnn.benchmark, "cudnn_det": torch.backends.cudnn.deterministic,
        "det_algos": torch.are_deterministic_algorithms_enabled(),
        "tf32": f"{torch.backends.cuda.matmul.allow_tf32}/{torch.backends.cudnn.allow_tf32}",
        "fraction": f"{frac(0):.2f}" if frac else "-",
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "-",
        "bench_limit": getattr(torch.backends.cudnn, "benchmark_limit", "-"),
    }
    try:
        peak, secs = _probe()
        fields["probe_peak_gib"], fields["probe_s"] = f"{peak:.2f}", f"{secs:.2f}"
    except Exception as e:  # the census must not stop the suite
        fields["probe_peak_gib"] = f"error {type(e).__name__}"
    return "\t".join(f"{k}={v}" for k, v in fields.items())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t = time.perf_counter()
    yield
    line = _line(item.nodeid, time.perf_counter() - t)
    with open(os.environ.get("CENSUS_OUT", "census.tsv"), "a", encoding="utf-8") as f:
        f.write(line + "\n")
