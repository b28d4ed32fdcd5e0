"""How learnable is the demo dataset? A small CNN trained on a CPU for a fixed time budget.

Writes the demo dataset (or uses --data), decodes it once into memory, trains a 4-block CNN with
AdamW and a warmup + cosine schedule timed to the budget, on random flips and shifts, and prints
one row per epoch: seconds so far, training loss, validation top-1. Also prints the accuracy of a
nearest-centroid classifier on each image's mean colour, which should sit at chance (the demo's
colours carry no class).

    python3 scripts/demo_learnability.py --seconds 120 --threads 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dlenv.data.decode import load_rgb  # noqa: E402
from dlenv.data.demo import ensure_demo_data  # noqa: E402
from dlenv.data.folder import find_layout  # noqa: E402


def small_cnn(classes: int, width: int = 16) -> nn.Module:
    """Four conv-BN-ReLU-maxpool blocks (width, 2x, 4x, 8x channels), global pooling, linear."""
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))
    return nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width),
                         block(4 * width, 8 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8 * width, classes))


def to_tensors(samples):
    x = np.stack([np.asarray(load_rgb(p)) for p, _ in samples])
    y = np.array([label for _, label in samples])
    x = torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255)
    return (x - 0.5) / 0.25, torch.from_numpy(y)


def augment(x: torch.Tensor) -> torch.Tensor:
    flip = torch.rand(len(x)) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    pad = x.shape[-1] // 8
    padded = nn.functional.pad(x, (pad,) * 4, mode="replicate")
    i, j = np.random.randint(0, 2 * pad + 1, size=2)
    return padded[..., i:i + x.shape[-2], j:j + x.shape[-1]]


def centroid_accuracy(xt, yt, xv, yv) -> float:
    ft, fv = xt.mean((2, 3)), xv.mean((2, 3))
    cents = torch.stack([ft[yt == k].mean(0) for k in range(int(yt.max()) + 1)])
    return (torch.cdist(fv, cents).argmin(1) == yv).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="demo dataset folder (default: generate one in a temp folder)")
    ap.add_argument("--seconds", type=float, default=120, help="training time budget")
    ap.add_argument("--threads", type=int, default=4, help="CPU threads for torch")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    np.random.seed(0)

    t0 = time.perf_counter()
    root = Path(args.data) if args.data else ensure_demo_data(Path(tempfile.mkdtemp()) / "demo")
    lay = find_layout(root)
    xt, yt = to_tensors(lay.train)
    xv, yv = to_tensors(lay.val)
    print(f"data {root}: {len(xt)} train / {len(xv)} val, {len(lay.classes)} classes, "
          f"{xt.shape[-1]} px; ready in {time.perf_counter() - t0:.1f} s")
    print(f"nearest centroid on mean colour: val top-1 {centroid_accuracy(xt, yt, xv, yv):.3f} "
          f"(chance {1 / len(lay.classes):.3f})")

    model = small_cnn(len(lay.classes))
    steps_per_epoch = len(xt) // args.batch
    peak = 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.05)
    print(f"torch {torch.__version__}, {args.threads} CPU threads, batch {args.batch}, budget {args.seconds:g} s")
    print(f"{'epoch':>5} {'seconds':>8} {'train_loss':>10} {'val_top1':>8}")
    start = time.perf_counter()
    frac, epoch = 0.0, 0
    while frac < 1.0:
        epoch += 1
        model.train()
        perm = torch.randperm(len(xt))
        total = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * args.batch:(s + 1) * args.batch]
            loss = loss_fn(model(augment(xt[idx])), yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            # The schedule runs on the clock (warmup, then cosine to 0 at the budget's end), so the
            # model is annealed however fast this CPU is.
            frac = min((time.perf_counter() - start) / args.seconds, 1.0)
            for g in opt.param_groups:
                g["lr"] = peak * min(frac / 0.05, 0.5 * (1 + np.cos(np.pi * frac)))
            opt.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            pred = torch.cat([model(xv[i:i + 256]).argmax(1) for i in range(0, len(xv), 256)])
        acc = (pred == yv).float().mean().item()
        elapsed = time.perf_counter() - start
        print(f"{epoch:>5} {elapsed:>8.1f} {total / steps_per_epoch:>10.3f} {acc:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
