"""`dlenv VERB [options]` (and `python -m dlenv VERB [options]`, through dlenv.__main__).

Parses flags generated from `dlenv.options.config`, builds the frozen config, imports the one function that
does the work and calls it. `run_command` is the one place every verb's failures end, for `dlenv VERB`
and the invoke tasks alike: a `UserError`, or a fault of the machine (full disk, read-only folder,
permission, ...: `dlenv.errors.environment_fault`) or the host out of RAM (`host_memory_line`, naming the
command's batch size), becomes one line on stderr and its status from the one table,
`dlenv.errors.EXIT_CODES` (2 bad input, 3 out of memory, 5 the machine, ...); Ctrl-C exits 130;
anything else is a bug and shows its traceback, then one line saying so (exit 1). Set
DLENV_TRACEBACK=1 to see the traceback of a fault too. Nothing here imports torch until a command
actually runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from dlenv import __version__, invocation
from dlenv.errors import (
    BUG_REPORT,
    EXIT_BUG,
    EXIT_FAULT,
    EXIT_INPUT,
    EXIT_OOM,
    EXIT_SIGHUP,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Stopped,
    UserError,
    check_stop,
    environment_fault,
    host_memory_line,
    printable,
    quiet_stops,
    sizes_said,
    stop,
    stop_received,
)
from dlenv.options import helptext, typos


def _add_options(parser: argparse.ArgumentParser, cls: type, command: str) -> None:
    """The command's flags from its options, in the groups dlenv.options.helptext names for it (one block else)."""
    from dlenv.options import config  # lazy: `dlenv --help` lists the verbs without the option declarations

    fields = {f.name: f for f in config.options(cls)}
    groups = helptext.GROUPS.get(command)
    for title, names in groups or ((None, (*fields, "cfg")),):
        group = parser.add_argument_group(title) if title else parser
        for name in names:
            if name == "cfg":
                group.add_argument("--cfg", default=None, help="YAML file of options (flags given override it)")
            else:
                _add_option(group, fields[name])


def _add_option(parser: Any, f: Any) -> None:
    from dlenv.options import config  # lazy: as in _add_options

    md = f.metadata
    default = f"(default: {f.default})" if f.default not in (None, False, ()) else ""
    help_text = f"{md['help']} {default}".strip().replace("%", "%%")
    if md["positional"]:
        parser.add_argument(f.name, nargs="?", default=argparse.SUPPRESS, help=help_text)
    elif md.get("bare"):  # `--compile` alone is `--compile on`; `--no-compile` is off
        parser.add_argument(config.flag(f.name), dest=f.name, nargs="?", const=md["bare"],
                            default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)
        parser.add_argument("--no-" + config.flag(f.name)[2:], dest=f.name, action="store_const",
                            const="off", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    elif f.default is True or f.default is False:
        parser.add_argument(config.flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)
    else:
        nargs = md.get("nargs")  # `--compare A B`
        parser.add_argument(config.flag(f.name), dest=f.name, default=argparse.SUPPRESS, nargs=nargs,
                            metavar=("A", "B") if nargs == 2 else f.name.upper(), choices=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """Every verb's parser, its flags generated from dlenv.options.config (`dlenv --help` is `helptext.top_help`)."""
    from dlenv.options import config  # lazy: as in _add_options

    # no abbreviations anywhere: `--nam x` taken for --name got past the Slurm script's guard on --name and
    # --project, and a flag added later would change what an abbreviation in someone's script means
    parser = argparse.ArgumentParser(prog="dlenv", allow_abbrev=False, description="GPU training environment for image "
                                     "classifiers. Each verb is also an invoke task: invoke VERB ...")
    parser.add_argument("--version", action="version", version=f"dlenv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="VERB", parser_class=_VerbParser)
    for cmd in config.COMMANDS.values():
        # the raw formatter keeps the examples' lines as written; option help is still wrapped
        # a grouped command's usage would repeat its ~60 flags in 35 lines before the groups list them
        usage = f"dlenv {cmd.name} [options]" if cmd.name in helptext.GROUPS else None
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, epilog=helptext.epilog(cmd.name),
                           usage=usage, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        _add_options(p, cmd.config, cmd.name)
    t = sub.add_parser("test", help=TEST_HELP, description=TEST_HELP + " Other arguments go to pytest.",
                       allow_abbrev=False)
    t.add_argument("--gpu", action="store_true", help="only the GPU tests")
    t.add_argument("--full", action="store_true", help=FULL_HELP)
    return parser


class _VerbParser(argparse.ArgumentParser):
    """A verb's parser: a flag it cannot read (`--epochs` with no value, ...) is one line and the usage of
    the command as typed (`python train.py`, `dlenv train`), exit 2."""

    def error(self, message: str) -> Any:
        usage_error(self.prog.split()[-1], message)


def usage_error(verb: str, line: str) -> Any:
    """Print `line` and the usage of `verb` as the user started dlenv (dlenv.invocation); exit 2."""
    print(usage_text(verb, line, invocation.again(verb, "").strip()), file=sys.stderr)
    raise SystemExit(EXIT_INPUT)


def usage_text(verb: str, line: str, typed: str) -> str:
    """'dlenv VERB: error: LINE' and the usage of the command `typed` (python train.py, invoke train, ...)."""
    return f"dlenv {verb}: error: {printable(line)}\nusage: {typed} [options]; {typed} --help lists them"


def flags_of(verb: str) -> list[str]:
    """The flags `verb` takes, as _add_options declares them (for the closest to a typo)."""
    from dlenv.options import config  # lazy: as in _add_options

    if verb == "test":
        return ["--gpu", "--full", "--help"]
    out = ["--help", "--cfg"]
    for f in config.options(config.COMMANDS[verb].config):
        if not f.metadata["positional"]:
            out.append(config.flag(f.name))
            if f.metadata.get("bare") or isinstance(f.default, bool):
                out.append("--no-" + config.flag(f.name)[2:])
    return out


TEST_HELP = ("Run the quick tests (not those marked slow; minutes on 2 CPU cores) with a progress line and "
             "an ETA; GPU tests run when a GPU is visible.")
FULL_HELP = "every test, the slow ones too (what CI runs)"
#: what `dlenv test` leaves to --full
QUICK = "not slow"


def run_tests(gpu: bool = False, extra: list[str] | tuple[str, ...] = (), full: bool = False) -> int:
    """`dlenv test` / `invoke test`: pytest over the source checkout's tests, or the image's shipped copy.

    The quick tests unless `full`; a progress line with the ETA (dlenv.testprogress); failures and errors
    summarized at the end (not the list of skips). The tests' files go to a temporary folder removed at
    the end (pytest's own basetemp keeps the last three sessions: 4 GB in /tmp/pytest-of-<user>), unless
    --basetemp is given. Returns pytest's exit code.
    """
    import shutil
    import tempfile

    tests = Path(__file__).resolve().parents[2] / "tests"
    if not tests.is_dir():  # installed copy: the image ships the tests beside the package
        tests = Path(os.environ.get("DLENV_TESTS", "/opt/dlenv/tests"))
    # no cache: the shipped tests sit in a read-only folder for a --user run
    own = not any(str(a).startswith("--basetemp") for a in extra)
    base = tempfile.mkdtemp(prefix="dlenv-test-") if own else None
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-p", "dlenv.testprogress",
           "-rfE", *(["--basetemp", str(Path(base) / "t")] if base else [])]
    if gpu:
        cmd += ["-m", "gpu"]
    elif not full:
        cmd += ["-m", QUICK]
    try:
        return subprocess.call(cmd + list(extra))
    finally:
        if base:
            shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _stoppable():
    """SIGTERM or SIGHUP while PyTorch loads (seconds, before any command has handlers of its own), or
    during a command that has none (val, predict, prune, export), ends in one line and 143 / 129, not a
    silent death by the default action; SIGINT already does (KeyboardInterrupt). The handler raises
    errors.Stopped, a BaseException, and notes the signal (errors.stop), so a library that swallows or
    converts the exception cannot lose the stop: `run_command` looks for the note. train puts its own on."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    old = {s: signal.signal(s, lambda signum, frame: stop(signum)) for s in (signal.SIGTERM, signal.SIGHUP)}
    hook, sys.unraisablehook = sys.unraisablehook, quiet_stops(sys.unraisablehook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for s, h in old.items():
            signal.signal(s, h)


def run_command(name: str, given: dict[str, Any], yaml_file: str | None = None) -> int:
    """Build `name`'s config from `given` flags (and a YAML file) and run it; returns the exit code."""
    from dlenv import pathcheck  # lazy: as in _add_options
    from dlenv.options import config, declare
    cmd = config.COMMANDS[name]
    loading = True
    cfg = None
    try:
        if yaml_file is not None:
            pathcheck.must_exist("--cfg", yaml_file, what="no such file")
        cfg = declare.command_line_consent(config.build(cmd.config, yaml_file, **given), given)
        cfg = pathcheck.check(name, cfg)  # every path option, before PyTorch loads
        module, func = cmd.target.split(":")
        with _stoppable():
            if name == "train" and "torch" not in sys.modules and os.environ.get("RANK", "0") == "0":
                # PyTorch and CUDA take seconds to load (7-11 s on a GPU box): say so at once, not after
                print("dlenv train: loading PyTorch ...", flush=True)
            target = getattr(importlib.import_module(module), func)
            check_stop()  # a stop that landed in a C extension's start-up: converted (torch 1.13) or dropped (2.x)
            loading = False
            code = int(target(cfg) or 0)  # loads take cfg's LoadPolicy; train puts its own handlers on
            if code == 0:
                check_stop()  # a stop some library swallowed on the way: the result is not whole
            return code
    except Stopped as e:
        return _stopped(name, e.signum, loading)
    except UserError as e:
        if stop_received():  # the stop, turned into an error on the way ("truncated or corrupt", ...)
            return _stopped(name, stop_received(), loading)
        print(f"dlenv {name}: error: {printable(e)}", file=sys.stderr)  # one line, whatever a name holds
        return e.exit_code
    except KeyboardInterrupt:
        print(f"dlenv {name}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except Exception as e:
        if stop_received():  # the stop, turned into an error on the way (RuntimeError("Stopped: 15 ..."))
            return _stopped(name, stop_received(), loading)
        sizes = {k: getattr(cfg, k, None) for k in ("batch_size", "img_size", "workers")}
        oom = host_memory_line(e, accum_steps=getattr(cfg, "accum_steps", None), **sizes)
        fault = oom or environment_fault(e, at=sizes_said(**sizes))
        if fault is None or os.environ.get("DLENV_TRACEBACK"):
            traceback.print_exc()
        if fault is not None:
            print(f"dlenv {name}: error: {printable(fault)}", file=sys.stderr)
            return EXIT_OOM if oom else EXIT_FAULT
        print(f"dlenv {name}: {BUG_REPORT.format(version=__version__)}", file=sys.stderr)
        return EXIT_BUG


def _stopped(name: str | None, signum: int, loading: bool) -> int:
    """The one line a command stopped by `signum` ends with; returns its exit status."""
    when = "while starting (loading PyTorch); nothing was done" if loading else "before it finished"
    print(f"dlenv{f' {name}' if name else ''}: stopped by {signal.Signals(signum).name} {when}", file=sys.stderr)
    return {signal.SIGHUP: EXIT_SIGHUP, signal.SIGINT: EXIT_SIGINT}.get(signum, EXIT_SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """`dlenv VERB ...`: its exit status. A stop signal from here on ends it in one line (`_stoppable`)."""
    words = sys.argv[1:] if argv is None else list(argv)
    if words in ([], ["-h"], ["--help"]):  # the verbs by group, from dlenv.options.helptext alone: at once
        print(helptext.top_help(__version__))
        return EXIT_INPUT if not words else 0
    try:
        with _stoppable():
            return _main(argv)
    except Stopped as e:  # while the flags are read, before run_command has a verb to name
        return _stopped(None, e.signum, True)
    except Exception:
        if stop_received():  # the stop, converted on the way: Python 3.10 wraps what a class being made
            return _stopped(None, stop_received(), True)  # raises (RuntimeError: Error calling __set_name__)
        raise


def _watched(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`dlenv watch [options] -- COMMAND ...`: (watch's own arguments, the command), the command being
    everything after the first `--` (its flags are its own, not watch's); (argv, None) for any other line."""
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb != "watch" or "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _verb(own: list[str]) -> str | None:
    """The verb of `own` (its first word that is no flag); a word that is none is one line with the closest
    verb, exit 2."""
    from dlenv.options import config  # lazy: as in _add_options

    word = next((w for w in own if not w.startswith("-")), None)
    if word is None or word in config.COMMANDS or word == "test":
        return word
    near = typos.word_hint(word, [*config.COMMANDS, "test"])
    print(f"dlenv: error: {printable(word)!r} is not a verb{near}\nusage: dlenv VERB [options]; dlenv --help lists "
          "the verbs", file=sys.stderr)
    raise SystemExit(EXIT_INPUT)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    own, watched = _watched(sys.argv[1:] if argv is None else list(argv))
    verb = _verb(own)
    if verb is not None and verb != "test":  # for "Resume with: ..." hints and the usage of a flag's error
        invocation.remember(verb, script_picks_verb=argv is not None)
    parsed, extra = parser.parse_known_args(own)
    args = vars(parsed)
    name = args.pop("command")
    if name is None:
        parser.print_help()
        return EXIT_INPUT
    if name == "test":  # not a config-built verb: the rest of the line is pytest's
        return run_tests(args["gpu"], extra, args["full"])
    if extra:  # `--epoch 1`: did you mean --epochs?
        first = next((w for w in extra if w.startswith("-")), "")
        usage_error(name, f"unrecognized arguments: {' '.join(extra)}{typos.flag_hint(name, first, flags_of(name))}")
    yaml_file = args.pop("cfg", None)
    if watched is not None:
        args["run"] = watched
    return run_command(name, args, yaml_file)


if __name__ == "__main__":
    raise SystemExit(main())
