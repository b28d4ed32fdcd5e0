"""Fine-tuning a pretrained model: the new head, the backbone's learning rate, and --freeze-epochs.

The recipe (timm's and torchvision's references do the same in spirit):
- the head is sized to the data and starts fresh; every other weight comes from --pretrained;
- the backbone learns at --backbone-lr x the head's rate (0.1 by default): its features are already
  good, and a full learning rate on them while the head is still random would wreck them;
- --warmup-epochs ramps both up from zero (the same schedule, one factor per optimizer step);
- --freeze-epochs N trains the head alone for the first N epochs, with the backbone's BatchNorm layers in
  eval mode (their running statistics frozen, as the head-only phase must not drift them towards a few
  batches), then unfreezes everything.

Whether a parameter is frozen is a function of the epoch alone (`set_epoch`), and the optimizer holds
every parameter from the start (a frozen one simply has no gradient, so no step and no state), so
--resume lands on the same state before, at and after the unfreeze.

Under DDP (--gpus > 1) the wrapper is built once, with every parameter trainable, and told to look for
unused parameters (`ddp_find_unused`): while the backbone is frozen its parameters take no part in the
backward, DDP marks them ready without a gradient (they keep none, as on one GPU), and from the unfreeze
on they are all-reduced like the head's. The frozen BatchNorm layers are found again at every
`set_epoch`, so --sync-bn's SyncBatchNorm (which replaces the layers) stays frozen too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dlenv.errors import UserError
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model import pretrained

#: attribute of a model prepared for fine-tuning (read by `set_epoch` and `lr_scales`)
_ATTR = "_dlenv_finetune"


@dataclass(frozen=True)
class Recipe:
    """What fine-tuning decided, with the parameter names of the new head."""

    weights: str                # the weights' name (ResNet50_Weights.IMAGENET1K_V2)
    head: tuple[str, ...]       # parameter names of the head (learn at --lr; train while frozen)
    backbone_lr: float          # the backbone's learning rate as a fraction of --lr
    freeze_epochs: int


@dataclass(frozen=True)
class Plan:
    """--pretrained as planned: the weights (resolved, not yet fetched) and the recipe's options."""

    weights: pretrained.Weights
    backbone_lr: float
    freeze_epochs: int
    fetch: bool                 # a fresh run starts from the weights; a resumed one loads its own state
    load_policy: LoadPolicy = SAFE  # what --trust-pickle allows for the fetched file

    @classmethod
    def of(cls, cfg: Any, fresh: bool) -> Plan | None:
        """The plan for `cfg` (no network), or None without --pretrained. Raises UserError for a request
        that cannot be met (--weights too, a model of your own, weights the model does not have)."""
        if not getattr(cfg, "pretrained", None):
            if getattr(cfg, "freeze_epochs", 0):
                raise UserError("--freeze-epochs trains a pretrained model's head first; add --pretrained")
            return None
        if cfg.weights:
            raise UserError(f"--pretrained and --weights {cfg.weights} both give the starting weights; pass one")
        if cfg.model == "small_cnn":
            raise UserError("--pretrained: small_cnn (dlenv's own CPU model, the demo's recipe without a GPU) has "
                            "no pretrained weights; pass --model resnet18, or another torchvision or timm/ model")
        if ":" in cfg.model or cfg.model.endswith(".py"):
            raise UserError(f"--pretrained is for torchvision and timm models; --model {cfg.model} is your own: "
                            "load its weights with --weights FILE")
        return cls(pretrained.resolve(cfg.model, cfg.pretrained), float(cfg.backbone_lr), int(cfg.freeze_epochs),
                   fresh, LoadPolicy.of(cfg))

    def state(self) -> dict[str, Any] | None:
        """The weights' state dict for a fresh run (from the cache, downloaded there first if needed), else
        None."""
        if not self.fetch:
            return None
        return pretrained.fetched_state_dict(self.weights, pretrained.fetch(self.weights), self.load_policy)

    def prepare(self, model: nn.Module, num_classes: int) -> Recipe:
        return prepare(model, self.weights, num_classes, self.backbone_lr, self.freeze_epochs)

    def notes(self) -> dict[str, Any]:
        """config.yaml's note: the weights, the preprocessing they bring and the recipe."""
        return {**self.weights.record(), "backbone_lr": self.backbone_lr, "freeze_epochs": self.freeze_epochs}


def head_names(model: nn.Module, num_classes: int, classifier: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Parameter names of the model's classifier head: under the module names timm's pretrained config
    gives (`classifier`), else those of the last module whose weight has `num_classes` rows (torchvision
    registers its classifier last: fc, classifier.N, heads.head, squeezenet's final conv)."""
    names = [n for n, _ in model.named_parameters()]
    if classifier:
        head = [n for n in names if any(n.startswith(c + ".") for c in classifier)]
        if head:
            return tuple(head)
    last = None
    for mod_name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter) and w.ndim >= 2 and w.shape[0] == num_classes:
            last = mod_name
    if last is None:
        raise UserError(f"cannot tell the classifier head of {type(model).__name__} (no layer with "
                        f"{num_classes} outputs); fine-tune it with --freeze-epochs 0 --backbone-lr 1")
    return tuple(n for n in names if n.startswith(last + ".") and n.count(".") == last.count(".") + 1)


class _StayEval:
    """Stands in for a BatchNorm layer's `train` while the backbone is frozen: model.train() then leaves
    it in eval mode (running statistics used and kept). A class, so deepcopy (EMA) follows it."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.frozen = False

    def __call__(self, mode: bool = True) -> nn.Module:
        return nn.Module.train(self.module, mode and not self.frozen)


def prepare(model: nn.Module, w: pretrained.Weights, num_classes: int, backbone_lr: float,
            freeze_epochs: int) -> Recipe:
    """Mark `model` for fine-tuning: its head, the backbone's learning-rate factor and the frozen epochs
    (read by `lr_scales`, `set_epoch` and `ddp_find_unused`). Returns the recipe."""
    recipe = Recipe(w.name, head_names(model, num_classes, w.classifier), float(backbone_lr), int(freeze_epochs))
    setattr(model, _ATTR, recipe)
    return recipe


def recipe_of(model: nn.Module) -> Recipe | None:
    return getattr(model, _ATTR, None)


def lr_scales(model: nn.Module) -> dict[str, float] | None:
    """{parameter name: factor of --lr} for a model prepared for fine-tuning, else None (one rate)."""
    recipe = recipe_of(model)
    if recipe is None:
        return None
    head = set(recipe.head)
    return {n: 1.0 if n in head else recipe.backbone_lr for n, _ in model.named_parameters()}


def ddp_find_unused(model: nn.Module) -> bool:
    """Whether DDP must look for unused parameters in `model`: those of a backbone --freeze-epochs keeps
    frozen for a while (DDP's default expects a gradient for every parameter in every step)."""
    recipe = recipe_of(model)
    return bool(recipe and recipe.freeze_epochs)


def set_epoch(model: nn.Module, epoch: int) -> bool:
    """Freeze or unfreeze the backbone for `epoch` (0-based): its parameters' requires_grad, and its
    BatchNorm layers held in eval mode at the epoch's model.train(). Returns whether it is frozen. Does
    nothing for a model not prepared for fine-tuning."""
    recipe = recipe_of(model)
    if recipe is None or not recipe.freeze_epochs:
        return False
    frozen = epoch < recipe.freeze_epochs
    head = set(recipe.head)
    for n, p in model.named_parameters():
        if n not in head:
            p.requires_grad_(not frozen)
    head_modules = {n.rsplit(".", 1)[0] for n in head}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and name not in head_modules:
            stay = m.__dict__.get("train")
            if not isinstance(stay, _StayEval):  # first call, or a layer --sync-bn replaced since
                stay = m.train = _StayEval(m)
            stay.frozen = frozen  # read at the epoch's model.train()
    return frozen
