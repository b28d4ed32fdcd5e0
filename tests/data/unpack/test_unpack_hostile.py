"""Archives and destinations that used to end unpack in a traceback or print raw escapes (issue 25).

Each row: one line naming the archive and what is wrong, exit 2, nothing written, the destination as
it was; or, for a destination that is a mount point, an unpack that works. Names from an archive are
printed escaped wherever unpack prints them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from archivemaker import dataset_members, make_tar, make_zip, snapshot, tar_entry, zip_link

from dlenv import cli
from dlenv.data import unpack as archive
from dlenv.data.unpack.names import importable_names, is_code
from dlenv.errors import EXIT_INPUT, EXIT_OK, UserError, printable

SRC = Path(__file__).resolve().parents[3] / "src"
#: what must never reach the terminal raw: C0 controls but newline and tab, DEL, C1, bidi overrides
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """tmp_path/in for archives, out/ds: an existing destination the rows must never lose."""
    (tmp_path / "in").mkdir()
    dest = tmp_path / "out" / "ds"
    dest.mkdir(parents=True)
    (dest / "keep.txt").write_text("the user's data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused_everywhere(work: Path, src: Path, expect: list[str], capsys) -> None:
    """Refused by unpack() (into a new and over an existing destination) and by the CLI: one line,
    exit 2, no traceback, the tree exactly as before."""
    before = snapshot(work)
    for dest, overwrite in ((work / "out" / "new", False), (work / "out" / "ds", True)):
        with pytest.raises(UserError) as e:
            archive.unpack(src, dest, overwrite=overwrite, progress=False)
        assert "\n" not in str(e.value) and all(x in str(e.value) for x in expect), str(e.value)
        assert snapshot(work) == before
    assert cli.main(["unpack", str(src), "--dest", "out/ds", "--overwrite"]) == EXIT_INPUT
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "bug in dlenv" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlenv unpack: error: "), err
    assert not RAW_CONTROL.search(out + err)
    assert snapshot(work) == before


# ---------------------------------------------------------------------------------------------------
# A zip link whose target holds a NUL byte (os.symlink raised ValueError: a traceback).

NUL_TARGETS = [
    ("middle", "x\x00y"),
    ("only", "\x00"),
    ("after-a-real-target", "cat/0.jpg\x00"),
    ("hiding-an-escape", "cat/0.jpg\x00../../../etc/passwd"),
    ("before-absolute", "\x00/etc/passwd"),
    ("many", "\x00" * 300),
]


@pytest.mark.parametrize("target", [t for _, t in NUL_TARGETS], ids=[i for i, _ in NUL_TARGETS])
@pytest.mark.parametrize("where", ["top", "in-class-folder"])
def test_zip_link_target_with_a_nul_byte(work, capsys, target, where):
    name = "link.jpg" if where == "top" else "ds/train/cat/link.jpg"
    src = make_zip(work / "in" / "a.zip", [*dataset_members(), zip_link(name, target)])
    refused_everywhere(work, src, ["a.zip", "NUL byte", "refusing to unpack"], capsys)


# ---------------------------------------------------------------------------------------------------
# A name flagged UTF-8 (bit 11) that is not UTF-8 (zipfile raised UnicodeDecodeError while listing).


class _FlaggedRaw(zipfile.ZipInfo):
    """A member whose stored name is `raw` bytes with the UTF-8 flag set, as a broken tool writes."""

    def __init__(self, raw: bytes, **kw):
        super().__init__(raw.decode("latin-1"), **kw)
        self.raw = raw

    def _encodeFilenameFlags(self):  # noqa: N802 (zipfile's own name)
        return self.raw, self.flag_bits | 0x800


BAD_UTF8 = [
    ("ff-byte", b"ds/train/cat/\xff.jpg"),
    ("lone-continuation", b"ds/train/\x80/0.jpg"),
    ("overlong-slash", b"ds/train/cat/\xc0\xaf.jpg"),
    ("surrogate", b"ds/train/cat/\xed\xa0\x80.jpg"),
    ("truncated", b"ds/train/cat/x\xe2\x82"),
    ("five-byte-form", b"ds/\xf8\x88\x80\x80\x80/a.jpg"),
    ("latin1-flagged", "ds/train/café/0.jpg".encode("latin-1")),
    ("gbk-flagged", "ds/train/数据/0.jpg".encode("gbk")),
]


@pytest.mark.parametrize("raw", [r for _, r in BAD_UTF8], ids=[i for i, _ in BAD_UTF8])
@pytest.mark.parametrize("position", ["first", "last"])
def test_zip_name_flagged_utf8_that_is_not(work, capsys, raw, position):
    bad = (_FlaggedRaw(raw), b"x" * 300)
    members = [bad, *dataset_members()] if position == "first" else [*dataset_members(), bad]
    src = make_zip(work / "in" / "b.zip", members)
    refused_everywhere(work, src, ["b.zip", "marked as UTF-8", "not UTF-8", "re-pack it"], capsys)


# ---------------------------------------------------------------------------------------------------
# Names that would act on a terminal: printed escaped by unpack itself, not only by the report.

ESCAPES = [
    ("clear-screen", "\x1b[2J\x1b[H"),
    ("osc-title", "\x1b]0;pwned\x07"),
    ("osc-hyperlink", "\x1b]8;;x\x07click\x1b]8;;\x07"),
    ("c1-csi", "\x9b31m"),
    ("carriage-return", "ok\rFAKE"),
    ("bidi-override", "gpj.\u202eexe"),
    ("backspaces", "abc\x08\x08\x08XYZ"),
]


@pytest.mark.parametrize("esc", [e for _, e in ESCAPES], ids=[i for i, _ in ESCAPES])
@pytest.mark.parametrize("where", ["class-folder", "flattened-top-folder", "archive-name"])
def test_names_from_an_archive_are_printed_escaped(work, capsys, esc, where):
    cls = f"cat{esc}" if where == "class-folder" else "cat"
    top = f"top{esc}/" if where == "flattened-top-folder" else "top/"
    members = [(f"{top}{c}/{i}.jpg", os.urandom(200 + i)) for c in (cls, "dog") for i in range(3)]
    name = f"d{esc}.zip" if where == "archive-name" else "d.zip"
    src = make_zip(work / "in" / name, members)
    assert cli.main(["unpack", str(src), "--dest", "out/new"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert not RAW_CONTROL.search(out + err), ascii(out + err)
    assert "unpacked 6 files" in out
    shown = {"class-folder": cls, "flattened-top-folder": top.rstrip("/"), "archive-name": name}[where]
    assert printable(shown) in out, ascii(out)


# ---------------------------------------------------------------------------------------------------
# --dest that is a mount point (docker run -v HOST:/root/workspace/data/x): was EBUSY and a traceback.


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                          capture_output=True).returncode == 0


# Runs inside the namespace: prepare the mount as the row says, unpack through the CLI, and report
# the exit status and what the mount point holds (it vanishes with the namespace).
IN_NAMESPACE = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    from dlenv import cli
    dest = Path(sys.argv[1]); state = sys.argv[2]; flags = sys.argv[3:]
    if state == "files":
        (dest / "mine.txt").write_text("the user's data")
    if state == "leftover":
        os.makedirs(dest / f".{dest.name}.unpack-999999-tmp" / "half")
    code = cli.main(["unpack", "in/a.zip", "--dest", str(dest), "--no-report", *flags])  # its mount, not its data
    tree = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    print(json.dumps({"code": code, "tree": tree, "mounted": os.path.ismount(dest)}))
''')


@pytest.mark.skipif(not _can_mount(), reason="no private mount namespace here (unshare -m as root)")
@pytest.mark.parametrize(("state", "flags", "code", "expect"), [
    ("empty", [], EXIT_OK, None),
    ("empty", ["--overwrite"], EXIT_OK, None),
    ("leftover", [], EXIT_OK, "removed .x.unpack-999999-tmp"),
    ("files", [], EXIT_INPUT, "already exists and is not empty"),
    ("files", ["--overwrite"], EXIT_INPUT, "is a mount point"),
], ids=["empty", "empty-overwrite", "leftover-of-a-killed-unpack", "holds-files", "holds-files-overwrite"])
def test_dest_that_is_a_mount_point(work, state, flags, code, expect):
    make_zip(work / "in" / "a.zip", dataset_members())
    dest = work / "out" / "x"
    dest.mkdir()
    (work / "run.py").write_text(IN_NAMESPACE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    script = f'mount -t tmpfs -o size=200m tmpfs "{dest}" && exec "$@"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "run.py", str(dest), state,
                        *flags], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "bug in dlenv" not in r.stderr, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["code"] == code and result["mounted"], (result, r.stderr)
    if code == EXIT_OK:
        assert {"train/cat/0.jpg", "val/dog/1.jpg", ".dlenv-unpacked"} <= set(result["tree"]), result  # + the marker
        assert not [t for t in result["tree"] if ".unpack-" in t], result  # nothing left behind
        if expect:
            assert expect.replace(".x.", f".{dest.name}.") in r.stdout, r.stdout
    else:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], r.stderr
        assert result["tree"] == ["mine.txt"], result  # the user's file, and nothing else
    assert os.listdir(dest) == []  # outside the namespace the folder was never touched


def test_a_busy_destination_found_late_is_a_fault_line_not_a_traceback(work, monkeypatch, capsys):
    """EBUSY where the checks could not foresee it (a rename that the kernel refuses) is still one line."""
    import errno

    from dlenv.data.unpack import swap

    make_zip(work / "in" / "a.zip", dataset_members())

    def busy(*a, **k):
        raise OSError(errno.EBUSY, "Device or resource busy", str(work / "out" / "ds"))

    before = snapshot(work)
    monkeypatch.setattr(swap.os, "rename", busy)
    code = cli.main(["unpack", "in/a.zip", "--dest", "out/ds", "--overwrite"])
    err = capsys.readouterr().err
    assert code != EXIT_OK and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "busy" in err and "mount" in err
    assert snapshot(work) == before
    assert stat.S_ISDIR(os.stat(work / "out" / "ds").st_mode)


@pytest.mark.parametrize(("kind", "expect"), [
    ("fifo", "named pipe (FIFO)"), ("dev-zero", "character device"), ("link-to-fifo", "named pipe"),
    ("folder", "is a folder"),
], ids=["fifo", "dev-zero", "link-to-fifo", "folder"])
def test_an_archive_that_is_not_a_regular_file_is_named_without_blocking(work, kind, expect):
    """As a subprocess under a timeout: opening a FIFO for reading used to block until a writer came."""
    p = work / "in" / "a.zip"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero":
        p.symlink_to("/dev/zero")
    elif kind == "link-to-fifo":
        os.mkfifo(work / "in" / "real")
        p.symlink_to(work / "in" / "real")
    else:
        p.mkdir()
    before = snapshot(work / "out")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "dlenv", "unpack", str(p), "--dest", "out/new"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_INPUT and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "a.zip" in lines[0] and expect in lines[0], r.stderr
    assert snapshot(work / "out") == before and not (work / "out" / "new").exists()


# ---------------------------------------------------------------------------------------------------
# A dataset is data (issue 43): code is left out and listed in one line, unless --keep-code.

#: code members, by kind of code; each holds a marker-writing payload in case anything ran it
CODE_MEMBERS = {
    "a dlenv/ package": ["dlenv/__init__.py", "dlenv/cli.py"],
    "a stdlib module": ["argparse.py"],
    "bytecode": ["yaml.pyc", "__pycache__/json.cpython-310.pyc", "x.pyo"],
    "other python": ["gui.pyw", "ext.pyx", "ext.pxd", "app.pyz", "stub.pyi", "win.pyd"],
    "shared objects": ["numpy.cpython-310-x86_64-linux-gnu.so", "lib/libevil.so.1.2", "evil.dll", "evil.dylib"],
    "scripts": ["run.sh", "RUN.SH", "setup.bash", "go.bat", "go.cmd", "go.ps1", "tool.exe"],
    "upper case": ["ARGPARSE.PY"],
    "deep in a class folder": ["train/cat/sitecustomize.py"],
}
PAYLOAD = b"open('RAN', 'w').write('x')\n"


def _code_archive(path: Path, fmt: str, code: list[str]) -> Path:
    members = dataset_members() + [(f"ds/{c}", PAYLOAD) for c in code]
    if fmt == "zip":
        return make_zip(path.with_suffix(".zip"), members)
    if fmt == "7z":
        import py7zr

        with py7zr.SevenZipFile(path.with_suffix(".7z"), "w") as z:
            for name, data in members:
                z.writestr(data, name)
        return path.with_suffix(".7z")
    return make_tar(path.with_suffix(".tar"), members)


@pytest.mark.parametrize("kind", list(CODE_MEMBERS))
@pytest.mark.parametrize("fmt", ["zip", "tar", "7z"])
def test_code_is_left_out_and_listed_unless_kept(work, capsys, kind, fmt):
    code = CODE_MEMBERS[kind]
    src = _code_archive(work / "in" / "ds", fmt, code)
    assert cli.main(["unpack", str(src), "--dest", "out/new", "--no-report"]) == EXIT_OK
    out, err = capsys.readouterr()
    got = snapshot(work / "out" / "new")
    assert not [k for k in got if is_code(k)], sorted(got)
    assert sorted(k for k in got if k.endswith(".jpg")) == ["train/cat/0.jpg", "train/cat/1.jpg", "val/dog/0.jpg",
                                                            "val/dog/1.jpg"]
    listed = [line for line in out.splitlines() if "code file" in line]
    assert len(listed) == 1 and f"left out {len(code)} code file" in listed[0] and "--keep-code" in listed[0], out
    assert f"ds/{code[0]}" in listed[0] and err == ""
    assert cli.main(["unpack", str(src), "--dest", "out/kept", "--no-report", "--keep-code"]) == EXIT_OK
    out, _ = capsys.readouterr()
    kept = snapshot(work / "out" / "kept")
    shadows = [c for c in code if c.split("/")[0].split(".")[0] in importable_names()]  # never kept at the top
    assert all((c in kept) != (c in shadows) for c in code), sorted(kept)
    listed = [line for line in out.splitlines() if "kept" in line and "--keep-code" in line]
    still = [c for c in code if c not in shadows]
    assert len(listed) == (1 if still else 0) and all(f"ds/{c}" in listed[0] for c in still), out


@pytest.mark.parametrize("case", ["symlink named as code", "hard link to code", "hard link named as code"])
def test_links_to_and_named_as_code_are_left_out(work, case):
    members = dataset_members()
    if case == "symlink named as code":
        members.append(tar_entry("ds/argparse.py", tarfile.SYMTYPE, "train/cat/0.jpg"))
        gone = ["argparse.py"]
    elif case == "hard link to code":
        members += [("ds/evil.py", PAYLOAD), tar_entry("ds/train/cat/2.jpg", tarfile.LNKTYPE, "ds/evil.py")]
        gone = ["evil.py", "train/cat/2.jpg"]
    else:
        members.append(tar_entry("ds/yaml.py", tarfile.LNKTYPE, "ds/train/cat/0.jpg"))
        gone = ["yaml.py"]
    r = archive.unpack(make_tar(work / "in" / "a.tar", members), work / "out" / "new", progress=False)
    assert sorted(r.code) == sorted(f"ds/{g}" for g in gone)  # as the archive names them
    got = snapshot(work / "out" / "new")
    assert not any(g in got for g in gone) and "train/cat/0.jpg" in got


def test_an_archive_of_code_only_is_refused_with_the_way_to_keep_it(work, capsys):
    src = make_zip(work / "in" / "tool.zip", [("tool/dlenv/__init__.py", PAYLOAD), ("tool/run.sh", b"rm -rf ~")])
    refused_everywhere(work, src, ["holds only code", "dlenv/__init__.py", "--keep-code"], capsys)


def test_python_m_dlenv_inside_an_unpacked_folder_runs_none_of_its_code(work):
    """The issue's attack as a user meets it: unpack, cd into the folder, `python -m dlenv data-report .`."""
    members = dataset_members("shadow/") + [(f"shadow/{d}/0.jpg", b"x" * 300) for d in ("train/dog", "val/cat")]
    members += [(f"shadow/{c}", PAYLOAD) for c in ("dlenv/__init__.py", "argparse.py")]
    src = make_zip(work / "in" / "shadow.zip", members)
    archive.unpack(src, work / "data" / "shadow", progress=False)
    r = subprocess.run([sys.executable, "-m", "dlenv", "data-report", "."], cwd=work / "data" / "shadow",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_OK and "Traceback" not in r.stderr, r.stderr
    assert "cat" in r.stdout and not (work / "data" / "shadow" / "RAN").exists()
