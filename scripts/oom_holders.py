"""What a caught out-of-memory keeps alive on the GPU, and who holds it (issue 54, docs/memory.md).

    python scripts/oom_holders.py                 # dlenv as it is: the bytes left after the one line
    python scripts/oom_holders.py --as-before     # without train()'s release of the run's frames

Trains ResNet-50 (fp32, 224 px) on synthetic data with a batch of twice what the card holds, keeps the
UserError as a notebook keeps its last exception, and then, with the garbage collector off (so that only
reference counts free anything), prints `torch.cuda.memory_allocated()` and, for each CUDA tensor still
alive, the chain of referrers that keeps it (up to a frame's local, a module global or a class). Then three
more tries in the same process (a batch that fits, then the one that does not, twice) and the bytes after
each failure, against the bytes before the first. Needs one CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
import types

import torch

from dlenv.errors import UserError
from dlenv.options import config
from dlenv.options.config import TrainConfig
from dlenv.train import run as run_mod

MIB = 2**20


def _chain(obj, skip: set[int], depth: int = 7) -> str:
    """The first chain of referrers from `obj` up to a frame's local, a module's global or a class."""
    path, seen = [], set(skip)
    for _ in range(depth):
        seen.add(id(obj))
        refs = [r for r in gc.get_referrers(obj) if id(r) not in seen and not isinstance(r, types.FrameType)
                or isinstance(r, types.FrameType) and r is not sys._getframe()]
        refs = [r for r in refs if id(r) not in seen]
        if not refs:
            return " <- ".join(path + ["(no referrer: a cycle, or held by C++)"])
        frames = [r for r in refs if isinstance(r, types.FrameType)]
        if frames:
            f = frames[0]
            names = [k for k, v in f.f_locals.items() if v is obj]
            return " <- ".join(path + [f"local {names[0] if names else '?'} of {f.f_code.co_name}()"])
        r = refs[0]
        if isinstance(r, dict):
            owner = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
            key = next((k for k, v in r.items() if v is obj), "?")
            path.append(f"[{key!r}]")
            if owner:
                obj = owner[0]
                path.append(type(obj).__name__)
                continue
        else:
            path.append(type(r).__name__)
        obj = r
    return " <- ".join(path + ["..."])


def census(title: str) -> None:
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    total = sum(t.untyped_storage().nbytes() if hasattr(t, "untyped_storage") else t.storage().nbytes()
                for t in tensors)
    print(f"\n## {title}: {torch.cuda.memory_allocated() / MIB:,.0f} MiB allocated; "
          f"{len(tensors)} CUDA tensors alive ({total / MIB:,.0f} MiB in their storages)")
    big = sorted(tensors, key=lambda t: -t.numel() * t.element_size())[:6]
    skip = {id(tensors), id(big)}
    for t in big:
        print(f"- {tuple(t.shape)} {t.dtype} {t.numel() * t.element_size() / MIB:,.0f} MiB: {_chain(t, skip)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--as-before", action="store_true", help="skip train()'s release of the run's frames")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("oom_holders.py: needs a CUDA GPU")
        return 2
    if args.as_before:  # train() releases only UserErrors and out-of-memory errors: make it see neither
        run_mod.UserError = type("Never", (Exception,), {})
        run_mod.compat = types.SimpleNamespace(is_oom=lambda e: False)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    huge = int(total / 21 * 256 * 2)  # ResNet-50 fp32 at 224 px needs ~21 GiB for 256 images: twice the card
    base = dict(synthetic=True, device="cuda", workers=0, epochs=1, project="/tmp/oom_holders", exist_ok=True)
    oom = dict(base, model="resnet50", img_size=224, batch_size=huge, max_steps=1)
    fits = dict(base, model="resnet50", img_size=176, batch_size=96, amp=True, max_steps=4)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; the failing batch: {huge}")
    before = torch.cuda.memory_allocated()
    kept = []
    gc.disable()
    try:
        run_mod.train(config.build(TrainConfig, **oom))
    except UserError as e:
        kept.append(e)
    census("after the out-of-memory's one line, the exception kept" + (" (as before)" if args.as_before else ""))
    gc.enable()
    after = [torch.cuda.memory_allocated()]
    for kw in (fits, oom, oom):
        try:
            run_mod.train(config.build(TrainConfig, **kw))
        except UserError as e:
            kept[:] = [e]
            after.append(torch.cuda.memory_allocated())
    print("\n| before the first try | after each failure (the exception kept) | worst difference |")
    print("| ---: | --- | ---: |")
    diff = max(abs(a - before) for a in after)
    print(f"| {before / MIB:,.0f} MiB | {', '.join(f'{a / MIB:,.0f} MiB' for a in after)} | {diff / MIB:,.0f} MiB |")
    return 0 if diff <= 64 * MIB else 1


if __name__ == "__main__":
    sys.exit(main())
