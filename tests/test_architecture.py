"""ARCHITECTURE.md's code map holds: every top-level module of src/dlenv is in its table, and no module
imports one listed in a row above its own (imports inside functions count too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "dlenv"


def table_rows(markdown: str) -> list[list[str]]:
    """The names of the code map's first column, row by row, top to bottom ('watch/' and 'cli.py' -> 'watch', 'cli')."""
    section = markdown.split("## Code map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not line.startswith("| `"):
            continue
        rows.append([n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", cells[1])])
    return rows


def dlenv_imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level dlenv module) of every import of dlenv in `source`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dlenv":
            parts = node.module.split(".")
            found += [(node.lineno, parts[1])] if len(parts) > 1 else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("dlenv.")]
    return found


def upward_imports(rows: list[list[str]], modules: dict[str, str]) -> list[str]:
    """'file:line imports X' for each import of a module listed above the importer's own row.
    `modules`: {path relative to src/dlenv: its source}."""
    row = {name: i for i, names in enumerate(rows) for name in names}
    bad = []
    for rel, source in sorted(modules.items()):
        me = Path(rel).parts[0].removesuffix(".py")
        for line, other in dlenv_imports(source):
            if other in row and me in row and row[other] < row[me]:
                bad.append(f"{rel}:{line} imports {other}, listed above {me}")
    return bad


def _code() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def test_every_top_level_module_is_in_the_map_and_nothing_else():
    listed = {n for names in table_rows((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")) for n in names}
    code = {p.name.removesuffix(".py") for p in SRC.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert code - listed == set(), "add these to ARCHITECTURE.md's code map"
    assert listed - code == set(), "ARCHITECTURE.md names modules the code no longer has"


def test_no_module_imports_one_listed_above_it():
    rows = table_rows((ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert len(rows) >= 10
    assert upward_imports(rows, _code()) == []


ROWS = [["cli"], ["train"], ["watch"], ["files"], ["errors"]]


@pytest.mark.parametrize("rel,source,bad", [
    ("train/fit.py", "from dlenv.watch import probes\n", False),                  # a row below: allowed
    ("watch/run.py", "from dlenv.train import fit\n", True),                      # a row above: refused
    ("watch/run.py", "def f():\n    from dlenv.train.fit import x\n", True),      # inside a function too
    ("files/safeio.py", "import dlenv.cli\n", True),
    ("files/safeio.py", "from dlenv import errors, files\n", False),             # its own row and below
    ("errors.py", "from dlenv import train\n", True),
    ("cli.py", "from dlenv import errors\nimport dlenv.train.run\n", False),      # the faces import everything
    ("files/x.py", "import torch\nfrom . import safeio\n", False),               # not dlenv's by name
])
def test_the_check_itself(rel, source, bad):
    assert bool(upward_imports(ROWS, {rel: source})) is bad


def test_the_table_parser_reads_wings_and_modules():
    md = ("## Code map\n\n| wing | job | may import |\n| --- | --- | --- |\n"
          "| `cli.py`, `watch/` | x | y |\n| `files/` | a `note.py` here is not a row name | z |\n\n## Next\n")
    assert table_rows(md) == [["cli", "watch"], ["files"]]
