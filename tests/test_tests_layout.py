"""tests/ mirrors the wings of src/dlenv (ARCHITECTURE.md, "Where to add"): the test of a module of a wing is in
that wing's folder, `test_<module>.py` (or `test_<module>_gpu.py`) for `src/dlenv/<wing>/<module>.py` under
`tests/<wing>/` (a package's own test, `test_unpack.py` for `src/dlenv/data/unpack/`, in `tests/data/unpack/`),
and the test of a loose top-level module at tests/'s top. Every folder of tests/ is a wing's (tests/container
aside: the image from the host); the helpers stay at the top, where conftest.py puts them on sys.path, and no
two test files share a name (the folders have no __init__.py: pytest imports a test file by its name). A test
file imports another only from its own folder (the one pytest puts on sys.path for it); what two folders share
is a helper."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: tests/'s folders that mirror no wing
OWN = {"container"}


def module_folders(src: Path) -> dict[str, set[str]]:
    """{module name: the folders of tests/ its test may be in}: 'memory' -> {'engine', 'bench'}, 'cli' -> {''}."""
    found: dict[str, set[str]] = {}
    for p in src.rglob("*.py"):
        rel = p.relative_to(src)
        if p.name == "__init__.py":  # a package's own test sits in its folder
            if rel.parent.parts:
                found.setdefault(rel.parent.name, set()).add(rel.parent.as_posix())
        elif not p.name.startswith("_"):
            found.setdefault(p.stem, set()).add(rel.parent.as_posix() if rel.parent.parts else "")
    return found


def files_of(tests: Path) -> list[Path]:
    """Every test file of tests/, relative to it, tests/container aside."""
    return sorted(p.relative_to(tests) for p in tests.rglob("test_*.py") if p.relative_to(tests).parts[0] not in OWN)


def misplaced(src: Path, tests: Path) -> list[str]:
    """'engine/test_plan.py: in data/ or train/' for each test named after a module that is not in its wing."""
    folders = module_folders(src)
    bad = []
    for rel in files_of(tests):
        name = rel.stem.removeprefix("test_").removesuffix("_gpu")
        want = folders.get(name)
        here = rel.parent.as_posix() if rel.parent.parts else ""
        if want and here not in want:
            bad.append(f"{rel.as_posix()}: in " + " or ".join(f"tests/{w}/" if w else "tests/" for w in sorted(want)))
    return bad


def strays(src: Path, tests: Path) -> list[str]:
    """Folders of tests/ that are no wing of src/dlenv, and helpers (non-test .py files) outside tests/'s top."""
    wings = {p.relative_to(src).as_posix() for p in src.rglob("*") if (p / "__init__.py").is_file()}
    out = []
    for p in sorted(tests.rglob("*")):
        rel = p.relative_to(tests)
        if rel.parts[0] in OWN or "__pycache__" in rel.parts:
            continue
        if p.is_dir() and rel.as_posix() not in wings:
            out.append(f"{rel.as_posix()}/: no src/dlenv/{rel.as_posix()}/")
        elif p.suffix == ".py" and len(rel.parts) > 1 and not p.name.startswith("test_"):
            out.append(f"{rel.as_posix()}: a helper belongs at tests/'s top")
    return out


def foreign_imports(tests: Path) -> list[str]:
    """'a/test_x.py: test_y (in b/)' for each test file that imports a test file of another folder."""
    where = {p.stem: p.parent for p in tests.rglob("test_*.py")}
    bad = []
    for p in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                if name in where and where[name] != p.parent:
                    bad.append(f"{p.relative_to(tests).as_posix()}: {name} (in {where[name].relative_to(tests)}/)")
    return bad


def test_a_test_named_after_a_module_is_in_its_wing():
    assert misplaced(ROOT / "src" / "dlenv", ROOT / "tests") == []


def test_every_folder_of_tests_is_a_wing_and_the_helpers_are_at_the_top():
    assert strays(ROOT / "src" / "dlenv", ROOT / "tests") == []


def test_a_test_file_imports_test_files_of_its_own_folder_only():
    assert foreign_imports(ROOT / "tests") == []


def test_no_two_test_files_share_a_name():
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []


def test_the_layout_check_itself(tmp_path):
    src, tests = tmp_path / "src" / "dlenv", tmp_path / "tests"
    for f in ("__init__.py", "cli.py", "data/__init__.py", "data/plan.py", "data/unpack/__init__.py",
              "train/__init__.py", "train/plan.py", "engine/__init__.py", "engine/memory.py"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("")
    for f in ("test_cli.py", "test_bad_inputs.py", "gpushare.py", "data/test_plan.py", "train/test_plan_gpu.py",
              "data/unpack/test_unpack.py", "data/test_lone_sample.py", "container/test_image.py", "container/x.py",
              "test_memory.py", "engine/test_cli.py", "train/test_unpack.py", "data/helper.py", "misc/test_x.py"):
        (tests / f).parent.mkdir(parents=True, exist_ok=True)
        (tests / f).write_text("")
    assert misplaced(src, tests) == ["engine/test_cli.py: in tests/", "test_memory.py: in tests/engine/",
                                     "train/test_unpack.py: in tests/data/unpack/"]
    assert strays(src, tests) == ["data/helper.py: a helper belongs at tests/'s top", "misc/: no src/dlenv/misc/"]
    (tests / "data" / "test_plan.py").write_text("import gpushare\nfrom test_lone_sample import x\n")
    (tests / "train" / "test_plan_gpu.py").write_text("def f():\n    from test_plan import y\n")
    assert foreign_imports(tests) == ["train/test_plan_gpu.py: test_plan (in data/)"]
