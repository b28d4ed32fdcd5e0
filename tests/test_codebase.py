"""The shape of src/dlenv itself: no import circles, and every module small enough to read in one sitting.

The import graph is read with `ast`, without importing anything. Imports inside functions count as
much as those at the top: a lazy import that closes a circle still ties the two modules together (and
only defers the failure to the first call that takes that path), so the design must not need it.
`import dlenv.x`, `from dlenv.x import name` and `from dlenv import x` (x a module) are edges to
dlenv.x; `from dlenv import name` (a name the package itself defines) is an edge to the package.
Importing dlenv.x.y first runs dlenv/x/__init__.py, so it is an edge to the package dlenv.x too
(unless the importer sits inside dlenv.x, whose __init__ has then already run).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dlenv"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The dlenv module `name` refers to: itself, or its longest prefix that is a module."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The dlenv modules `mod` imports anywhere in its file (module level and inside functions)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module sits in
                base = mod.split(".") if is_package else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one, else a name of pkg
            targets = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in known else parent for a in node.names]
        else:
            continue
        for t in targets:
            if t == "dlenv" or t.startswith("dlenv."):
                target = _resolve(t, known)
                if target and target != mod:
                    out.add(target)
                    out |= _packages_run_by(target, mod, is_package, known)
    return out


def _packages_run_by(target: str, mod: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The packages whose __init__ importing `target` runs first, leaving out those `mod` sits in
    (their __init__ has already run when `mod` runs)."""
    own = mod if is_package else mod.rpartition(".")[0]
    out = set()
    package = target.rpartition(".")[0]
    while package and package in known:
        if package != own and not own.startswith(package + "."):
            out.add(package)
        package = package.rpartition(".")[0]
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def test_src_dlenv_has_no_import_circles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles (each group imports itself through the others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


#: the modules that stay at the top of src/dlenv: the CLI's faces and what every wing uses (ARCHITECTURE.md)
MAX_LOOSE = 12


def test_the_top_level_holds_few_loose_modules_and_wings_start_light():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE, f"{len(loose)} loose modules at the top (group them in wings): {loose}"
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names] + [
            n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(m.split(".")[0] == "torch" for m in names), f"{init.relative_to(SRC)} imports torch"


def _imports_torch_at_the_top(tree: ast.Module) -> bool:
    return any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch")
               for n in tree.body)


def lazy_dlenv_imports(path: Path) -> list[str]:
    """`file:line` of each import of dlenv inside a function of a module that imports torch at its top:
    such a module is off the torch-free CLI path already, so deferring the import keeps nothing out and
    hides what the module uses. (Lazy imports stay where they do keep something out: in the torch-free
    modules of the CLI's path, and for optional libraries such as cv2, onnxruntime, timm or matplotlib.)"""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    if not _imports_torch_at_the_top(tree):
        return []
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                         [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else
                         ["dlenv"] if isinstance(n, ast.ImportFrom) else [])
                if any(m == "dlenv" or m.startswith("dlenv.") for m in names):
                    found.append(f"{path.relative_to(SRC)}:{n.lineno}")
    return sorted(set(found))


def test_modules_that_import_torch_import_dlenv_at_their_top():
    lazy = [hit for p in modules().values() for hit in lazy_dlenv_imports(p)]
    assert not lazy, f"imports of dlenv inside functions of modules that import torch at the top (hoist them): {lazy}"


@pytest.mark.parametrize("source,expected", [
    ("import torch\ndef f():\n    from dlenv.files import weights\n", ["m.py:3"]),
    ("import torch\ndef f():\n    def g():\n        import dlenv.errors\n", ["m.py:4"]),
    ("from torch import nn\nclass A:\n    def f(self):\n        from . import x\n", ["m.py:4"]),
    ("def f():\n    import torch\n    from dlenv.files import weights\n", []),  # torch-free at the top: the CLI's path
    ("import torch\ndef f():\n    import cv2\n", []),                          # an optional library
    ("import torch\nfrom dlenv.files import weights\n", []),
])
def test_the_lazy_import_reader_finds_them_at_any_depth(tmp_path, monkeypatch, source, expected):
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    (tmp_path / "m.py").write_text(source)
    assert lazy_dlenv_imports(tmp_path / "m.py") == expected


def test_no_source_file_is_over_the_limit():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


#: the most parameters a function of the input path and the trainer takes (self and cls counted): more is a
#: plan broken into loose arguments at a boundary, the shape issue 35 did away with
MAX_PARAMETERS = 8


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


@pytest.mark.parametrize("folder", ["data", "train"])
def test_no_function_of_the_input_path_or_the_trainer_takes_more_than_8_parameters(folder):
    many = {f"{p.relative_to(SRC)}:{fn.lineno} {fn.name}": n for p in sorted((PACKAGE / folder).rglob("*.py"))
            for fn in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := parameters(fn)) > MAX_PARAMETERS}
    assert not many, f"over {MAX_PARAMETERS} parameters (pass the plan, or group what travels together): {many}"


def test_the_parameter_count_counts_every_kind():
    fn = ast.parse("def f(self, a, /, b, *args, c, **kw): pass").body[0]
    assert parameters(fn) == 6


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_circles_of_any_length(graph, expected):
    assert find_cycles(graph) == expected


def test_the_import_reader_sees_function_level_and_package_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "dlenv"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("from dlenv import b, __version__\n\ndef f():\n    from dlenv.sub.c import thing\n")
    (pkg / "sub" / "c.py").write_text("from . import d\nfrom .. import a\nimport dlenv.b.x\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    known = {module_name(p): p for p in pkg.rglob("*.py")}
    # dlenv.sub.c's import runs dlenv/sub/__init__.py first: that is an edge to dlenv.sub as well
    assert imports_of("dlenv.a", pkg / "a.py", known) == {"dlenv.b", "dlenv", "dlenv.sub.c", "dlenv.sub"}
    assert imports_of("dlenv.sub.c", pkg / "sub" / "c.py", known) == {"dlenv.sub", "dlenv.a", "dlenv.b"}


def test_a_circle_through_a_package_init_is_found(tmp_path, monkeypatch):
    """dlenv.pkg's __init__ imports dlenv.a, and dlenv.a imports (inside a function) dlenv.pkg.leaf, which
    imports nothing: importing leaf runs pkg's __init__, so a, pkg and back is a circle."""
    pkg = tmp_path / "dlenv"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pkg" / "__init__.py").write_text("from dlenv import a\n")
    (pkg / "pkg" / "leaf.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from dlenv.pkg.leaf import g\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    known = {module_name(p): p for p in pkg.rglob("*.py")}
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    assert find_cycles(graph) == [["dlenv.a", "dlenv.pkg"]]
