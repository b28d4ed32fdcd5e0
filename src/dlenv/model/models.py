"""Models by name: torchvision's, timm's and your own, built with their head sized to the data.

`build_model("resnet50", num_classes)` gives any torchvision classification model with its head sized
to the data, optionally starting from a local weights file or a pretrained state dict (dlenv.model.pretrained
fetched it; nothing is downloaded here). `build_model("timm/convnext_atto", num_classes, **args)` is
timm's `create_model` with the same head rule; `build_model("models/net.py:build", num_classes)`
builds a model of your own (dlenv.model.usermodel). `model_from_state` rebuilds one from a run file or a
bare state dict alone. Putting a state dict into a model is dlenv.model.statedict's; activation
checkpointing is dlenv.model.checkpointing's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import nn

from dlenv.errors import UserError
from dlenv.files import runstate
from dlenv.files.runstate import is_bare_state_dict, is_run_state
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model import grayscale, modelnames, modelsource, pretrained, shrink, smallcnn, statedict, tvargs, usermodel

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
    modelnames.check_name(name, list_model_names())  # the CLI asked the same before torch loaded


def build_model(name: str, /, num_classes: int, weights: str | Path | None = None,
                pretrained_state: dict[str, Any] | None = None, *, model_args: dict[str, Any] | None = None,
                load_policy: LoadPolicy = SAFE, **kwargs: Any) -> nn.Module:
    """A classification model with its head sized to `num_classes`; never downloads.

    `name` is a torchvision name, timm/<arch> or a model of your own. `weights` is a local file: a dlenv
    run file (its "model" entry) or a bare state dict; `pretrained_state` a state dict dlenv.model.pretrained
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
            state = tvargs.fit_position_embedding(statedict.strip_prefixes(pretrained_state), model, name)
            statedict.load_lenient(model, state, name, num_classes, "--pretrained", AUX_HEADS.get(name, ()))
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
                        "or dlenv run file")
    return path


def load_weights(model: nn.Module, weights: str | Path, name: str, num_classes: int,
                 policy: LoadPolicy = SAFE) -> None:
    """Load a local weights file into `model` (built as `name` with `num_classes`), under `policy`
    (dlenv.files.weights.LoadPolicy; SAFE: the allowlist only).

    A classifier head of another class count is left at its fresh initialisation, with a one-line
    note; auxiliary heads the model doesn't have are ignored. Raises UserError when anything else
    is missing, unexpected, or of another shape.
    """
    path = _weights_file(weights, name)

    run_file = runstate.load_state(path, policy)
    statedict.load_lenient(model, statedict.state_dict_of(run_file, path), name, num_classes, f"--weights {path}",
                           AUX_HEADS.get(name, ()))


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


def model_from_state(run_file: Any, model_name: str | None = None, source: str = "the file"):
    """Rebuild the model from a loaded run file alone.

    Returns (model, class_names, img_size). A dlenv run file carries its architecture, classes and
    image size; a bare state dict from another tool needs `model_name` (class names are then
    "0".."N-1" and img_size None). Raises UserError when the weights don't fit the architecture.
    """
    if is_run_state(run_file):
        name = model_name or run_file["model_name"]
        sd = run_file["model"]
        num_classes = int(run_file["num_classes"])
        class_names = list(run_file["class_names"])
        img_size = run_file.get("img_size")
    elif is_bare_state_dict(run_file):
        if not model_name:
            raise UserError(f"{source} is a bare state dict with no architecture; name it with --model "
                            "(e.g. --model resnet18)")
        name = model_name
        # dlenv builds googlenet / inception_v3 without their auxiliary heads (training-only outputs)
        aux = AUX_HEADS.get(name, ())
        sd = {k: v for k, v in statedict.strip_prefixes(run_file).items() if not (aux and k.startswith(aux))}
        num_classes = statedict.num_classes_from(sd, source)
        class_names = [str(i) for i in range(num_classes)]
        img_size = None
    else:
        raise UserError(f"{source} is neither a dlenv run file nor a state dict; "
                        "save one with torch.save(model.state_dict(), path)")
    if usermodel.is_reference(name):  # a model of your own: the import rule, then its factory and arguments
        model = modelsource.rebuild(run_file.get("model_source") if is_run_state(run_file) else None, name,
                                  num_classes, given=model_name, what=source)
    elif pretrained.is_timm(name) and is_run_state(run_file):
        model = build_model(name, num_classes, model_args=_timm_args(run_file, name, img_size, source))
    else:  # a torchvision ViT is built at the size it was trained at (a bare state dict: 224)
        size = img_size if isinstance(img_size, int) and not isinstance(img_size, bool) else None
        model = build_model(name, num_classes, **tvargs.builder_args(name, {}, size))
    if is_run_state(run_file):  # channel-pruned (prune --structured): its layers at their widths
        shrink.apply_widths(model, run_file.get("widths"), source)
    statedict.load_strict(model, sd, source, name=name,
                          num_classes=num_classes if is_run_state(run_file) else None)
    if is_run_state(run_file) and isinstance(run_file.get("config"), dict):  # trained with --channels 1

        grayscale.apply(model, run_file["config"].get("channels"))
    return model, class_names, img_size


def _timm_args(run_file: dict[str, Any], name: str, img_size: Any, source: str) -> dict[str, Any]:
    """create_model's arguments a timm run recorded (--model-args, img_size for a fixed-size architecture),
    read from the file and so bounded like any factory's (dlenv.model.modelsource.read_source)."""
    config = run_file.get("config") if isinstance(run_file.get("config"), dict) else {}
    try:
        args = usermodel.factory_kwargs(name, config.get("model_args"),
                                        img_size if isinstance(img_size, int) and not isinstance(img_size, bool)
                                        else None)
    except (ValueError, TypeError) as e:
        raise UserError(f"{source}: its model_args cannot be read ({e}); pass --model again") from None
    return modelsource.read_source({"ref": name, "args": args}, source)[2]
