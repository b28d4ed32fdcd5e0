"""scripts/ holds what scripts/README.md says: benchmarks at its top, the tools CI, the image and users run in
scripts/tools/, nothing elsewhere, every file listed in its folder's table and cited where it is used; and every
`scripts/...` path that README.md, ARCHITECTURE.md and docs/ cite is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the folders of scripts/ and the heading of each one's table in scripts/README.md
FOLDERS = {"": "## `scripts/`", "tools": "## `scripts/tools/`"}
#: a path in the clone (`scripts/x.py`), not one elsewhere (`/tmp/tree/scripts/x.py`, `src:scripts`)
CITED = re.compile(r"(?<![\w./:-])scripts/[\w.-]+(?:/[\w.-]+)*")


def script_files(root: Path) -> list[str]:
    """Every file under root/scripts, relative to it ('bench_train.py', 'tools/lock_env.py'), README.md aside."""
    base = root / "scripts"
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.name != "README.md")


def outside_the_layout(files: list[str]) -> list[str]:
    return [f for f in files if f.rpartition("/")[0] not in FOLDERS]


def listed(readme: str) -> dict[str, str]:
    """{file relative to scripts/: its folder} from the first column of each folder's table."""
    found = {}
    for folder, heading in FOLDERS.items():
        section = readme.split(heading + ":", 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            m = re.match(r"\| `([^`]+)` \|", line)
            if m:
                found[m.group(1)] = folder
    return found


def missing_citations(root: Path, texts: list[Path]) -> list[str]:
    """'doc: scripts/x' for each repository path under scripts/ a text cites that is not there."""
    bad = []
    for path in texts:
        for cited in CITED.findall(path.read_text(encoding="utf-8")):
            cited = cited.rstrip(".")
            if not (root / cited).exists():
                bad.append(f"{path.relative_to(root)}: {cited}")
    return bad


def docs(root: Path) -> list[Path]:
    return [root / "README.md", root / "ARCHITECTURE.md", root / "scripts" / "README.md",
            *sorted((root / "docs").glob("*.md"))]


def test_every_script_sits_in_a_folder_of_the_layout_and_is_listed_there():
    files = script_files(ROOT)
    assert outside_the_layout(files) == [], "scripts/ holds benchmarks at its top and tools in tools/ only"
    table = listed((ROOT / "scripts" / "README.md").read_text(encoding="utf-8"))
    assert sorted(table) == files, "scripts/README.md lists exactly the files of scripts/"
    assert all(f.rpartition("/")[0] == folder for f, folder in table.items()), "a file listed under another folder"


def test_readme_and_docs_cite_only_scripts_that_are_there():
    assert missing_citations(ROOT, docs(ROOT)) == []


def host_test_files(root: Path) -> list[Path]:
    """The host tests and their helpers: tests/*.py and tests/<wing>/**/*.py (tests/container aside)."""
    return [p for p in sorted((root / "tests").rglob("*.py")) if p.relative_to(root / "tests").parts[0] != "container"]


def test_every_script_is_cited_where_it_is_used():
    """A benchmark by the doc that quotes it (or the script that imports it), a tool by CI, the Dockerfile, a
    test or the doc that tells users to run it: a file nothing names is a one-off to retire."""
    texts = {p: p.read_text(encoding="utf-8", errors="replace") for p in [
        *docs(ROOT), ROOT / "Dockerfile", *(ROOT / ".ci").iterdir(), *(ROOT / "docker").rglob("*.sh"),
        *host_test_files(ROOT), *(ROOT / "scripts").rglob("*.*")] if p.is_file()}
    def cites(text: str, f: str) -> bool:
        return Path(f).name in text or bool(re.search(rf"^import {Path(f).stem}\b", text, re.M))

    uncited = [f for f in script_files(ROOT) if not any(
        cites(text, f) for p, text in texts.items() if p not in (ROOT / "scripts" / f, ROOT / "scripts" / "README.md"))]
    assert uncited == []


@pytest.mark.parametrize("text, bad", [
    ("run `python3 scripts/bench_train.py --steps 20`.", []),
    ("run `bash scripts/tools/setup-cpu.sh`", []),
    ("see scripts/gone.py.", ["d.md: scripts/gone.py"]),                      # retired, still cited
    ("see scripts/setup-cpu.sh", ["d.md: scripts/setup-cpu.sh"]),            # moved, cited at the old path
    ("python3 /tmp/t/scripts/gone.py; PYTHONPATH=src:scripts; left scripts/ once", []),  # not paths of the clone
])
def test_the_citation_check_itself(tmp_path, text, bad):
    (tmp_path / "scripts" / "tools").mkdir(parents=True)
    (tmp_path / "scripts" / "bench_train.py").write_text("")
    (tmp_path / "scripts" / "tools" / "setup-cpu.sh").write_text("")
    (tmp_path / "d.md").write_text(text)
    assert missing_citations(tmp_path, [tmp_path / "d.md"]) == bad


def test_the_layout_check_itself(tmp_path):
    for f in ("bench_x.py", "tools/t.sh", "explore/feed.py", "tools/deep/x.py"):
        (tmp_path / "scripts" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "scripts" / f).write_text("")
    assert outside_the_layout(script_files(tmp_path)) == ["explore/feed.py", "tools/deep/x.py"]
    readme = "## `scripts/`: b\n\n| `bench_x.py` | x |\n\n## `scripts/tools/`: t\n\n| `tools/t.sh` | y |\n"
    assert listed(readme) == {"bench_x.py": "", "tools/t.sh": "tools"}
