"""The smallest reproduction of issue 46: does a run's peak depend on what the process did before?

Each scenario runs in a fresh process: first what a user's process may have done (nothing; freed a
large block; hit a real out-of-memory; trained a large batch; capped the memory fraction and lifted
it), then the same ResNet-50 bf16 channels-last training steps (batch 96, 176 px, cuDNN autotuning
on, as the trainer sets it) with and without `torch.cuda.empty_cache()` in between. It prints, per
scenario, the steps' peak allocated memory, the largest cached free block when they start, and img/s.

    python3 scripts/repro_peak.py [--only NAME,...] [--step-guard]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

SCENARIOS = ["fresh", "freed_block", "freed_block+empty", "oom_alloc", "oom_conv", "oom_conv+empty",
             "big_run", "big_run+empty", "fraction", "expandable+freed_block"]
GIB = 2**30


def largest_free() -> int:
    import torch

    return max((b["size"] for s in torch.cuda.memory_snapshot() for b in s.get("blocks", [])
                if b.get("state") == "inactive"), default=0)


def steps(batch: int = 96, size: int = 176, n: int = 4) -> dict:
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    m = torchvision.models.resnet50(num_classes=10).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda")
    torch.cuda.synchronize()
    start_free = largest_free()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = sorted(times[1:])[len(times[1:]) // 2]
    return {"peak_gib": torch.cuda.max_memory_allocated() / GIB, "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "largest_free_at_start_gib": start_free / GIB, "first_step_s": times[0], "img_s": batch / steady}


def before(name: str) -> None:
    import torch

    base = name.split("+")[-1] if name.startswith("expandable") else name.split("+")[0]
    if base == "freed_block":
        free, _ = torch.cuda.mem_get_info()
        b = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
        del b
    elif base == "oom_alloc":
        total = torch.cuda.get_device_properties(0).total_memory
        with contextlib.suppress(torch.cuda.OutOfMemoryError):
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    elif base == "oom_conv":
        import torchvision

        m = torchvision.models.resnet50(num_classes=10).cuda()
        with contextlib.suppress(torch.cuda.OutOfMemoryError):
            m(torch.randn(12000, 3, 224, 224, device="cuda")).sum().backward()
        del m
    elif base == "big_run":
        steps(batch=1024, size=224, n=2)
        torch.cuda.synchronize()
    elif base == "fraction":
        torch.cuda.set_per_process_memory_fraction(0.3)
        steps(batch=64, size=128, n=1)
        torch.cuda.set_per_process_memory_fraction(1.0)
    if name.endswith("+empty"):
        torch.cuda.empty_cache()


def child(name: str) -> None:
    import torch

    torch.cuda.init()
    before(name)
    out = {"scenario": name, **steps()}
    out["num_ooms"] = torch.cuda.memory_stats().get("num_ooms", 0)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    names = [n for n in SCENARIOS if not a.only or n in a.only.split(",")]
    print("| scenario | peak alloc GiB | peak reserved GiB | largest cached free block at start GiB "
          "| first step s | img/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for n in names:
        env = dict(os.environ)
        if n.startswith("expandable"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        p = subprocess.run([sys.executable, __file__, "--child", n], capture_output=True, text=True, env=env)
        res = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
        if res is None:
            print(f"| {n} | failed: {(p.stderr.strip().splitlines() or ['?'])[-1][:120]} | | | | |")
            continue
        print(f"| {n} | {res['peak_gib']:.2f} | {res['reserved_gib']:.2f} | {res['largest_free_at_start_gib']:.2f} "
              f"| {res['first_step_s']:.2f} | {res['img_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
