"""Option values from what users type (or a YAML file holds): each parser returns the typed value or
raises ValueError with a short reason, which `dlenv.options.config` turns into one line naming the flag.
--model-args and --pretrained are parsed here too, so that config sits below the modules that give
them meaning (dlenv.model.usermodel, dlenv.model.pretrained).
How an option is declared and checked against its bounds is dlenv.options.declare. No torch here: `dlenv --help`
and `invoke --list` import it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit() and len(v) < 100:
        return int(v)  # exactly: through float, 9223372036854775807 would become ...808
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError("expected an integer") from None
    if not math.isfinite(f) or f != int(f):
        raise ValueError("expected an integer")
    return int(f)


def parse_float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a number")
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("expected a number") from None
    if not math.isfinite(f):  # nan passes every < and > check; inf makes every schedule inf
        raise ValueError("expected a finite number")
    return f


def parse_str(v: Any) -> str:
    if isinstance(v, (list, tuple, dict, set)) or v is None:
        raise ValueError("expected a single value, not a list or mapping")
    s = str(v)
    if "\0" in s:  # no path or name may hold a NUL byte
        raise ValueError("a NUL character is not allowed")
    return s


def folder_name(v: Any) -> str:
    """A plain folder name: not empty, no slashes, not '.' or '..', and nothing that acts on a terminal
    (a newline or ESC in a run name would print as a fake line in every message that names the run)."""
    s = parse_str(v)
    if not s.strip() or s in (".", "..") or "/" in s or "\\" in s:
        raise ValueError("expected a plain folder name (no slashes), e.g. exp")
    # C*: controls (newline, ESC), format characters (bidi overrides), surrogates; Z[lp]: line breaks
    bad = next((c for c in s if unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp")), None)
    if bad is not None:
        raise ValueError(f"a folder name may not hold the control character {ascii(bad)}; use letters, digits, "
                         "- and _, e.g. exp")
    return s


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def _auto_or(v: Any, parse: Any, valid: Any, expected: str) -> Any:
    """'auto', or `parse(v)` when `valid` of it; ValueError(`expected`) for anything else."""
    if _is_auto(v):
        return "auto"
    try:
        x = parse(v)
    except ValueError:
        raise ValueError(expected) from None
    if not valid(x):
        raise ValueError(expected)
    return x


def on_off_auto(v: Any) -> str:
    """'auto', 'on' or 'off'; true/false and the other spellings parse_bool takes mean on/off (a
    config.yaml written when the option was a plain switch still reads)."""
    return _auto_or(v, lambda x: "on" if parse_bool(x) else "off", lambda x: True, "expected auto, on or off")


def open_fraction(v: Any) -> float:
    """A share strictly between 0 and 1 (prune's --amount); a percentage (30) is told its fraction."""
    f = parse_float(v)
    if 0.0 < f < 1.0:
        return f
    if 1.0 < f < 100.0:
        raise ValueError(f"{f:g} is outside (0, 1); as a share, {f:g}% is {f / 100:g}")
    raise ValueError(f"{f:g} is outside (0, 1): a share, e.g. 0.3")


#: what --normalize (and preprocess.yaml's normalize:) may hold: per channel, for images in [0, 1] (ToTensor's)
NORM_MEAN_RANGE, NORM_STD_RANGE = (-1.0, 2.0), (1e-3, 10.0)


def normalize_value(v: Any) -> str:
    """--normalize: 'auto', 'none', 'imagenet', or MEAN,STD as 6 numbers (three means, three stds) or 2 (one of
    each, for every channel), also a YAML list; returned as its canonical text ('0.5,0.5,0.5,0.25,0.25,0.25')."""
    if isinstance(v, str) and v.strip().lower() in ("auto", "none", "imagenet"):
        return v.strip().lower()
    parts = list(v) if isinstance(v, (list, tuple)) else parse_str(v).replace(" ", "").split(",")
    if len(parts) not in (2, 6):
        raise ValueError("expected none, imagenet, or MEAN,STD: three means and three stds (6 numbers, e.g. "
                         "0.5,0.5,0.5,0.25,0.25,0.25) or one of each (0.5,0.25)")
    numbers = [parse_float(p) for p in parts]
    if len(numbers) == 2:
        numbers = [numbers[0]] * 3 + [numbers[1]] * 3
    if any(not NORM_MEAN_RANGE[0] <= m <= NORM_MEAN_RANGE[1] for m in numbers[:3]) or any(
            not NORM_STD_RANGE[0] <= s <= NORM_STD_RANGE[1] for s in numbers[3:]):
        scale = " (the 0-255 scale? divide by 255)" if max(numbers) > 10 else ""
        raise ValueError(f"means must lie in [{NORM_MEAN_RANGE[0]:g}, {NORM_MEAN_RANGE[1]:g}] and stds in "
                         f"[{NORM_STD_RANGE[0]:g}, {NORM_STD_RANGE[1]:g}], for images in [0, 1]{scale}")
    return ",".join(f"{x:g}" for x in numbers)


def normalization(value: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) of a canonical --normalize value: 'none' is (0, 1) per channel; None for 'imagenet' (and
    'auto', decided elsewhere): the loaders' default, ImageNet's."""
    if value in ("auto", "imagenet"):
        return None
    if value == "none":
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    numbers = tuple(float(x) for x in value.split(","))
    return numbers[:3], numbers[3:]


def ratio_or_auto(v: Any) -> float | str:
    """A fraction in [0, 1], or the word 'auto'."""
    return _auto_or(v, parse_float, lambda f: 0.0 <= f <= 1.0, "expected 'auto' or a fraction between 0 and 1")


def batch_or_auto(v: Any) -> int | str:
    """A batch size: an integer >= 1, 'auto' (the fastest per image that fits) or 'max' (the largest that fits)."""
    if isinstance(v, str) and v.strip().lower() == "max":
        return "max"
    return _auto_or(v, parse_int, lambda n: n >= 1, "expected an integer >= 1, 'auto' or 'max'")


def workers_or_auto(v: Any) -> int | str:
    """A count of worker processes: an integer >= 0 (0: the work runs in the main process), or 'auto'."""
    return _auto_or(v, parse_int, lambda n: n >= 0,
                    "expected 'auto' or an integer >= 0 (0: load in the main process)")


def int_list(v: Any) -> tuple[int, ...]:
    """'0,2,4' or [0, 2, 4] -> (0, 2, 4)."""
    if isinstance(v, (list, tuple)):
        return tuple(parse_int(x) for x in v)
    return tuple(parse_int(x) for x in str(v).replace(" ", "").split(",") if x)


def scale_range_or_auto(v: Any) -> tuple[float, float] | str:
    """'auto', or a crop's area range MIN,MAX: fractions with 0 < MIN <= MAX <= 1 (a YAML list works too)."""
    def parse(x: Any) -> tuple[float, float]:
        parts = x if isinstance(x, (list, tuple)) else str(x).split(",")
        lo, hi = (parse_float(p) for p in parts)
        return lo, hi
    return _auto_or(v, parse, lambda r: 0.0 < r[0] <= r[1] <= 1.0,
                    "expected 'auto' or MIN,MAX with 0 < MIN <= MAX <= 1, e.g. 0.35,1")


def auto_int(v: Any) -> int | None:
    """An integer, or 'auto' (None: decided at run time, from the data or the machine)."""
    return None if _is_auto(v) else parse_int(v)


def command_words(v: Any) -> tuple[str, ...]:
    """A command line: a list of words as given (after `--`), or one string split as a shell would."""
    import shlex

    if isinstance(v, (list, tuple)) and all(isinstance(w, str) for w in v):
        return tuple(v)
    if isinstance(v, str):
        try:
            return tuple(shlex.split(v))
        except ValueError as e:
            raise ValueError(f"cannot split it as a shell would ({e})") from None
    raise ValueError("expected a command line")


def auto_float(v: Any) -> float | None:
    """A number, or 'auto' (None: decided at run time)."""
    return None if _is_auto(v) else parse_float(v)


# ---------------------------------------------------------------------------------------------------
# The values of --model-args and --pretrained (their meaning: dlenv.model.usermodel, dlenv.model.pretrained)

_ARG_NAME = re.compile(r"[A-Za-z_]\w*\Z")
#: given by dlenv itself: the data's class count, and --img-size to a factory that takes img_size
RESERVED_MODEL_ARGS = {"num_classes": "it comes from the data", "img_size": "pass --img-size instead"}


def _arg_value(raw: str) -> Any:
    """'32' -> 32, '0.1' -> 0.1, 'true' -> True, 'none' -> None, "'32'" -> '32', 'gelu' -> 'gelu'."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return raw


def parse_model_args(value: Any) -> dict[str, Any]:
    """'width=32,drop=0.1,act=gelu' (or a mapping, from a YAML file) -> {'width': 32, 'drop': 0.1, ...}.

    Values become int, float, bool (true/false), None (none) or str; quotes keep a string ('"32"').
    Raises ValueError naming the bad item.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        items = list(value.items())
        for k, v in items:
            if not isinstance(v, (int, float, str, bool, type(None))):
                raise ValueError(f"{k}: {v!r} is not a number, string, true/false or none")
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            key, eq, raw = part.partition("=")
            if not eq or not raw.strip():
                raise ValueError(f"{part.strip()!r} is not key=value (e.g. width=32,drop=0.1)")
            items.append((key.strip(), _arg_value(raw.strip())))
    out: dict[str, Any] = {}
    for k, v in items:
        if not isinstance(k, str) or not _ARG_NAME.match(k):
            raise ValueError(f"{k!r} is not a keyword argument name")
        if k in RESERVED_MODEL_ARGS:
            raise ValueError(f"{k} is not a model argument: {RESERVED_MODEL_ARGS[k]}")
        if k in out:
            raise ValueError(f"{k} is given twice")
        out[k] = v
    return out


def _arg_text(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "none"}[v]
    if isinstance(v, str):
        if "," in v:
            raise ValueError(f"{v!r}: a value cannot hold a comma")
        return v if _arg_value(v) == v and v.strip() == v else f"'{v}'"
    return repr(v)


def model_args_text(value: Any) -> str:
    """The canonical 'k=v,...' form of --model-args (what config.yaml and run files hold).

    Raises ValueError for a malformed value (dlenv.options.config turns it into a one-line UserError)."""
    return ",".join(f"{k}={_arg_text(v)}" for k, v in parse_model_args(value).items())


_PRETRAINED_OFF = ("off", "none", "false", "no", "0")
_PRETRAINED_DEFAULT = ("default", "true", "on", "yes", "1")


def parse_pretrained(value: Any) -> str | None:
    """--pretrained's value: None (off), 'DEFAULT', or a weights name as typed. Raises ValueError."""
    if value is None or value is False:
        return None
    if value is True:
        return "DEFAULT"
    s = str(value).strip()
    if s.lower() in _PRETRAINED_OFF:
        return None
    if s.lower() in _PRETRAINED_DEFAULT:
        return "DEFAULT"
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", s):
        raise ValueError("a weights name is letters, digits, '_', '.' and '-' (e.g. IMAGENET1K_V2)")
    return s
