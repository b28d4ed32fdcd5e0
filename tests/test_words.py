"""One word, one meaning: "checkpoint" is activation checkpointing; the files a run writes are run files or
weights files (last.pth, best_model.pth). Every verb's --help is read for the word used otherwise, and so is
every string of dlenv's source that can reach a user (messages, log and print lines, help, tips)."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------------
# Every string the source holds

SRC = Path(__file__).resolve().parents[1] / "src" / "dlenv"
#: the word in prose about the technique: its flags, its ratio, the blocks it recomputes, the search for them
ACTIVATION = re.compile(r"--(no-)?checkpoint(-ratio)?\b|checkpoint[ _-]ratio|checkpointing|checkpointed|"
                        r"checkpoint search|\bto checkpoint\b|torch\.utils\.checkpoint", re.I)
#: a string that is one name, not prose: an option or key ("checkpoint"), timm's "checkpoint_path", torch.hub's
#: "checkpoints" folder, a model's "checkpoint_blocks"
NAME = re.compile(r"[\w.]+")
#: a name quoted in prose: "the `checkpoint` column of memory.csv"
QUOTED = re.compile(r"`[^`\s]+`")


def shown_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal in `source` but docstrings, f-strings in their literal pieces.

    Wider than "what reaches users" by design: a message is often built away from the call that shows it (a
    table of reasons, a helper's return value, a Refused(...) a caller words), so every literal is read;
    docstrings speak to maintainers and are left out."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def run_files_called_checkpoints(source: str) -> list[str]:
    """'line: text' of each string in `source` that uses "checkpoint" for anything but the technique."""
    return [f"{line}: {text[:120]!r}" for line, text in shown_strings(source)
            if not NAME.fullmatch(text) and "checkpoint" in QUOTED.sub("", ACTIVATION.sub("", text)).lower()]


def test_no_message_of_dlenv_calls_a_run_file_a_checkpoint():
    bad = [f"{path.relative_to(SRC)}:{hit}" for path in sorted(SRC.rglob("*.py"))
           for hit in run_files_called_checkpoints(path.read_text(encoding="utf-8"))]
    assert bad == [], "say run file or weights file:\n" + "\n".join(bad)


RULE = [
    ("an error", 'raise UserError(f"{path} is a TorchScript archive, not a checkpoint")', True),
    ("a piece of an f-string", 'raise UserError(f"--weights is required: the checkpoint to {verb}")', True),
    ("a print", 'print("check: read back, every tensor identical to the checkpoint\'s")', True),
    ("a log line", 'log.warning("%s: the file this checkpoint was trained with differs", p)', True),
    ("a table of reasons", 'WHY = {"resume": "no such checkpoint"}', True),
    ("a helper's sentence", 'def last(p):\n    return f"The last good checkpoint is {p}."', True),
    ("a help line", 'opt(False, "validate a checkpoint")', True),
    ("the flags and the technique", 'opt(False, "recompute activations (--checkpoint, --checkpoint-ratio); '
                                    'activation checkpointing, checkpointed blocks, checkpoint ratio 0.5")', False),
    ("the blocks to recompute", 'raise UserError(f"{m} has no repeated blocks to checkpoint; training without it")',
     False),
    ("the search", 'NOTE = "not measured: the checkpoint search needs a CUDA GPU"', False),
    ("a key", 'on = cfg["checkpoint"] or spec.get("checkpoint_blocks")', False),
    ("a quoted name", 'NOTE = "the `checkpoint` column of memory.csv says the blocks"', False),
    ("a docstring", 'def f():\n    """Load a checkpoint."""\n', False),
    ("run files", 'raise UserError("not a dlenv run file; pass a weights file")', False),
]


@pytest.mark.parametrize("source, bad", [r[1:] for r in RULE], ids=[r[0] for r in RULE])
def test_the_rule_itself(source, bad):
    assert bool(run_files_called_checkpoints(source)) is bad
