"""Which --model names exist, answered without importing torch, so that `--model resnet-18` is refused in a
moment with the near name, not after the seconds PyTorch takes to load (32 s on a loaded 2-core machine).

`check_name(name, names)` is the one rule (a name that asks for pretrained weights points at --pretrained;
else the close names, difflib), used by dlenv.model.models with torchvision's own list once torch is loaded,
and by the CLI's early check (`check_early`) with `torchvision_names()`: the names torchvision registers
with `@register_model()` in the files of `torchvision/models/` (not its detection, video, ... subpackages,
as `torchvision.models.list_models(module=torchvision.models)`), read as text from the installed package.
Reading is bounded (regular files, 1 MiB each, 64 files); where it finds too few names to be torchvision's
list, the early check says nothing and the late one answers. No torch here.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
from pathlib import Path

from dlenv.errors import UserError

#: names dlenv itself gives meaning to (dlenv.model.smallcnn.NAME, and train's auto)
OWN_NAMES = ("auto", "small_cnn")
#: the prefix of a timm model's name (dlenv.model.pretrained.TIMM_PREFIX); timm answers for its own names
TIMM_PREFIX = "timm/"
#: fewer names than this is not torchvision's list (0.14 registers 80, 0.29 more): the early check stays silent
_FEWEST = 40
_MAX_FILES, _MAX_BYTES = 64, 1 << 20
_REGISTERED = re.compile(r"@register_model\(")
_DEF = re.compile(r"^def (\w+)\(", re.M)
_PRETRAINED = re.compile(r"[._-]?(pretrained|weights)", re.I)


def check_name(name: str, names: list[str] | tuple[str, ...] | frozenset[str]) -> None:
    """Raise UserError unless `name` is one of `names` (torchvision's classification models): a name that asks
    for pretrained weights (resnet50_pretrained, ResNet50_Weights.DEFAULT) is told --pretrained; another gets
    the close names, or where to list them."""
    if name in names:
        return
    base = _PRETRAINED.split(name)[0].lower()
    if base != name.lower() or "_Weights" in name:
        arch = next((n for n in sorted(names) if n.replace("_", "") == base.replace("_", "")), "resnet50")
        raise UserError(f"--model {name!r} asks for pretrained weights; use --model {arch} --pretrained "
                        "(downloaded once into .cache/, see docs/training.md)")
    close = difflib.get_close_matches(name.lower().replace("-", "_"), sorted(names), n=4, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close else "list the names with: python -c "
            "\"from dlenv.model.models import list_model_names; print(list_model_names())\"")
    raise UserError(f"--model {name!r} is not a torchvision classification model; {hint}")


def check_early(name: object) -> None:
    """`check_name` for a --model value that names a torchvision model, before torch loads; nothing for a model
    of one's own (FILE.py:factory), a timm/ one, dlenv's own names, or where the names cannot be read."""
    if not isinstance(name, str) or ":" in name or name.strip().endswith(".py") or name.startswith(TIMM_PREFIX):
        return
    if name in OWN_NAMES:
        return
    names = torchvision_names()
    if names:
        check_name(name, names)


@functools.lru_cache(maxsize=1)
def torchvision_names() -> frozenset[str]:
    """The classification models the installed torchvision registers, read from its source; empty when it is
    not installed or not laid out as expected."""
    try:
        spec = importlib.util.find_spec("torchvision")  # finds the package without running it
    except (ImportError, ValueError):
        return frozenset()
    places = list(spec.submodule_search_locations or []) if spec else []
    if not places:
        return frozenset()
    names: set[str] = set()
    folder = Path(places[0]) / "models"
    try:
        files = sorted(p for p in folder.glob("*.py") if p.is_file() and not p.is_symlink())[:_MAX_FILES]
    except OSError:
        return frozenset()
    for path in files:
        try:
            if path.stat().st_size > _MAX_BYTES:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for m in _REGISTERED.finditer(text):
            d = _DEF.search(text, m.end())
            if d:
                names.add(d.group(1))
    return frozenset(names) if len(names) >= _FEWEST else frozenset()
