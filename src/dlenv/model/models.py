"""Models by name: torchvision's, timm's and your own, built with their head sized to the data.

`build_model("resnet50", num_classes)` gives any torchvision classification model with its head sized
to the data, optionally starting from a local weights file or a pretrained state dict (dlenv.model.pretrained
fetched it; nothing is downloaded here). `build_model("timm/convnext_atto", num_classes, **args)` is
timm's `create_model` with the same head rule; `build_model("models/net.py:build", num_classes)`
builds a model of your own (dlenv.model.usermodel). `model_from_state` rebuilds one from a run file or a
bare state dict alone. `factory_kwargs` decides every model's builder arguments besides the class count:
--model-args, and the image size where the architecture is built for one. torchvision's ViTs (vit_b_16, ...)
fix their input size when they are built (`image_size=`, 224 unless told; a position embedding per patch),
so a ViT built at 224 and fed 32 px images would stop in its forward with "Wrong image height": dlenv builds
them at the size the run trains at, a multiple of the patch size (`builder_args`), and
`fit_position_embedding` lets pretrained ViT weights start a model of another size. Putting a state dict
into a model is dlenv.model.statedict's; activation checkpointing is dlenv.model.checkpointing's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from torch import nn

from dlenv.errors import UserError
from dlenv.files import runstate
from dlenv.files.runstate import is_bare_state_dict, is_run_state
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model import grayscale, modelnames, modelsource, pretrained, shrink, smallcnn, statedict, usermodel
from dlenv.options.values import parse_model_args  # the --model-args value, as dlenv.options.config parses it

# Families whose auxiliary classifiers are switched off: the trainer expects one logits tensor.
AUX_HEADS = {"googlenet": ("aux1.", "aux2."), "inception_v3": ("AuxLogits.",)}

_ENUM_WEIGHTS = re.compile(r"^(\w+_weights(\.\w+)?|default|imagenet1k\w*|pretrained|imagenet|true)$", re.I)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# Models by name


def list_model_names() -> list[str]:
    """The names of torchvision's image classification models (resnet50, vit_b_16, ...), sorted."""
    from torchvision import models as tvm

    # module=torchvision.models lists the classification builders only (not detection, video, ...).
    return sorted(tvm.list_models(module=tvm))


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
    kwargs = {**kwargs, **(model_args or {})}
    if usermodel.is_reference(name):  # a model of your own: FILE.py:factory or package.module:factory
        model = usermodel.build(name, num_classes, **kwargs)
    else:  # timm loads its pretrained state as it builds; a torchvision model's is put in after
        timm = pretrained.is_timm(name)
        model = architecture(name, num_classes, kwargs, pretrained_state if timm else None)
        if pretrained_state is not None and not timm:
            state = fit_position_embedding(statedict.strip_prefixes(pretrained_state), model, name)
            statedict.load_lenient(model, state, name, num_classes, "--pretrained", AUX_HEADS.get(name, ()))
    if weights is not None:
        load_weights(model, weights, name=name, num_classes=num_classes, policy=load_policy)
    return model


def architecture(name: str, num_classes: int, args: dict[str, Any],
                 timm_state: dict[str, Any] | None = None) -> nn.Module:
    """dlenv's small CNN, a timm/<arch> or a torchvision model `name`, with fresh weights, its head sized to
    `num_classes`, built with the builder's keyword arguments `args` (a ViT's image_size, timm's
    --model-args); `timm_state` a timm model's pretrained state, which timm puts in as it builds. Never
    downloads. A model of your own is dlenv.model.usermodel's (`build_model`, `modelsource.rebuild`).
    Raises UserError for an unknown name, a class count below 1 or a size the builder cannot take."""
    if name == smallcnn.NAME:  # dlenv's own small CNN: the demo's model on a CPU
        return smallcnn.SmallCNN(num_classes, **args)  # args: its width
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise UserError(f"num_classes {num_classes!r} for {name}: need an integer >= 1")
    if "image_size" in args:  # a torchvision ViT's; its builder would stop at an assert for a size it cannot take
        check_size(name, int(args["image_size"]))
    if pretrained.is_timm(name):  # timm answers for its own names
        return pretrained.timm_model(name, num_classes, timm_state, args)
    from torchvision import models as tvm

    modelnames.check_name(name, list_model_names())  # the CLI asked the same before torch loaded
    if name in AUX_HEADS:
        args = {"aux_logits": False, "init_weights": True, **args}  # init_weights silences a FutureWarning
    # weights=None always: a weights enum would download; the builder's num_classes sizes every head
    # (fc, classifier, squeezenet's final conv, ...) consistently.
    return tvm.get_model(name, weights=None, num_classes=num_classes, **args)


def factory_kwargs(name: str, model_args: Any, img_size: int | None) -> dict[str, Any]:
    """The keyword arguments the model `name` is built with besides the class count, for a run at `img_size`:
    --model-args (`model_args`, as given or a mapping), plus img_size where a factory of your own takes one
    (dlenv.model.usermodel.factory_args) or timm's architecture is built for one (a ViT's); for a
    torchvision name `builder_args`' rule (UserError for --model-args other than image_size)."""
    args = parse_model_args(model_args)
    if pretrained.is_timm(name):
        return pretrained.timm_args(name, args, img_size)
    if usermodel.is_reference(name):
        return usermodel.factory_args(name, args, img_size)
    return builder_args(name, args, img_size)


#: the image size a torchvision ViT builder uses when none is passed
BUILDER_SIZE = 224
#: torchvision's ViT builders: vit_<size>_<patch>
_VIT = re.compile(r"^vit_[a-z]_(\d+)$")


def patch_size(name: str) -> int | None:
    """The patch size of a torchvision ViT name (vit_b_16 -> 16); None for any other name."""
    m = _VIT.match(name)
    return int(m.group(1)) if m else None


def check_size(name: str, size: int) -> None:
    """UserError in one line when `name` is a torchvision ViT and `size` is no multiple of its patch size."""
    patch = patch_size(name)
    if patch is None or size % patch == 0:
        return
    below, above = size // patch * patch, (size // patch + 1) * patch
    near = f"{below} or {above}" if below >= patch else f"{above}"
    raise UserError(f"--img-size {size}: {name} cuts images into {patch}x{patch} patches, so it takes sizes that "
                    f"are multiples of {patch} (here {near}; 224 as pretrained); pass --img-size {near.split()[0]}")


def builder_args(name: str, model_args: dict[str, Any], img_size: int | None) -> dict[str, Any]:
    """The builder's keyword arguments for torchvision name `name` trained at `img_size` (None: the builder's
    own default): {"image_size": img_size} for a ViT at another size than BUILDER_SIZE, else {}.
    `model_args` (--model-args) may only repeat that image_size. Raises UserError (one line) for other
    --model-args, an image_size that differs from the size the images are resized to, or a size the ViT
    cannot take."""
    patch = patch_size(name)
    if patch is None:
        if model_args:
            raise UserError(f"--model-args is for models of your own (--model FILE.py:factory) and timm's "
                            f"(--model timm/ARCH); {name} takes none")
        return {}
    other = sorted(set(model_args) - {"image_size"})
    if other:
        raise UserError(f"--model-args {', '.join(other)}: {name} takes only image_size here (dlenv sets "
                        "num_classes; the rest of the architecture is the name's)")
    asked = model_args.get("image_size")
    if asked is not None and asked != img_size:
        size = f"--img-size {img_size}" if img_size is not None else "the default size"
        raise UserError(f"--model-args image_size={asked}: the images are resized to {size}, and {name} must be "
                        f"built at the size it is fed; pass --img-size {asked} instead (it sets both)")
    if img_size is None or int(img_size) == BUILDER_SIZE:
        return {}  # the builder's own size: nothing to pass (and nothing new in what a run records)
    check_size(name, int(img_size))
    return {"image_size": int(img_size)}


def fit_position_embedding(sd: dict[str, Any], model: Any, name: str) -> dict[str, Any]:
    """A torchvision ViT's pretrained state with its position embedding resized (bicubic, torchvision's own
    interpolate_embeddings) to the patch grid of `model`, built at another image size; `sd` as it is for
    any other model or when the sizes agree. The class token's embedding is kept as trained."""
    patch, key = patch_size(name), "encoder.pos_embedding"
    own = model.state_dict().get(key)
    if patch is None or own is None or key not in sd or sd[key].shape == own.shape:
        return sd
    from collections import OrderedDict

    from torchvision.models.vision_transformer import interpolate_embeddings

    size = int(model.image_size)
    before = int(round((sd[key].shape[1] - 1) ** 0.5))
    log.warning("--pretrained: %s's position embedding resized from %dx%d to %dx%d patches for %d px images "
                "(bicubic; fine-tuning adapts it)", name, before, before, size // patch, size // patch, size)
    return dict(interpolate_embeddings(size, patch, OrderedDict(sd)))


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
    else:  # the builder's arguments as the file records them
        size = img_size if isinstance(img_size, int) and not isinstance(img_size, bool) else None
        if pretrained.is_timm(name) and is_run_state(run_file):  # timm's: --model-args, a fixed-size one's img_size
            config = run_file.get("config") if isinstance(run_file.get("config"), dict) else {}
            try:  # read from a file, so bounded like any factory's (dlenv.model.modelsource.read_source)
                args = pretrained.timm_args(name, parse_model_args(config.get("model_args")), size)
            except (ValueError, TypeError) as e:
                raise UserError(f"{source}: its model_args cannot be read ({e}); pass --model again") from None
            args = modelsource.read_source({"ref": name, "args": args}, source)[2]
        else:  # a torchvision ViT's size (a bare state dict's: the builder's own, 224)
            args = builder_args(name, {}, size)
        model = architecture(name, num_classes, args)
    if is_run_state(run_file):  # channel-pruned (prune --structured): its layers at their widths
        shrink.apply_widths(model, run_file.get("widths"), source)
    statedict.load_strict(model, sd, source, name=name,
                          num_classes=num_classes if is_run_state(run_file) else None)
    if is_run_state(run_file) and isinstance(run_file.get("config"), dict):  # trained with --channels 1
        grayscale.apply(model, run_file["config"].get("channels"))
    return model, class_names, img_size
