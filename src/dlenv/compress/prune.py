"""`dlenv prune`: pruning a trained run file, re-validated, with what it bought measured.

Unstructured (default): `torch.nn.utils.prune.global_unstructured` with L1 ranks |w| across all conv
and linear weights at once and zeroes the smallest `amount` of them, so layers lose different shares
(the report lists each). The zeros are stored in dense tensors of the same shape: the file, the memory
and the time of a forward stay the same until the weights are stored sparse; only the zipped file
shrinks. The report says so in one line.

Structured (`--structured`): whole channels are removed, following the model's dependencies
(dlenv.compress.channels, Torch-Pruning), until about `amount` of the parameters are gone. The model
really is smaller and faster; its run file records the new layer widths (dlenv.model.shrink), so `val`,
`predict` and `export` rebuild it from the architecture's name and those numbers (never from code in the
file). Before writing, the run file is rebuilt that way and must give the pruned model's outputs.

`--finetune-epochs N` trains the pruned model on the run file's training data through the trainer's
own step (dlenv.engine.step.train_step). Unstructured pruning keeps its masks attached meanwhile (the weight is
weight_orig * mask on every forward, so pruned weights stay exactly zero), then makes them permanent.

The report: top-1, parameters, file size (raw and zipped), CPU latency (median, p10-p90) and, on a
machine with a GPU, GPU latency, before and after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune as tprune

from dlenv.cluster.devices import resolve_device
from dlenv.compress import channels, common
from dlenv.data.loaders import build_loaders
from dlenv.data.plan import InputPlan
from dlenv.engine.precision import Precision
from dlenv.engine.step import Parts, train_step
from dlenv.errors import UserError
from dlenv.files.atomic import check_output
from dlenv.files.runstate import environment, save_state
from dlenv.files.weights import LoadPolicy
from dlenv.model import shrink
from dlenv.model.models import model_from_state
from dlenv.runfolder import check_replaceable

#: Layer types whose `weight` is pruned.
PRUNABLE = (nn.modules.conv._ConvNd, nn.Linear)


def check_amount(amount: float) -> float:
    """Return `amount` if it lies strictly between 0 and 1; else raise UserError naming it."""
    if not 0.0 < float(amount) < 1.0:
        raise UserError(f"--amount {amount} is outside (0, 1): it is the share of the weights to remove (single "
                        "weights, or whole channels with --structured), e.g. --amount 0.3")
    return float(amount)


def prunable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every conv and linear layer with a weight, in model order."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, PRUNABLE) and isinstance(getattr(m, "weight", None), torch.Tensor)]


def apply_pruning(model: nn.Module, amount: float) -> list[tuple[str, nn.Module]]:
    """Attach global L1 unstructured pruning masks to `model` in place: exactly round(amount * total) of
    all conv and linear weights are zeroed. Returns the pruned (name, module) pairs; the masks stay
    attached (weight = weight_orig * weight_mask) until `make_permanent`. Raises UserError for an amount
    outside (0, 1) or a model without such layers.
    """
    amount = check_amount(amount)
    layers = prunable_layers(model)
    if not layers:
        raise UserError("the model has no conv or linear layers to prune")
    tprune.global_unstructured([(m, "weight") for _, m in layers], pruning_method=tprune.L1Unstructured,
                               amount=amount)
    return layers


def make_permanent(layers: list[tuple[str, nn.Module]]) -> None:
    """Fold each mask into its weight and drop weight_orig/weight_mask (plain state dict keys again)."""
    for _, m in layers:
        if tprune.is_pruned(m):
            tprune.remove(m, "weight")


def sparsity(model: nn.Module) -> tuple[float, list[dict[str, Any]]]:
    """(global sparsity, per-layer rows) over the prunable weights of `model`, as fractions 0-1.

    Each row: name, shape, params, zeros, sparsity. With masks still attached the effective weight
    (orig * mask) is counted.
    """
    rows, total, zeros = [], 0, 0
    for name, m in prunable_layers(model):
        w = m.weight.detach()
        z = int((w == 0).sum())
        rows.append({"name": name, "shape": tuple(w.shape), "params": w.numel(), "zeros": z,
                     "sparsity": z / w.numel()})
        total += w.numel()
        zeros += z
    return (zeros / total if total else 0.0), rows


def finetune(model: nn.Module, loader: Any, device: torch.device, epochs: int, lr: float) -> list[float]:
    """Train `model` for `epochs` with SGD (momentum 0.9, cosine to 0) through the trainer's step; returns
    the mean loss of each epoch. Masked weights (unstructured pruning) stay zero: their gradient is zero and
    the forward multiplies by the mask anyway."""

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


def pruned_run_file(run_file: dict[str, Any], model: nn.Module, info: dict[str, Any],
                      widths: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The input run file with the pruned weights: same format, config and class names, and for a
    channel-pruned model the layer `widths` it is rebuilt at (dlenv.model.shrink).

    Optimizer, scaler, scheduler and EMA states described the dense weights, so they are dropped
    (None): the result is for validation, prediction and export.
    """

    state = dict(run_file)
    state["model"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for key in ("optimizer", "scaler", "scheduler", "ema"):
        if key in state:
            state[key] = None
    state["best_metric"] = info.get("top1_after")
    state["pruning"] = info
    state["env"] = environment()
    if widths:  # on top of an earlier prune's: the layers this one left alone keep their widths
        state["widths"] = {**(run_file.get("widths") or {}), **widths}
    return state


#: a prune without fine-tuning that loses more top-1 points than this ends by naming --finetune-epochs
FINETUNE_HINT_POINTS = 2.0


def default_output(src_path: Path, structured: bool) -> Path:
    """Where a prune writes without --out: <stem>_pruned.pth, <stem>_pruned_structured.pth for --structured
    (the two kinds never replace each other)."""
    return src_path.with_name(f"{src_path.stem}_pruned{'_structured' if structured else ''}.pth")


def finetune_hint(top1_before: float, top1_after: float, finetune_epochs: int) -> str | None:
    """The last line of a prune that lost more than FINETUNE_HINT_POINTS of top-1 without fine-tuning."""
    lost = top1_before - top1_after
    if finetune_epochs or lost <= FINETUNE_HINT_POINTS:
        return None
    return (f"top-1 fell {lost:.1f} points ({top1_before:.2f}% -> {top1_after:.2f}%); --finetune-epochs 3 retrains "
            "the pruned model on the run's training data and recovers most of it (docs/compress.md)")


def _output_path(cfg: Any, src_path: Path) -> Path:
    out = check_output(cfg.out, "--out") if cfg.out else default_output(src_path, cfg.structured)
    return check_replaceable(out, src_path)


def _check_rebuilt(state: dict[str, Any], pruned: nn.Module, example: torch.Tensor, source: str) -> None:
    """Rebuild the channel-pruned run file as val and predict will (dlenv.model.models from the name and the
    widths) and compare its outputs with the pruned model's; raise UserError when they differ."""

    rebuilt = model_from_state(state, source=source)[0].eval()
    with torch.no_grad():
        a, b = rebuilt(example), pruned.eval()(example)
    if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
        raise UserError(f"the pruned model rebuilt from its run file gives other outputs (by up to "
                        f"{float((a - b).abs().max()):.3g}); nothing was written. Prune without --structured")


def _structured(src: Any, amount: float) -> tuple[nn.Module, dict[str, Any], dict[str, list[int]]]:
    """(the channel-pruned copy of src.model, report fields, the widths to record)."""

    example = torch.randn(1, 3, src.img_size, src.img_size)
    dense = src.model.cpu().eval()
    pruned, ratio = channels.remove_channels(dense, amount, example, len(src.class_names))
    lost = shrink.unsupported(pruned, dense)
    if lost:
        raise UserError(f"pruning channels resized {', '.join(lost[:3])}, a kind of layer dlenv cannot rebuild "
                        "from a run file; prune without --structured")
    widths = shrink.widths_of(pruned, dense)
    print(f"removed {ratio:.1%} of the channels of every layer group ({len(widths)} layers resized)")
    return pruned, {"channel_ratio": ratio}, widths


def _finetune(cfg: Any, src: Any, model: nn.Module, device: torch.device, masks: bool) -> None:

    layout = common.train_layout(src)
    plan = InputPlan.classic(src.img_size, cfg.batch_size, cfg.workers, seed=int(src.config.get("seed", 0)),
                             norm=src.norm, interpolation=src.interpolation)
    if plan.workers_why:
        print(plan.workers_why)
    train_loader, _ = build_loaders(layout, plan)
    print(f"fine-tuning {cfg.finetune_epochs} epoch(s) on {len(train_loader.dataset)} training images, "
          f"lr {cfg.finetune_lr:g}" + (", masks kept" if masks else ""))
    try:
        finetune(model, train_loader, device, cfg.finetune_epochs, cfg.finetune_lr)
    finally:  # its persistent workers, now rather than at a garbage collection (loaders.SafeLoader)
        close = getattr(train_loader, "close", None)
        if close is not None:
            close()
    model.cpu()


def main(cfg: Any) -> int:
    """`dlenv prune`: prune cfg.weights, optionally fine-tune, re-validate, save <stem>_pruned.pth
    (<stem>_pruned_structured.pth for --structured); a loss of more than FINETUNE_HINT_POINTS without
    fine-tuning ends by naming --finetune-epochs.

    Prints per-layer sparsity (unstructured) and a before/after table (top-1, parameters, sizes, CPU and
    GPU latency). Returns 0. Raises UserError for an amount outside (0, 1), a run file that is missing
    or has no class names, data that is missing or has other classes, a model whose channels cannot be
    removed or rebuilt, or a bad --device.
    """

    amount = check_amount(cfg.amount)
    src = common.open_weights(cfg.weights, "prune", LoadPolicy.of(cfg), cfg.model)
    out = _output_path(cfg, src.path)
    device = resolve_device(cfg.device)
    root, loader = common.eval_loader(cfg.data, src, cfg.batch_size, cfg.workers)
    if cfg.finetune_epochs:
        common.train_layout(src)  # its data must be here before anything is pruned

    kind = ("channels removed (L2, following the model's dependencies)" if cfg.structured
            else "global L1 unstructured (conv + linear)")
    print(f"pruning {src.path}: {kind}, amount {amount:g}; validating on {root} ({device})")
    dense = common.cpu_copy(src.model)  # timed beside the pruned model at the end, turn about
    before = {"top1": common.top1(src.model, loader, device, src.class_names, src.path)}
    info: dict[str, Any] = {}
    widths = None
    rows: list[dict[str, Any]] = []
    if cfg.structured:
        model, info, widths = _structured(src, amount)
        if cfg.finetune_epochs:
            _finetune(cfg, src, model, device, masks=False)
    else:
        model = src.model.cpu()
        layers = apply_pruning(model, amount)
        if cfg.finetune_epochs:
            _finetune(cfg, src, model, device, masks=True)
        make_permanent(layers)
        info["sparsity"], rows = sparsity(model)
    model.eval()
    diverged = (f"fine-tuning at --finetune-lr {cfg.finetune_lr:g} diverged; nothing was written: pass a smaller "
                f"--finetune-lr (e.g. {cfg.finetune_lr / 10:g})" if cfg.finetune_epochs else None)
    after = {"top1": common.top1(model, loader, device, src.class_names, "the pruned model", diverged)}
    model.cpu()
    info.update({"amount": amount, "structured": bool(cfg.structured), "finetune_epochs": int(cfg.finetune_epochs),
                 "source": str(src.path), "top1_before": before["top1"], "top1_after": after["top1"],
                 "params_before": common.count_params(dense), "params_after": common.count_params(model)})
    state = pruned_run_file(src.run_file, model, info, widths)
    if widths:
        _check_rebuilt(state, model, torch.randn(2, 3, src.img_size, src.img_size), str(out))
    save_state(state, out)
    file_raw, file_zip = common.file_sizes(out)

    if rows:
        print(_layer_table(rows))
        print(f"\nglobal sparsity: {info['sparsity'] * 100:.2f}% of {sum(r['params'] for r in rows):,} "
              "conv + linear weights")
    print(common.compare_table(dense, model, src.img_size, [before["top1"], after["top1"]]))
    if not cfg.structured:
        print("note: unstructured pruning saves nothing until the weights are stored sparse: the zeros sit in "
              "dense tensors, so the file, memory and latency stay the same (only the zipped size shrinks); "
              "--structured removes whole channels")
    print(f"\nwrote {out} ({common.mib(file_raw)}, zipped {common.mib(file_zip)})")
    hint = finetune_hint(before["top1"], after["top1"], cfg.finetune_epochs)
    if hint:
        print(hint)  # last: the line a user reads after a prune that cost accuracy
    return 0


def _layer_table(rows: list[dict[str, Any]]) -> str:
    body = [[r["name"], "x".join(map(str, r["shape"])), f"{r['params']:,}", f"{r['sparsity'] * 100:.1f}%"]
            for r in rows]
    return common.table(["layer", "shape", "weights", "sparsity"], body)
