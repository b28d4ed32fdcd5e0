"""unpack never keeps, even with --keep-code, a top-level package or module named like one this Python
imports (issue 52 item 5): `python -m dlenv` run inside the folder puts it first on sys.path, and a kept
`dlenv/` ran in place of dlenv. The names come from what is importable here (names.importable_names), so
the table below holds examples of each kind, not the list. --keep-code lists what it kept in one line."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from importlib import machinery
from pathlib import Path

import pytest
from archivemaker import dataset_members, make_tar, make_zip, snapshot, tar_entry

from dlenv import cli
from dlenv.data import unpack as archive
from dlenv.data.unpack.names import importable_names
from dlenv.errors import EXIT_OK

EXT = machinery.EXTENSION_SUFFIXES[0]
PAYLOAD = b"open('RAN', 'w').write('x')\n"

# (members at the archive's top, after its single folder is flattened; the top-level entries that must go)
SHADOWS = [
    (["dlenv/__init__.py", "dlenv/cli.py", "dlenv/__main__.py"], ["dlenv/"]),
    (["torch/__init__.py"], ["torch/"]),
    (["numpy.py"], ["numpy.py"]),
    (["yaml/__init__.pyc"], ["yaml/"]),
    (["PIL/Image.py"], ["PIL/"]),  # no __init__: a namespace part still puts a module of that name first
    (["matplotlib/__init__.py", "matplotlib/pyplot.py"], ["matplotlib/"]),
    (["argparse.py", "json/__init__.py"], ["argparse.py", "json/"]),
    ([f"tqdm{EXT}"], [f"tqdm{EXT}"]),  # an extension module of this Python's own suffix
    (["mymodel.py", "utils/__init__.py"], []),  # the project's own: kept with --keep-code
]


def _archive(path: Path, code: list[str], fmt: str = "zip") -> Path:
    members = dataset_members() + [(f"ds/{c}", PAYLOAD) for c in code]
    return make_zip(path.with_suffix(".zip"), members) if fmt == "zip" else make_tar(path.with_suffix(".tar"), members)


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    return tmp_path


def test_the_names_are_derived_from_what_python_imports_here():
    names = importable_names()
    assert {"dlenv", "torch", "numpy", "yaml", "PIL", "matplotlib", "argparse", "json", "tqdm"} <= names
    assert "mymodel" not in names and "utils" not in names


@pytest.mark.parametrize("fmt", ["zip", "tar"])
@pytest.mark.parametrize(("code", "gone"), SHADOWS, ids=[s[0][0].split("/")[0] for s in SHADOWS])
def test_keep_code_never_keeps_a_module_named_like_an_importable_one(work, capsys, code, gone, fmt):
    src = _archive(work / "in" / "ds", code, fmt)
    assert cli.main(["unpack", str(src), "--dest", "out/kept", "--no-report", "--keep-code"]) == EXIT_OK
    out, err = capsys.readouterr()
    got = snapshot(work / "out" / "kept")
    for c in code:
        top = c.split("/")[0] + ("/" if "/" in c else "")
        assert (c in got) == (top not in gone), sorted(got)
    said = [line for line in out.splitlines() if "named like a module" in line]
    assert len(said) == (1 if gone else 0) and all(g in said[0] for g in gone), out
    kept = [line for line in out.splitlines() if line.strip().startswith("kept ")]
    still = [c for c in code if c.split("/")[0] + ("/" if "/" in c else "") not in gone]
    assert len(kept) == (1 if still else 0) and all(f"ds/{c}" in kept[0] for c in still), out
    assert err == "" and "train/cat/0.jpg" in got


def test_a_class_folder_named_like_a_module_is_data_and_stays(work):
    members = dataset_members() + [("ds/torch/0.jpg", b"x" * 300), ("ds/numpy/1.jpg", b"y" * 300)]
    for keep in (False, True):
        r = archive.unpack(make_zip(work / "in" / "a.zip", members), work / "out" / f"k{keep}", progress=False,
                           keep_code=keep)
        assert r.shadows == [] and {"torch/0.jpg", "numpy/1.jpg"} <= set(snapshot(r.dest))


def test_a_link_named_like_a_module_goes_too(work):
    members = dataset_members() + [("ds/pkg/__init__.py", PAYLOAD), tar_entry("ds/dlenv", tarfile.SYMTYPE, "pkg")]
    r = archive.unpack(make_tar(work / "in" / "a.tar", members), work / "out" / "new", progress=False,
                       keep_code=True)
    assert r.shadows == ["dlenv"] and not (r.dest / "dlenv").exists() and (r.dest / "pkg" / "__init__.py").is_file()


def test_python_m_dlenv_inside_a_folder_unpacked_with_keep_code_runs_none_of_its_code(work):
    """The issue's attack: unpack --keep-code a project holding dlenv/, cd into it, `python -m dlenv`."""
    members = dataset_members("shadow/") + [(f"shadow/{d}/0.jpg", b"x" * 300) for d in ("train/dog", "val/cat")]
    members += [(f"shadow/{c}", PAYLOAD) for c in
                                            ("dlenv/__init__.py", "dlenv/__main__.py", "numpy.py", "train.py")]
    src = make_zip(work / "in" / "shadow.zip", members)
    r = archive.unpack(src, work / "data" / "shadow", progress=False, keep_code=True)
    assert r.shadows == ["dlenv/", "numpy.py"] and r.kept == ["shadow/train.py"]
    proc = subprocess.run([sys.executable, "-m", "dlenv", "data-report", "."], cwd=r.dest, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_OK and "Traceback" not in proc.stderr, proc.stderr
    assert "cat" in proc.stdout and not (r.dest / "RAN").exists()
