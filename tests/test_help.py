"""`dlenv --help`: the verbs in groups with an example each (dlenv.options.helptext.top_help), printed without
importing the option declarations (dlenv.options.config) or torch; every verb there, every example parses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv import cli
from dlenv.options import config, helptext

SRC = Path(__file__).resolve().parents[1] / "src"
GROUPS = ("data", "train", "evaluate", "deploy", "environment")


def test_every_verb_is_listed_once_in_a_group():
    listed = [verb for _, verbs in helptext.VERBS for verb, _, _ in verbs]
    assert tuple(g for g, _ in helptext.VERBS) == GROUPS
    assert sorted(listed) == sorted([*config.COMMANDS, "test"]) and len(set(listed)) == len(listed)


@pytest.mark.parametrize("verb, example", [(v, e) for _, verbs in helptext.VERBS for v, _, e in verbs])
def test_each_example_is_a_command_line_that_parses(verb, example):
    words = example.split()
    assert words[:2] == ["dlenv", verb]
    own, watched = cli._watched(words[1:])
    parsed, extra = cli.build_parser().parse_known_args(own)
    assert parsed.command == verb and not extra and (watched is None) == (verb != "watch")


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["-h"], 0), ([], 2)])
def test_top_help_imports_neither_config_nor_torch(argv, code):
    probe = ("import sys, runpy\nsys.argv = ['dlenv', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('dlenv', run_name='__main__')\nexcept SystemExit as e:\n    rc = e.code\n"
             "print('LOADED', sorted(m for m in ('torch', 'dlenv.options.config', 'dlenv.files.weights')\n"
             "                       if m in sys.modules))\n"
             "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
    assert r.returncode == code, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "LOADED []", r.stdout[-300:]
    for group in GROUPS:
        assert f"\n{group}:\n" in r.stdout
    assert "e.g. dlenv train --data data/pets --amp --checkpoint" in r.stdout
