"""Models by name, and exact activation checkpointing of their repeated blocks.

`build_model("resnet50", num_classes)` gives any torchvision classification model with its head sized
to the data, optionally starting from a local weights file or a pretrained state dict (dlenv.model.pretrained
fetched it; nothing is downloaded here). `build_model("timm/convnext_atto", num_classes, **args)` is
timm's `create_model` with the same head rule; `build_model("models/net.py:build", num_classes)`
builds a model of your own (dlenv.model.usermodel).

`apply_checkpointing(model, ratio)` makes the model's repeated blocks (ResNet bottlenecks, ViT encoder
blocks, ...) recompute their activations in backward instead of storing them. It is exact: gradients,
outputs and BatchNorm running statistics are those of the same model without it, because

- the recompute runs with the RNG state of the forward, so dropout and stochastic depth draw the
  same masks (and the global RNG ends where it would have);
- BatchNorm layers in the recompute update throw-away copies of their buffers, so running statistics
  and num_batches_tracked move once per step, not twice;
- the recompute re-enters the forward's own autocast setting (1.13 would otherwise use fp16);
- the non-reentrant checkpoint is used, which handles in-place ops and parameters-only gradients.

The block's `forward` is replaced on the instance, so module names and state dict keys stay those of
the plain model: checkpoints load into a model without checkpointing and back.
"""

from __future__ import annotations

import difflib
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlenv import compat
from dlenv.errors import UserError, printable
from dlenv.files import runstate
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model import modelsource, pretrained, shrink, smallcnn, tvargs, usermodel

log = logging.getLogger(__name__)

# The repeated blocks of each torchvision family, by module and class name (looked up lazily: a class
# missing from an older torchvision is simply not there). The outermost match is wrapped.
_TORCHVISION_BLOCKS = {
    "resnet": ("BasicBlock", "Bottleneck"),
    "densenet": ("_DenseLayer",),
    "mobilenetv2": ("InvertedResidual",),
    "mobilenetv3": ("InvertedResidual",),
    "efficientnet": ("MBConv", "FusedMBConv"),
    "convnext": ("CNBlock",),
    "regnet": ("ResBottleneckBlock",),
    "vision_transformer": ("EncoderBlock",),
    "swin_transformer": ("SwinTransformerBlock", "SwinTransformerBlockV2"),
    "maxvit": ("MaxVitLayer",),
    "shufflenetv2": ("InvertedResidual",),
    "mnasnet": ("_InvertedResidual",),
    "squeezenet": ("Fire",),
    "googlenet": ("Inception",),
    "inception": ("InceptionA", "InceptionB", "InceptionC", "InceptionD", "InceptionE"),
}

# Families whose auxiliary classifiers are switched off: the trainer expects one logits tensor.
AUX_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}

_ENUM_WEIGHTS = re.compile(r"^(\w+_weights(\.\w+)?|default|imagenet1k\w*|pretrained|imagenet|true)$", re.I)


# ---------------------------------------------------------------------------------------------------
# Models by name


def list_model_names() -> list[str]:
    """The names of torchvision's image classification models (resnet50, vit_b_16, ...), sorted."""
    from torchvision import models as tvm

    # module=torchvision.models lists the classification builders only (not detection, video, ...).
    return sorted(tvm.list_models(module=tvm))


def _check_name(name: str) -> None:
    if pretrained.is_timm(name):
        return  # timm answers for its own names (pretrained.timm_model)
    names = list_model_names()
    if name in names:
        return
    base = re.split(r"[._-]?(pretrained|weights)", name, flags=re.I)[0].lower()
    if base != name.lower() or "_Weights" in name:
        arch = next((n for n in names if n.replace("_", "") == base.replace("_", "")), "resnet50")
        raise UserError(f"--model {name!r} asks for pretrained weights; use --model {arch} --pretrained "
                        "(downloaded once into .cache/, see docs/training.md)")
    close = difflib.get_close_matches(name.lower(), names, n=4, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close else "list the names with: python -c "
            "\"from dlenv.model.models import list_model_names; print(list_model_names())\"")
    raise UserError(f"--model {name!r} is not a torchvision classification model; {hint}")


def build_model(name: str, /, num_classes: int, weights: str | Path | None = None,
                pretrained_state: dict[str, Any] | None = None, *, model_args: dict[str, Any] | None = None,
                load_policy: LoadPolicy = SAFE, **kwargs: Any) -> nn.Module:
    """A classification model with its head sized to `num_classes`; never downloads.

    `name` is a torchvision name, timm/<arch> or a model of your own. `weights` is a local file: a dlenv
    checkpoint (its "model" entry) or a bare state dict; `pretrained_state` a state dict dlenv.model.pretrained
    fetched. A head whose class count differs from `num_classes` is skipped (fine-tuning starts it
    fresh). `kwargs` go to the builder (e.g. image_size=32 for a torchvision ViT, --model-args for timm's
    create_model). `model_args` (--model-args) join them as a mapping: a factory's keyword arguments may
    then have any name, `weights` or `name` too. `load_policy` is what --trust-pickle allows for `weights`
    (dlenv.files.weights.LoadPolicy; SAFE: the allowlist only). GoogLeNet and Inception v3 are built without auxiliary
    classifiers. Raises UserError for an unknown name, a request that would need a download, or weights
    that don't fit.
    """
    from torchvision import models as tvm

    kwargs = {**kwargs, **(model_args or {})}

    if usermodel.is_reference(name):  # a model of your own: FILE.py:factory or package.module:factory
        model = usermodel.build(name, num_classes, **kwargs)
        if weights is not None:
            load_weights(model, weights, name=name, num_classes=num_classes, policy=load_policy)
        return model
    if name == smallcnn.NAME:  # dlenv's own small CNN: the demo's model on a CPU
        model = smallcnn.build(num_classes, **kwargs)
        if weights is not None:
            load_weights(model, weights, name=name, num_classes=num_classes, policy=load_policy)
        return model
    _check_name(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise UserError(f"num_classes {num_classes!r} for {name}: need an integer >= 1")
    if pretrained.is_timm(name):
        model = pretrained.timm_model(name, num_classes, pretrained_state, kwargs)
    else:
        if name in AUX_HEADS:
            kwargs.setdefault("aux_logits", False)
            kwargs.setdefault("init_weights", True)  # the explicit choice silences torchvision's FutureWarning
        if "image_size" in kwargs:  # a ViT's; its builder would stop at an assert for a size it cannot take
            tvargs.check_size(name, int(kwargs["image_size"]))
        # weights=None always: a weights enum would download; the builder's num_classes sizes every head
        # (fc, classifier, squeezenet's final conv, ...) consistently.
        model = tvm.get_model(name, weights=None, num_classes=num_classes, **kwargs)
        if pretrained_state is not None:
            state = tvargs.fit_position_embedding(runstate.strip_prefixes(pretrained_state), model, name)
            _load_state(model, state, name, num_classes, "--pretrained")
    if weights is not None:
        load_weights(model, weights, name=name, num_classes=num_classes, policy=load_policy)
    return model


def _weights_file(weights: Any, name: str) -> Path:
    if isinstance(weights, bool) or (isinstance(weights, str) and not Path(weights).exists()
                                     and _ENUM_WEIGHTS.match(weights.strip())):
        raise UserError(f"--weights {weights!r} names no local file; for {name}'s pretrained weights use "
                        f"--model {name} --pretrained {weights if isinstance(weights, str) else 'DEFAULT'}")
    path = Path(weights)
    if not path.exists():  # a folder or a wrong file: dlenv.files.runstate.load_state says what it is
        raise UserError(f"--weights {str(path)!r} not found; pass the path of a local .pth state dict "
                        "or dlenv checkpoint")
    return path


def _state_dict_of(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    if runstate.is_run_state(obj):
        return dict(obj["model"])
    # Other tools nest the weights under "state_dict" (Lightning, timm) or "model" (torchvision refs).
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and runstate.is_bare_state_dict(obj.get(key)):
            obj = obj[key]
            break
    if not runstate.is_bare_state_dict(obj):
        raise UserError(f"--weights {path} holds no state dict; save one with "
                        "torch.save(model.state_dict(), path)")
    return runstate.strip_prefixes(obj)


def load_weights(model: nn.Module, weights: str | Path, name: str, num_classes: int,
                 policy: LoadPolicy = SAFE) -> None:
    """Load a local weights file into `model` (built as `name` with `num_classes`), under `policy`
    (dlenv.files.weights.LoadPolicy; SAFE: the allowlist only).

    A classifier head of another class count is left at its fresh initialisation, with a one-line
    note; auxiliary heads the model doesn't have are ignored. Raises UserError when anything else
    is missing, unexpected, or of another shape.
    """
    path = _weights_file(weights, name)

    ckpt = runstate.load_state(path, policy)
    _load_state(model, _state_dict_of(ckpt, path), name, num_classes, f"--weights {path}")


def _load_state(model: nn.Module, sd: dict[str, Any], name: str, num_classes: int, what: str) -> None:
    own = model.state_dict()
    aux = AUX_HEADS.get(name, ())
    head, wrong = [], []
    for k, v in sd.items():
        if k in own and own[k].shape != v.shape:
            # The head: same layout, only the class dimension (the first) differs.
            is_head = (v.ndim == own[k].ndim and own[k].shape[0] == num_classes
                       and v.shape[1:] == own[k].shape[1:])
            (head if is_head else wrong).append(k)
    unexpected = [k for k in sd if k not in own and not (aux and k.startswith(aux))]
    missing = [k for k in own if k not in sd]
    if wrong or unexpected or missing:
        some = runstate.shown_keys(wrong + unexpected + missing, 3)
        raise UserError(f"{what} does not fit {name} ({len(missing)} missing, {len(unexpected)} "
                        f"unexpected, {len(wrong)} of another shape, e.g. {some}); pass the --model "
                        "these weights were trained as")
    model.load_state_dict({k: v for k, v in sd.items() if k in own and k not in head}, strict=False)
    if head:
        log.warning("%s: head %s has %d classes, the data has %d; it starts fresh (fine-tuning)",
                    what, runstate.shown_keys(head, 4), sd[head[0]].shape[0], num_classes)


def is_convolutional(model: nn.Module) -> bool:
    """Whether the model does real convolutions (channels_last then pays off).

    A ViT or Swin has one Conv2d whose kernel equals its stride: a patch embedding, which is a linear
    layer over patches. Any other Conv2d (3x3, 1x1 stride 1, depthwise, ...) makes it convolutional.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            patchify = tuple(m.kernel_size) == tuple(m.stride) and max(m.kernel_size) > 1
            if not patchify:
                return True
    return False


def _overlaps(t: torch.Tensor) -> bool:
    """Whether some elements of `t` share storage (a stride of 0, as expand() makes, or overlapping
    strides): a shape that costs no bytes, which no trained weight has. Dimensions in order of stride,
    each must step past everything the smaller ones span."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 0  # the highest offset the dimensions so far reach
    for stride, n in dims:
        if stride <= span:
            return True
        span += stride * (n - 1)
    return False


def _num_classes_from(sd: dict[str, Any], source: str) -> int:
    """The class count of a bare classification state dict: the rows of its last 2-D weight, a number
    read from a file and so bounded as a dlenv checkpoint's num_classes (runstate.MAX_CLASSES), from a
    tensor whose every element is stored. Raises UserError naming the tensor, its shape and the bound."""
    weights = [(k, v) for k, v in sd.items() if k.endswith("weight") and v.ndim == 2]
    if not weights:
        raise UserError(f"{source}: cannot tell the number of classes from this state dict (no linear layer "
                        "found); save a classifier's weights with torch.save(model.state_dict(), path)")
    key, head = weights[-1]
    shape = "x".join(str(n) for n in head.shape)
    rows = int(head.shape[0])
    if not 1 <= rows <= runstate.MAX_CLASSES:
        raise UserError(f"{source}: its head {printable(key)[:80]} ({shape}) gives {rows:,} classes, not a class "
                        f"count of 1 to {runstate.MAX_CLASSES:,}; the file was edited or damaged, use another "
                        "weights file")
    if _overlaps(head):
        raise UserError(f"{source}: its head {printable(key)[:80]} ({shape}) repeats stored numbers (strides "
                        f"{tuple(head.stride())}: zero or overlapping), which no trained weight does; the file was "
                        "edited or damaged, use another weights file")
    return rows


def model_from_state(ckpt: Any, model_name: str | None = None, source: str = "checkpoint"):
    """Rebuild the model from a loaded checkpoint alone.

    Returns (model, class_names, img_size). A dlenv checkpoint carries its architecture, classes and
    image size; a bare state dict from another tool needs `model_name` (class names are then
    "0".."N-1" and img_size None). Raises UserError when the weights don't fit the architecture.
    """
    if runstate.is_run_state(ckpt):
        name = model_name or ckpt["model_name"]
        sd = ckpt["model"]
        num_classes = int(ckpt["num_classes"])
        class_names = list(ckpt["class_names"])
        img_size = ckpt.get("img_size")
    elif runstate.is_bare_state_dict(ckpt):
        if not model_name:
            raise UserError(f"{source} is a bare state dict with no architecture; name it with --model "
                            "(e.g. --model resnet18)")
        name = model_name
        # dlenv builds googlenet / inception_v3 without their auxiliary heads (training-only outputs)
        aux = AUX_HEADS.get(name, ())
        sd = {k: v for k, v in runstate.strip_prefixes(ckpt).items() if not (aux and k.startswith(aux))}
        num_classes = _num_classes_from(sd, source)
        class_names = [str(i) for i in range(num_classes)]
        img_size = None
    else:
        raise UserError(f"{source} is neither a dlenv checkpoint nor a state dict; "
                        "save one with torch.save(model.state_dict(), path)")
    if usermodel.is_reference(name):  # a model of your own: the import rule, then its factory and arguments
        model = modelsource.rebuild(ckpt.get("model_source") if runstate.is_run_state(ckpt) else None, name,
                                  num_classes, given=model_name, what=source)
    elif pretrained.is_timm(name) and runstate.is_run_state(ckpt):
        model = build_model(name, num_classes, model_args=_timm_args(ckpt, name, img_size, source))
    else:  # a torchvision ViT is built at the size it was trained at (a bare state dict: 224)
        size = img_size if isinstance(img_size, int) and not isinstance(img_size, bool) else None
        model = build_model(name, num_classes, **tvargs.builder_args(name, {}, size))
    if runstate.is_run_state(ckpt):  # channel-pruned (prune --structured): its layers at their widths
        shrink.apply_widths(model, ckpt.get("widths"), source)
    runstate.load_model_state(model, sd, source, name=name,
                              num_classes=num_classes if runstate.is_run_state(ckpt) else None)
    if runstate.is_run_state(ckpt) and isinstance(ckpt.get("config"), dict):  # trained with --channels 1
        from dlenv.model import grayscale

        grayscale.apply(model, ckpt["config"].get("channels"))
    return model, class_names, img_size


def _timm_args(ckpt: dict[str, Any], name: str, img_size: Any, source: str) -> dict[str, Any]:
    """create_model's arguments a timm run recorded (--model-args, img_size for a fixed-size architecture),
    read from the file and so bounded like any factory's (dlenv.model.modelsource.read_source)."""
    config = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    try:
        args = usermodel.factory_kwargs(name, config.get("model_args"),
                                        img_size if isinstance(img_size, int) and not isinstance(img_size, bool)
                                        else None)
    except (ValueError, TypeError) as e:
        raise UserError(f"{source}: its model_args cannot be read ({e}); pass --model again") from None
    return modelsource.read_source({"ref": name, "args": args}, source)[2]


# ---------------------------------------------------------------------------------------------------
# Activation checkpointing


def _block_classes() -> tuple[type, ...]:
    import importlib

    found = []
    for module, names in _TORCHVISION_BLOCKS.items():
        try:
            mod = importlib.import_module(f"torchvision.models.{module}")
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(found)


def _outermost(model: nn.Module, match) -> list[nn.Module]:
    """Modules for which match(module) holds, in registration (= forward) order, not nested in one another."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if match(child):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    """For models we don't know: modules with parameters of a class of their own (not torch.nn's)
    that occurs at least twice in the model, whether in a Sequential, a ModuleList or as attributes."""
    from collections import Counter

    counts = Counter(type(m) for m in model.modules() if m is not model)

    def match(m: nn.Module) -> bool:
        return (counts[type(m)] >= 2 and not type(m).__module__.startswith("torch.nn")
                and any(True for _ in m.parameters()))

    return _outermost(model, match)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in forward order: those its `checkpoint_blocks` attribute names,
    else torchvision's known block classes, else modules of one class of the model's own repeated
    anywhere in it. [] if none."""
    own = usermodel.declared_blocks(model)
    if own is not None:
        return own
    known = _block_classes()
    blocks = _outermost(model, lambda m: isinstance(m, known))
    return blocks or _repeated_children(model)


def _is_norm_with_stats(m: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _NormBase

    return isinstance(m, _NormBase) and m.training and m.track_running_stats


def _flatten(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], Any]:
    """Tensors of args/kwargs (also inside lists, as DenseNet passes them) as one flat list, plus a
    function that rebuilds (args, kwargs) from such a list. Checkpoint finds the devices whose RNG
    it must preserve from its flat tensor arguments."""
    flat: list[torch.Tensor] = []

    def take(v: Any) -> Any:
        if torch.is_tensor(v):
            flat.append(v)
            return ("t", len(flat) - 1)
        if type(v) in (list, tuple) and any(torch.is_tensor(x) for x in v):
            return ("seq", type(v), [take(x) for x in v])
        return ("v", v)

    spec_args = [take(a) for a in args]
    spec_kwargs = {k: take(v) for k, v in kwargs.items()}

    def put(spec: Any, values: tuple) -> Any:
        if spec[0] == "t":
            return values[spec[1]]
        if spec[0] == "seq":
            return spec[1](put(s, values) for s in spec[2])
        return spec[1]

    def rebuild(values: tuple) -> tuple[list, dict]:
        return [put(s, values) for s in spec_args], {k: put(s, values) for k, s in spec_kwargs.items()}

    return flat, rebuild


class _CheckpointedForward:
    """Stands in for a block's forward (as an instance attribute, so names and state dict stay).

    A plain class rather than a closure so that copy.deepcopy (EMA) and pickle follow it to the copy.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward = module.forward  # the class's forward, bound to this module
        # Whether the block writes into its inputs (e.g. a leading ReLU(inplace=True)): then the saved
        # inputs would no longer hold what the recompute needs, so it gets copies. Unknown (None) until
        # the first checkpointed call, which always copies and looks.
        self.writes_inputs: bool | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # eval / no_grad / inference_mode: nothing to store anyway
            return self.forward(*args, **kwargs)
        if compat.is_compiling():
            # torch.compile traces the block once into its graph and recomputes it in the compiled
            # backward, not by running Python again: the bookkeeping below is not needed there, and
            # its side effects would make dynamo give up on the whole model and run it eagerly.
            return compat.checkpoint(self.forward, *args, **kwargs)
        flat, rebuild = _flatten(args, kwargs)
        amp = compat.autocast_state()
        norms = [m for m in self.module.modules() if _is_norm_with_stats(m)]
        calls = 0

        def run(*values: torch.Tensor) -> Any:
            nonlocal calls
            calls += 1
            if self.writes_inputs is not False:
                values = tuple(v.clone() for v in values)
            versions = [v._version for v in values]
            a, kw = rebuild(values)
            if calls == 1:  # the real forward
                out = self.forward(*a, **kw)
                if self.writes_inputs is None:
                    self.writes_inputs = any(v._version != n for v, n in zip(values, versions, strict=True))
                return out
            # The recompute in backward: the forward's autocast, and BatchNorm buffers swapped for
            # copies so running statistics are not updated a second time. `finally` also runs when
            # torch stops the recompute early once it has what backward needs.
            real = [(m, n, b) for m in norms for n, b in m.named_buffers(recurse=False) if b is not None]
            for m, n, b in real:
                setattr(m, n, b.clone())
            try:
                with compat.autocast_like(amp):
                    return self.forward(*a, **kw)
            finally:
                for m, n, b in real:
                    setattr(m, n, b)

        return compat.checkpoint(run, *flat)


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _wrap(module: nn.Module) -> None:
    if not is_checkpointed(module):
        module.forward = _CheckpointedForward(module)


def _unwrap(module: nn.Module) -> None:
    if is_checkpointed(module):
        del module.forward


def apply_checkpointing(model: nn.Module, ratio: float = 1.0) -> int:
    """Checkpoint the first round(ratio * n) of the model's n repeated blocks; returns how many.

    The first blocks are chosen because in a CNN they see the largest feature maps and so hold the
    most activation memory per unit of recompute; in a transformer all blocks are alike. Calling it
    again sets the new ratio (never wraps twice); ratio 0 removes checkpointing. Returns 0 when the
    model has no repeated blocks (AlexNet, VGG). Raises ValueError for a ratio outside [0, 1].
    """
    if not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"checkpoint ratio {ratio!r} must be between 0 and 1")
    blocks = find_blocks(model)
    k = int(round(float(ratio) * len(blocks)))
    for i, block in enumerate(blocks):
        (_wrap if i < k else _unwrap)(block)
    return k
