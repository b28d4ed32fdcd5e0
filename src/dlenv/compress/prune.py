"""`dlenv prune`: magnitude pruning of conv and linear weights, made permanent and re-validated.

Unstructured (default): `torch.nn.utils.prune.global_unstructured` with L1 ranks |w| across all conv
and linear weights at once and zeroes the smallest `amount` of them, so layers lose different shares
(the report lists each). Structured (`--structured`): `ln_structured(n=2, dim=0)` zeroes the
`amount` of each conv layer's output channels with the smallest L2 norm; the classifier is left
alone, since its output rows are the classes.

What it buys, honestly: the zeros are stored in dense tensors of the same shape, so the model uses
the same memory and dense GPU/CPU kernels take the same time. Unstructured sparsity shows in the
*zipped* file size; zeroed channels would only speed things up if they were physically removed
(a different architecture, which this command does not write: the result is a checkpoint like any
other, loadable by `dlenv val`, `dlenv export` and `invoke train --weights`). The report measures
size and CPU latency instead of claiming them.

`--finetune-epochs N` trains the pruned model on the checkpoint's training data with the pruning
masks still attached (the weight is recomputed as weight_orig * mask on every forward, so pruned
weights stay exactly zero), then makes the pruning permanent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune as tprune

from dlenv.atomic import check_output
from dlenv.compress import common
from dlenv.errors import UserError

#: Layer types whose `weight` is pruned.
PRUNABLE = (nn.modules.conv._ConvNd, nn.Linear)


def check_amount(amount: float) -> float:
    """Return `amount` if it lies strictly between 0 and 1; else raise UserError naming it."""
    if not 0.0 < float(amount) < 1.0:
        raise UserError(f"--amount {amount} is outside (0, 1): it is the fraction of weights (or channels) "
                        "to remove, e.g. --amount 0.3")
    return float(amount)


def prunable_layers(model: nn.Module, conv_only: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, module) of every conv (and, unless conv_only, linear) layer with a weight, in model order."""
    kinds = (nn.modules.conv._ConvNd,) if conv_only else PRUNABLE
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, kinds) and isinstance(getattr(m, "weight", None), torch.Tensor)]


def apply_pruning(model: nn.Module, amount: float, structured: bool = False) -> list[tuple[str, nn.Module]]:
    """Attach pruning masks to `model` in place; returns the pruned (name, module) pairs.

    Unstructured: global L1 over all conv and linear weights (exactly round(amount * total) weights
    are zeroed). Structured: per conv layer, round(amount * out_channels) output channels by L2
    norm. The masks stay attached (weight = weight_orig * weight_mask) until `make_permanent`.
    Raises UserError for an amount outside (0, 1) or a model without such layers.
    """
    amount = check_amount(amount)
    layers = prunable_layers(model, conv_only=structured)
    if not layers:
        kind = "conv" if structured else "conv or linear"
        raise UserError(f"the model has no {kind} layers to prune")
    if structured:
        for _, m in layers:
            tprune.ln_structured(m, "weight", amount=amount, n=2, dim=0)
    else:
        tprune.global_unstructured([(m, "weight") for _, m in layers], pruning_method=tprune.L1Unstructured,
                                   amount=amount)
    return layers


def make_permanent(layers: list[tuple[str, nn.Module]]) -> None:
    """Fold each mask into its weight and drop weight_orig/weight_mask (plain state dict keys again)."""
    for _, m in layers:
        if tprune.is_pruned(m):
            tprune.remove(m, "weight")


def sparsity(model: nn.Module, conv_only: bool = False) -> tuple[float, list[dict[str, Any]]]:
    """(global sparsity, per-layer rows) over the prunable weights of `model`, as fractions 0-1.

    Each row: name, shape, params, zeros, sparsity, and channels_zeroed (output channels whose
    weights are all zero). With masks still attached the effective weight (orig * mask) is counted.
    """
    rows, total, zeros = [], 0, 0
    for name, m in prunable_layers(model, conv_only):
        w = m.weight.detach()
        z = int((w == 0).sum())
        dead = int((w.reshape(w.shape[0], -1) == 0).all(dim=1).sum())
        rows.append({"name": name, "shape": tuple(w.shape), "params": w.numel(), "zeros": z,
                     "sparsity": z / w.numel(), "channels_zeroed": dead})
        total += w.numel()
        zeros += z
    return (zeros / total if total else 0.0), rows


def finetune(model: nn.Module, loader: Any, device: torch.device, epochs: int, lr: float) -> list[float]:
    """Train `model` (masks attached) for `epochs` with SGD (momentum 0.9, cosine to 0); returns the
    mean loss of each epoch. Masked weights stay zero: their gradient is zero and the forward
    multiplies by the mask anyway."""
    from dlenv.precision import Precision
    from dlenv.step import Parts, train_step

    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    steps = max(1, epochs * len(loader))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    parts = Parts.plain(model, opt, Precision("fp32", device), scheduler=sched)  # the trainer's step
    losses = []
    for epoch in range(epochs):
        total, n = 0.0, 0
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = torch.as_tensor(labels).long().to(device, non_blocking=True)
            loss, _ = train_step(parts, images, labels)
            total += loss.item() * len(labels)
            n += len(labels)
        losses.append(total / max(n, 1))
        print(f"fine-tune epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}")
    model.eval()
    return losses


def pruned_checkpoint(ckpt: dict[str, Any], model: nn.Module, info: dict[str, Any]) -> dict[str, Any]:
    """The input checkpoint with the pruned weights: same format, config and class names.

    Optimizer, scaler, scheduler and EMA states described the dense weights, so they are dropped
    (None): the result is for validation, export, or as --weights of a new training run.
    """
    from dlenv.runstate import environment

    state = dict(ckpt)
    state["model"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for key in ("optimizer", "scaler", "scheduler", "ema"):
        if key in state:
            state[key] = None
    state["best_metric"] = info.get("top1_after")
    state["pruning"] = info
    state["env"] = environment()
    return state


def _output_path(cfg: Any, src_path: Path) -> Path:
    out = check_output(cfg.out, "--out") if cfg.out else src_path.with_name(f"{src_path.stem}_pruned.pth")
    if out.resolve() == src_path.resolve():
        raise UserError(f"--out {out} is the input checkpoint; write the pruned one to another file")
    return out


def main(cfg: Any) -> int:
    """`dlenv prune`: prune cfg.weights, optionally fine-tune, re-validate, save <stem>_pruned.pth.

    Prints per-layer and global sparsity and a before/after table (top-1, sizes, CPU latency).
    Returns 0. Raises UserError for an amount outside (0, 1), a checkpoint that is missing or has no
    class names, data that is missing or has other classes, or a bad --device.
    """
    from dlenv.devices import resolve_device

    amount = check_amount(cfg.amount)
    src = common.load_source(cfg.weights, "prune", cfg.model, common.policy(cfg))
    out = _output_path(cfg, src.path)
    device = resolve_device(cfg.device)
    root, loader = common.eval_loader(cfg.data, src, cfg.batch_size, cfg.workers)
    train_loader = None
    if cfg.finetune_epochs:
        from dlenv.data.loaders import build_loaders
        from dlenv.data.plan import InputPlan

        layout = common.train_layout(src)
        seed = int((src.ckpt.get("config") or {}).get("seed", 0))
        train_loader, _ = build_loaders(layout, InputPlan.classic(src.img_size, cfg.batch_size, cfg.workers, seed=seed))

    model = src.model
    kind = "channel (L2, conv layers)" if cfg.structured else "global L1 unstructured (conv + linear)"
    print(f"pruning {src.path}: {kind}, amount {amount:g}; validating on {root} ({device})")
    before = {"top1": common.top1(model, loader, device, src.class_names)}
    before["size"] = common.saved_sizes(model.state_dict())
    dense = common.cpu_copy(model)  # timed beside the pruned model at the end, turn about

    model.cpu()
    layers = apply_pruning(model, amount, cfg.structured)
    if train_loader is not None:
        print(f"fine-tuning {cfg.finetune_epochs} epoch(s) on {len(train_loader.dataset)} training images, "
              f"lr {cfg.finetune_lr:g}, masks kept")
        try:
            finetune(model, train_loader, device, cfg.finetune_epochs, cfg.finetune_lr)
        finally:  # its persistent workers, now rather than at a garbage collection (loaders.SafeLoader)
            close = getattr(train_loader, "close", None)
            if close is not None:
                close()
    model.cpu()
    make_permanent(layers)
    model.eval()

    g, rows = sparsity(model, conv_only=cfg.structured)
    after = {"top1": common.top1(model, loader, device, src.class_names)}
    model.cpu()
    after["size"] = common.saved_sizes(model.state_dict())
    before["latency"], after["latency"] = common.cpu_latencies([dense, common.cpu_copy(model)], src.img_size)

    info = {"amount": amount, "structured": bool(cfg.structured), "sparsity": g,
            "finetune_epochs": int(cfg.finetune_epochs), "source": str(src.path),
            "top1_before": before["top1"], "top1_after": after["top1"]}
    state = pruned_checkpoint(src.ckpt, model, info)
    from dlenv.runstate import save_checkpoint

    save_checkpoint(state, out)
    file_raw, file_zip = common.file_sizes(out)

    print(_layer_table(rows, cfg.structured))
    what = "conv weights" if cfg.structured else "conv + linear weights"
    print(f"\nglobal sparsity: {g * 100:.2f}% of {sum(r['params'] for r in rows):,} {what}")
    print(common.table(["", "dense", "pruned"], [
        ["top-1 (%)", f"{before['top1']:.2f}", f"{after['top1']:.2f}"],
        ["weights (.pth)", common.mib(before["size"][0]), common.mib(after["size"][0])],
        ["weights zipped", common.mib(before["size"][1]), common.mib(after["size"][1])],
        ["CPU latency, 1 image", str(before["latency"]), str(after["latency"])],
    ]))
    print(common.latency_note([before["latency"], after["latency"]], src.img_size))
    print("note: zeroed weights are still stored and multiplied in dense tensors; expect the zipped size "
          "to shrink, not the raw size, memory or latency" +
          (" (channels would have to be removed from the architecture to run faster)" if cfg.structured else ""))
    print(f"\nwrote {out} ({common.mib(file_raw)}, zipped {common.mib(file_zip)})")
    return 0


def _layer_table(rows: list[dict[str, Any]], structured: bool) -> str:
    headers = ["layer", "shape", "weights", "sparsity"] + (["channels zeroed"] if structured else [])
    body = []
    for r in rows:
        line = [r["name"], "x".join(map(str, r["shape"])), f"{r['params']:,}", f"{r['sparsity'] * 100:.1f}%"]
        if structured:
            line.append(f"{r['channels_zeroed']}/{r['shape'][0]}")
        body.append(line)
    return common.table(headers, body)
