"""One word, one meaning: "checkpoint" is activation checkpointing; the files a run writes are run files or
weights files (last.pth, best_model.pth). Every verb's --help is read for the word used otherwise."""

from __future__ import annotations

import contextlib
import re

import pytest

from dlenv import cli
from dlenv.options import config

#: the word in its one meaning: the flags and the technique
ALLOWED = re.compile(r"--(no-)?checkpoint(-ratio)?\b|CHECKPOINT_RATIO|checkpointing|checkpointed", re.I)


@pytest.mark.parametrize("verb", sorted(config.COMMANDS))
def test_no_help_calls_a_run_file_a_checkpoint(verb, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    text = ALLOWED.sub("", capsys.readouterr().out)
    assert not re.search(r"checkpoint", text, re.I), f"dlenv {verb} --help: " + " | ".join(
        line.strip() for line in text.splitlines() if "checkpoint" in line.lower())


def test_the_top_help_too(capsys):
    with contextlib.suppress(SystemExit):  # the top help returns, a verb's exits
        cli.main(["--help"])
    text = ALLOWED.sub("", capsys.readouterr().out)
    assert "checkpoint" not in text.lower()
