"""Did you mean: the flag, verb or choice closest to a word that is none of them, for the one line a typo gets
(`--epoch 1`: did you mean --epochs?; `dlenv trian`: did you mean train?; `--format onx`: did you mean onnx?).

Close is difflib's (the ratio of matching characters, at least 0.6), after the spellings a user of another tool
brings are made dlenv's (`--batch_size` is `--batch-size`); a few flags of other tools' scripts, too far from
dlenv's word for difflib, are named in `FOREIGN`. The CLI (dlenv.cli), the invoke tasks (dlenv.tasks) and the
choice check (dlenv.options.declare) ask here. No torch here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: flags other tools' scripts take (YOLO's, the PyTorch examples'), and dlenv's for the same thing
FOREIGN = {"--imgsz": "--img-size", "--img": "--img-size", "--image-size": "--img-size", "--lr0": "--lr",
           "--bs": "--batch-size", "--batch": "--batch-size", "--j": "--workers", "--nepochs": "--epochs",
           "--checkpoint-dir": "--project", "--save-dir": "--project", "--arch": "--model", "--a": "--model",
           "--evaluate": "--weights", "--data-dir": "--data", "--dataset": "--data"}
#: a flag a command does not have, and what it does instead (`prune --method l1`: L1 is what prune does)
INSTEAD = {("prune", "--method"): "prune ranks weights by their L1 magnitude (the only method): single weights "
                                  "by default, whole channels with --structured; --amount is the share removed"}
CUTOFF = 0.6


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to `word` (difflib, at least CUTOFF alike), or None."""
    names = sorted(set(candidates))
    if word in names:
        return word
    match = difflib.get_close_matches(word, names, n=1, cutoff=CUTOFF)
    if not match and word.lower() != word:
        match = difflib.get_close_matches(word.lower(), names, n=1, cutoff=CUTOFF)
    return match[0] if match else None


def likeness(a: str, b: str) -> float:
    """How alike two words are (difflib's ratio, 0 to 1), to choose between near names of two kinds."""
    return difflib.SequenceMatcher(None, a, b).ratio()


def flag_hint(command: str, token: str, flags: Iterable[str]) -> str:
    """What to say of `token`, a flag `command` does not have: '; did you mean --epochs?', what the command
    does instead (INSTEAD), or '' when nothing is near."""
    given = token.split("=", 1)[0]
    if (command, given) in INSTEAD:
        return f"; {INSTEAD[command, given]}"
    flags = sorted(set(flags))
    spelled = "--" + given.lstrip("-").replace("_", "-").lower() if given.startswith("-") else given
    for word in (spelled, FOREIGN.get(spelled)):
        if word and word in flags:
            return f"; did you mean {word}?"
    near = closest(spelled, [f for f in flags if f.startswith("--")])
    return f"; did you mean {near}?" if near else ""


def word_hint(word: str, candidates: Iterable[str]) -> str:
    """'; did you mean X?' for a verb or a choice value, or '' when nothing is near."""
    near = closest(str(word).strip(), candidates)
    return f"; did you mean {near}?" if near and near != word else ""
