"""The keyword arguments dlenv passes a torchvision builder besides num_classes: a ViT's image_size.

torchvision's ViTs (vit_b_16, vit_b_32, vit_l_16, vit_l_32, vit_h_14) fix their input size when they are
built (`image_size=`, 224 unless told; a position embedding per patch), so a ViT built at 224 and fed
32 px images stops in its forward with "Wrong image height". dlenv builds them at the image size the run
trains at, which must be a multiple of the patch size; every other torchvision classifier takes any size
and no arguments. `fit_position_embedding` lets pretrained ViT weights start a model of another size.
The rule lives here, not in dlenv.model.models, because dlenv.model.usermodel (which decides every
model's arguments) must not import models (models imports usermodel). No torch at import.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from dlenv.errors import UserError

log = logging.getLogger(__name__)

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
