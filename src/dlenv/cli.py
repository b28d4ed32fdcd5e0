"""`dlenv VERB [options]` and `python -m dlenv VERB [options]`.

Parses flags generated from `dlenv.config`, builds the frozen config, imports the one function that
does the work and calls it. A `UserError` becomes one line on stderr and a non-zero exit; Ctrl-C
exits 130. Nothing here imports torch until a command actually runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from dlenv import __version__, config
from dlenv.errors import UserError


def _add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in config.options(cls):
        md = f.metadata
        default = f"(default: {f.default})" if f.default not in (None, False, ()) else ""
        help_text = f"{md['help']} {default}".strip().replace("%", "%%")
        if md["positional"]:
            parser.add_argument(f.name, nargs="?", default=argparse.SUPPRESS, help=help_text)
        elif f.default is True or f.default is False:
            parser.add_argument(config.flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(config.flag(f.name), dest=f.name, default=argparse.SUPPRESS,
                                metavar=f.name.upper(), choices=None, help=help_text)
    parser.add_argument("--cfg", default=None, help="YAML file of options (flags given override it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlenv", description="GPU training environment for image "
                                     "classifiers. Each verb is also an invoke task: invoke VERB ...")
    parser.add_argument("--version", action="version", version=f"dlenv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    for cmd in config.COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        _add_options(p, cmd.config)
    return parser


def run_command(name: str, given: dict[str, Any], yaml_file: str | None = None) -> int:
    """Build `name`'s config from `given` flags (and a YAML file) and run it; returns the exit code."""
    cmd = config.COMMANDS[name]
    try:
        cfg = config.build(cmd.config, yaml_file, **given)
        module, func = cmd.target.split(":")
        result = getattr(importlib.import_module(module), func)(cfg)
        return int(result or 0)
    except UserError as e:
        print(f"dlenv {name}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"dlenv {name}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    name = args.pop("command")
    if name is None:
        parser.print_help()
        return 2
    yaml_file = args.pop("cfg", None)
    return run_command(name, args, yaml_file)


if __name__ == "__main__":
    raise SystemExit(main())
