"""How the images of a trained model are prepared for val and predict: size, normalisation, resize; and where
each of the three came from, said in one line when dlenv did not write the weights.

dlenv's own run file says how its run prepared images (its img_size; its --pretrained weights' mean, std and
resampling, else ImageNet's; the centre crop). Weights from a training script of one's own say nothing: a
`torch.save(model.state_dict(), "best_model.pth")` trained on 48 px images without normalisation would be judged
at 224 px with ImageNet's statistics. So for such a file the choice is said, with its sources, and can be
matched: flags first (--img-size, --normalize, --resize), then `preprocess.yaml` beside the weights (the same
three keys, written by the script that saved them; docs/own-loop.md), then dlenv's defaults. The file is read as
every options file is (dlenv.options.cfgfile.load_yaml: a regular file, 1 MiB at most, no aliases), each value
parsed and bounded by its flag's own declaration; any other key is refused with the list of valid ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlenv.errors import UserError, printable
from dlenv.options import config
from dlenv.options.cfgfile import load_yaml
from dlenv.options.declare import parse_option
from dlenv.options.values import normalization

#: the file beside a weights file that says how its images were prepared
SIDECAR = "preprocess.yaml"
#: its keys: the options of the same names
KEYS = ("img_size", "normalize", "resize")
#: what dlenv assumes where nothing says
DEFAULTS = {"img_size": 224, "normalize": "imagenet", "resize": "crop"}


@dataclass(frozen=True)
class Preprocessing:
    """Size, (mean, std) (None: ImageNet's), resize ('crop' or 'full'), and the line that says where they came
    from ('' where the weights file said all)."""

    img_size: int
    norm: tuple[tuple, tuple] | None
    resize: str
    said: str


def sidecar(weights: Path) -> dict[str, Any]:
    """The values `preprocess.yaml` beside `weights` holds ({} when there is none), each parsed and bounded as
    its flag. Raises UserError naming the file for an unreadable file, an unknown key or a bad value."""
    path = Path(weights).parent / SIDECAR
    if not os.path.lexists(path):
        return {}
    data = load_yaml(path)
    fields = {f.name: f for f in config.options(config.ValConfig) if f.name in KEYS}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise UserError(f"{printable(str(path))}: unknown key {printable(str(key))!r}; it may hold "
                            f"{', '.join(KEYS)} (docs/own-loop.md)")
        try:
            out[name] = parse_option(fields[name], value)
        except UserError as e:
            raise UserError(f"{printable(str(path))}: {str(e).replace('--' + name.replace('_', '-'), name, 1)}"
                            ) from None
    return out


def _shown_norm(value: str) -> str:
    return value if value in ("none", "imagenet") else f"mean,std {value}"


def for_foreign(weights: Path, given: dict[str, Any], what: str) -> Preprocessing:
    """The preprocessing of weights dlenv did not write (`what` they are, for the line): each of KEYS from
    `given` (the flags; None or 'auto': not given), else preprocess.yaml, else DEFAULTS, and the line naming
    each one's source."""
    side = sidecar(weights)
    values, parts, assumed = {}, [], False
    for key in KEYS:
        flag = given.get(key)
        if flag is not None and flag != "auto":
            values[key], source = flag, config.flag(key)
        elif key in side and side[key] != "auto":
            values[key], source = side[key], SIDECAR
        else:
            values[key], source, assumed = DEFAULTS[key], "assumed", True
        shown = {"img_size": f"{values[key]} px", "normalize": f"normalize {_shown_norm(str(values[key]))}",
                 "resize": f"resize {values[key]}"}[key]
        parts.append(f"{shown} ({source})")
    tail = (f": {printable(str(weights))} is {what}, which does not say how its images were prepared; match your "
            f"training script with --img-size, --normalize and --resize, or {SIDECAR} beside it (docs/own-loop.md)"
            if assumed else f" for {printable(str(weights))} ({what})")
    return Preprocessing(int(values["img_size"]), normalization(values["normalize"]), values["resize"],
                         f"preprocessing: {', '.join(parts)}{tail}")


def overridden(own: Preprocessing, given: dict[str, Any]) -> Preprocessing:
    """The preprocessing a file gave (`own`) with --normalize and --resize given (not 'auto') put in its place,
    said in one line when any was."""
    norm, resize, said = own.norm, own.resize, []
    if given.get("normalize") not in (None, "auto"):
        norm = normalization(given["normalize"])
        said.append(f"normalize {_shown_norm(given['normalize'])} (--normalize)")
    if given.get("resize") not in (None, "auto"):
        resize = given["resize"]
        said.append(f"resize {resize} (--resize)")
    line = f"preprocessing: {', '.join(said)}, in place of the weights file's own" if said else own.said
    return Preprocessing(own.img_size, norm, resize, line)
