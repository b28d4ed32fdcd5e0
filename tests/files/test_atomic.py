"""dlenv.files.atomic: a file is replaced whole or left as it was."""

from __future__ import annotations

import pytest

from dlenv.files.atomic import write_atomic, write_bytes, write_text


def test_writes_and_replaces(tmp_path):
    p = tmp_path / "sub" / "r.txt"
    write_text(p, "one")
    write_bytes(p, b"two")
    assert p.read_bytes() == b"two"
    assert [f.name for f in p.parent.iterdir()] == ["r.txt"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(p, half_then_fail)
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["r.csv"]


def test_a_write_error_names_the_destination(tmp_path):
    import errno

    def disk_full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises: no file name

    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "r.png", disk_full)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "r.png")
    assert list(tmp_path.iterdir()) == []


def test_torchs_failed_write_becomes_an_oserror_naming_the_file(tmp_path):
    def torch_writer(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:325] . unexpected pos 320 vs 248")

    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "m.pt", torch_writer)
    assert e.value.filename == str(tmp_path / "m.pt") and "unexpected pos" in e.value.strerror
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("out", "folder", "message"), [
    ("afile", True, "--out {p}/afile is a file, not a folder"),
    ("afile/x", True, "{p}/afile is a file, so nothing can be written under it"),
    ("afile/x/y.onnx", False, "{p}/afile is a file, so nothing can be written under it"),
    ("dir", False, "--out {p}/dir is a folder; pass a file path"),
])
def test_check_output_refuses_what_cannot_be_written(tmp_path, out, folder, message):
    from dlenv.errors import UserError
    from dlenv.files.atomic import check_output

    (tmp_path / "afile").write_text("x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError) as e:
        check_output(tmp_path / out, "--out", folder=folder)
    assert message.format(p=tmp_path) in str(e.value)


def test_check_output_accepts_new_paths(tmp_path):
    from dlenv.files.atomic import check_output

    assert check_output(tmp_path / "new" / "deeper", "--out", folder=True) == tmp_path / "new" / "deeper"
    assert check_output(tmp_path / "m.onnx", "--out") == tmp_path / "m.onnx"


# ---------------------------------------------------------------------------------------------------
# Modes: what an atomic write leaves follows the umask, as a plain open() would (not mkstemp's 0600)


@pytest.fixture
def set_umask():
    import os

    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _writers():
    import torch

    from dlenv.files import runstate, weights

    def replaced(tmp):  # a writer that makes a new file instead of filling the temporary one (ONNX, savefig)
        tmp.unlink()
        tmp.write_bytes(b"x")

    return {
        "write_text": lambda p: write_text(p, "t"),
        "write_bytes": lambda p: write_bytes(p, b"b"),
        "write_atomic, file replaced": lambda p: write_atomic(p, replaced),
        "save_state": lambda p: runstate.save_state({"w": torch.ones(1)}, p),
        "save_safetensors": lambda p: weights.save_safetensors({"w": torch.ones(1)}, p.with_suffix(".safetensors")),
        "open() for comparison": lambda p: p.write_text("plain"),
    }


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
@pytest.mark.parametrize("writer", list(_writers()))
def test_files_get_the_mode_open_would_give(tmp_path, set_umask, writer, mask, mode):
    set_umask(mask)
    path = tmp_path / "out.pth"
    _writers()[writer](path)
    written = path if path.exists() else path.with_suffix(".safetensors")
    assert written.stat().st_mode & 0o777 == mode


def test_umask_is_read_without_changing_it(set_umask):
    import os

    from dlenv.files.atomic import file_mode, umask

    set_umask(0o037)
    assert umask() == 0o037 and file_mode() == 0o640
    assert os.umask(0o037) == 0o037  # still what it was
