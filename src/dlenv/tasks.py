"""The invoke tasks, generated from `dlenv.options.config` so each flag is declared once.

`tasks.py` at the project root only does `from dlenv.tasks import ns`. In the image, /etc/invoke.yaml
(docker/etc/invoke.yaml here) sets invoke's search root to /opt/dlenv, so `invoke VERB` reaches these
tasks from any folder, whatever is mounted there and whatever tasks.py or tasks/ a project has; the
project's own tasks run with `invoke -r . TASK`. Every task is one call into
`dlenv.cli.run_command`; `invoke --list` imports this module and `dlenv.options.config`, never torch.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from invoke import Argument, Collection, Task, task
from invoke.exceptions import Exit, ParseError
from invoke.parser.parser import ParseMachine

from dlenv import invocation
from dlenv.cli import FULL_HELP, flags_of, run_command, run_tests, usage_text
from dlenv.errors import EXIT_INPUT, printable
from dlenv.options import config, typos


class NotGiven:
    """A switch the user did not type: its place in a task's signature (invoke reads the switch's kind and
    default from `default`) and its value when the command line leaves it out, so the task tells
    `--channels-last` typed (True, which must beat `channels_last: false` in a --cfg file) from nothing."""

    def __init__(self, default: bool):
        self.default = default

    def __repr__(self) -> str:
        return f"NotGiven({self.default})"


class _Switch(Argument):
    """An invoke switch whose value is NotGiven until the command line sets it (True, or False by --no-X)."""

    @property
    def value(self) -> Any:
        return self._value if self._value is not None else NotGiven(self.default)

    @value.setter
    def value(self, arg: Any) -> None:
        self.set_value(arg, cast=True)


class _OptionsTask(Task):
    """A task whose switches say whether they were typed (invoke's own give their default either way)."""

    def arg_opts(self, name: str, default: Any, taken_names: set[str]) -> dict[str, Any]:
        return super().arg_opts(name, default.default if isinstance(default, NotGiven) else default, taken_names)

    def get_arguments(self, *args: Any, **kwargs: Any) -> list[Argument]:
        arguments = super().get_arguments(*args, **kwargs)
        for a in arguments:
            if a.kind is bool:
                a.__class__ = _Switch  # the same fields; only `value` tells typed from not
        return arguments


def _make_task(cmd: config.Command) -> Task:
    fields = config.options(cmd.config)
    bare = {f.name: f.metadata["bare"] for f in fields if f.metadata.get("bare")}

    def body(c, **kwargs):
        yaml_file = kwargs.pop("cfg", None)
        # keep only what the user typed (None: a value option left out; NotGiven: a switch left out), so
        # a YAML file's values are overridden by flags, never by defaults
        given = {k: v for k, v in kwargs.items() if v is not None and not isinstance(v, NotGiven)}
        # an optional-value flag given alone (`invoke train --compile`) arrives as True
        given.update({k: bare[k] for k, v in given.items() if k in bare and v is True})
        invocation.remember(cmd.name, "invoke")  # "Resume with: invoke train --resume ..."
        code = run_command(cmd.name, given, yaml_file)
        if code:
            raise Exit(code=code)

    params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    helps, positional = {}, []
    for f in fields:
        is_bool = f.default is True or f.default is False
        # Value options default to None here so invoke treats them as strings and we can tell "given" from
        # "default" (the real default is in the help text); switches default to NotGiven for the same reason.
        params.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=NotGiven(f.default) if is_bool else None))
        shown = "" if is_bool or f.default is None else f" (default: {f.default})"
        helps[f.name] = f.metadata["help"] + shown
        if f.metadata["positional"]:
            positional.append(f.name)
    params.append(inspect.Parameter("cfg", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None))
    helps["cfg"] = "YAML file of options (flags given override it)"
    body.__signature__ = inspect.Signature(params)
    body.__name__ = cmd.name.replace("-", "_")
    body.__doc__ = cmd.help
    return _OptionsTask(body, name=cmd.name, help=helps, positional=positional, optional=list(bare),
                        auto_shortflags=False)


@task(help={"gpu": "only the GPU tests", "full": FULL_HELP, "args": "extra pytest arguments, quoted"},
      auto_shortflags=False)
def test(c, gpu=False, full=False, args=""):
    """Run the quick tests with a progress line and an ETA (--full: every test, as CI does)."""
    code = run_tests(gpu, args.split(), full)  # the same as `dlenv test`
    if code:
        raise Exit(code=code)


ns = Collection(test, *(_make_task(c) for c in config.COMMANDS.values()))


class _Typo(ParseError, Exit):
    """A word invoke's parser does not know in a dlenv task's line, with the closest flag or verb: printed
    once (as a ParseError; no Exit message) and exit 2, as `dlenv VERB` (an Exit's code)."""

    def __init__(self, msg: str, context: Any):
        ParseError.__init__(self, msg, context)
        Exit.__init__(self, None, EXIT_INPUT)

    def __str__(self) -> str:
        return str(self.args[0])


_UNKNOWN = re.compile(r"No idea what '(.*)' is!\Z", re.S)


def _suggesting(error: Any) -> Any:
    """invoke's ParseMachine.error, answering `invoke train --epoch 1` and `invoke trian` as `dlenv` does: the
    closest flag or verb (dlenv.options.typos) and the usage of the command as typed. invoke has no hook for
    its parser's message; any other error is its own."""
    def wrapped(self: ParseMachine, msg: str) -> None:
        unknown = _UNKNOWN.match(str(msg))
        name = getattr(self.context, "name", None)
        if unknown and name in ns.task_names and unknown.group(1).startswith("-"):
            token = unknown.group(1)
            line = f"unrecognized arguments: {token}{typos.flag_hint(name, token, flags_of(name))}"
            raise _Typo(usage_text(name, line, f"invoke {name}"), self.context)
        if unknown and not name and not unknown.group(1).startswith("-"):
            near = typos.word_hint(unknown.group(1), ns.task_names)
            raise _Typo(f"invoke: error: {printable(unknown.group(1))!r} is not a verb{near}\nusage: invoke VERB "
                        "[options]; invoke --list lists the verbs", self.context)
        error(self, msg)

    wrapped.dlenv_typos = True
    return wrapped


if not getattr(ParseMachine.error, "dlenv_typos", False):
    ParseMachine.error = _suggesting(ParseMachine.error)
