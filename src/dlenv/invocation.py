"""How the user started dlenv, so that a message can name the command to type next.

A run stopped by Ctrl-C or `docker stop` says how to resume it. That command must be the one the user
actually ran: `python train.py --resume runs/exp/last.pth` after `python train.py`,
`invoke train --resume ...` after invoke, `dlenv train --resume ...` after dlenv, and after `python -m dlenv`
too: `python -m` puts the working folder first on sys.path, where an unpacked archive's `dlenv/` would be
imported in place of ours, so no hint ever names it (dlenv.__main__). The front doors (the
`dlenv` CLI and the invoke tasks) call `remember` once; the command is kept in the environment
(DLENV_COMMAND), so the torchrun workers that `--gpus N` starts, whose own command line is dlenv's
internal one, name the user's command too. `again` builds the suggestion. No torch here.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ENV = "DLENV_COMMAND"


def describe(verb: str, argv0: str, script_picks_verb: bool = False) -> str:
    """The command that runs `verb` the way `argv0` was started.

    `script_picks_verb`: the script passed its own argument list with the verb in it (a project's
    train.py calls `dlenv.cli.main(["train", *sys.argv[1:]])`), so the user typed no verb.
    """
    path = Path(argv0)
    if path.name in ("invoke", "inv") or (path.name == "__main__.py" and path.parent.name == "invoke"):
        return f"invoke {verb}"
    if path.name == "dlenv":
        return f"dlenv {verb}"
    if path.parent.name == "dlenv" and path.suffix == ".py":  # python -m dlenv, python -m dlenv.cli: the command
        return f"dlenv {verb}"
    script = f"python {shlex.quote(argv0)}"
    return script if script_picks_verb else f"{script} {verb}"


def remember(verb: str, argv0: str | None = None, script_picks_verb: bool = False) -> None:
    """Record how this command was started. A torchrun worker keeps what its launcher recorded."""
    if "LOCAL_RANK" in os.environ and os.environ.get(ENV):
        return
    os.environ[ENV] = describe(verb, argv0 if argv0 is not None else sys.argv[0], script_picks_verb)


def again(verb: str, args: str) -> str:
    """The command line that runs `verb` with `args` as the user started dlenv (`dlenv VERB` when unknown)."""
    return f"{os.environ.get(ENV) or f'dlenv {verb}'} {args}"


def command(verb: str, args: str) -> str:
    """The command line that runs another `verb` through the same front door the user used (invoke or
    dlenv; after a script of the project template, its script for `verb`
    (`python train.py`); `dlenv VERB` after a script of their own, which runs one verb only)."""
    used = os.environ.get(ENV) or ""
    for front in ("invoke", "dlenv"):
        if used.startswith(front + " "):
            return f"{front} {verb} {args}".rstrip()
    script = _seed_script(used, verb)
    return f"{script or f'dlenv {verb}'} {args}".rstrip()


#: the project template's scripts (workspace/): each runs one verb
SEED_SCRIPTS = {"train": "train.py", "val": "val.py", "plot": "plot_results.py", "predict": "predict.py"}


def _seed_script(used: str, verb: str) -> str | None:
    """`python DIR/<verb's seed script>` when `used` ran a script beside which that script lies (a project
    made from workspace/: `python val.py` is told `python train.py`), else None."""
    words = shlex.split(used) if used.startswith("python ") else []
    if len(words) < 2 or not words[1].endswith(".py") or verb not in SEED_SCRIPTS:
        return None
    seed = Path(words[1]).parent / SEED_SCRIPTS[verb]
    return f"python {shlex.quote(str(seed))}" if seed.is_file() else None


#: what `python -m MODULE` does, less the working folder first on sys.path (`-c` puts '' there, and it is
#: taken out): an archive's code unpacked there (a `dlenv/` package, an `argparse.py`) must not stand in for
#: the module dlenv starts in a child process
_RUN_MODULE = ("import sys, runpy\n"
               "if sys.path[:1] == ['']: del sys.path[0]\n"
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def python_module(module: str, python: str | None = None) -> list[str]:
    """The command line that runs `module` as `python -m module` would, without the working folder on
    sys.path; append the module's own arguments."""
    return [python or sys.executable, "-c", _RUN_MODULE, module]
