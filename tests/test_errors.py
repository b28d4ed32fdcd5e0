"""dlenv.errors and the CLI's one handler: a fault of the machine is one line, a bug keeps its traceback."""

from __future__ import annotations

import errno
import os

import pytest

from dlenv import cli
from dlenv.errors import environment_fault, printable, torch_write_failure, with_path

# errno -> words the line must hold besides the path
FAULTS = [
    (errno.ENOSPC, "no space left on the device holding runs/exp/last.pth", "df -h runs/exp"),
    (errno.EDQUOT, "disk quota exceeded writing runs/exp/last.pth", "quota"),
    (errno.EFBIG, "runs/exp/last.pth would grow past the largest file allowed", "ulimit -f"),
    (errno.EROFS, "runs/exp/last.pth is on a read-only file system", "without :ro"),
    (errno.EACCES, "permission denied for runs/exp/last.pth", "--user $(id -u):$(id -g)"),
    (errno.EPERM, "on runs/exp/last.pth is not permitted", "--user"),
    (errno.ENAMETOOLONG, "the name runs/exp/last.pth is too long", "shorter --name"),
    (errno.ENOTDIR, "a part of runs/exp/last.pth is a file where a folder is needed", "move that file"),
    (errno.EISDIR, "runs/exp/last.pth is a folder where a file is needed", "pass a file path"),
    (errno.EIO, "input/output error on runs/exp/last.pth", "dmesg"),
    (errno.EMFILE, "too many open files", "ulimit -n"),
]


@pytest.mark.parametrize(("code", "what", "todo"), FAULTS, ids=[errno.errorcode[c] for c, _, _ in FAULTS])
def test_os_errors_become_one_line_naming_path_cause_and_remedy(code, what, todo):
    line = environment_fault(OSError(code, os.strerror(code), "runs/exp/last.pth"))
    assert what in line and todo in line and os.strerror(code) in line
    assert "\n" not in line


def test_a_long_name_is_shortened_in_the_line():
    line = environment_fault(OSError(errno.ENAMETOOLONG, "File name too long", "runs/" + "x" * 400))
    assert "..." in line and len(line) < 300


@pytest.mark.parametrize("message", [
    "[enforce fail at inline_container.cc:325] . unexpected pos 320 vs 248",
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/3: file write failed",
])
def test_torchs_failed_write_is_the_no_space_line(message):
    assert torch_write_failure(RuntimeError(message))
    assert "no space left on the device" in environment_fault(RuntimeError(message))


def test_full_shared_memory_names_shm_size():
    e = RuntimeError("unable to write to file </torch_123_456789>: No space left on device (28)")
    assert "--shm-size" in environment_fault(e)


@pytest.mark.parametrize("exc", [RuntimeError("size mismatch"), ValueError("x"),
                                 OSError(errno.EXDEV, "Invalid cross-device link"), KeyError("a")])
def test_other_errors_are_not_faults(exc):
    assert environment_fault(exc) is None


def test_with_path_names_the_file_of_a_bare_write_error():
    e = with_path(OSError(errno.ENOSPC, "No space left on device"), "a/b.pth")
    assert e.filename == "a/b.pth" and e.errno == errno.ENOSPC
    named = OSError(errno.ENOSPC, "No space left on device", "x")
    assert with_path(named, "y") is named


@pytest.mark.parametrize(("raw", "shown"), [
    ("esc\x1b[2Jx.png", "esc\\x1b[2Jx.png"),
    ("cr\rfake", "cr\\rfake"),
    ("two\nlines", "two\\nlines"),
    ("bidi\u202egnp.exe", "bidi\\u202egnp.exe"),
    ("c1\x9bx", "c1\\x9bx"),
    ("not-utf8-\udcff", "not-utf8-\\xff"),  # os.fsdecode of the byte 0xff
    ("café 猫", "café 猫"),
])
def test_printable_escapes_what_would_act_on_a_terminal(raw, shown):
    assert printable(raw) == shown


# ---------------------------------------------------------------------------------------------------
# The CLI's handler (dlenv VERB and the invoke tasks both end in cli.run_command).


def _boom(exc):
    def run(cfg):
        raise exc
    return run


def test_a_fault_is_one_line_with_exit_1(monkeypatch, capsys):
    monkeypatch.setattr("dlenv.plots.main", _boom(OSError(errno.EROFS, "Read-only file system", "runs/a.png")))
    assert cli.main(["plot"]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dlenv plot: error: runs/a.png is on a read-only file system")


def test_a_bug_keeps_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    monkeypatch.setattr("dlenv.plots.main", _boom(ZeroDivisionError("division by zero")))
    assert cli.main(["plot"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert err.splitlines()[-1].startswith("dlenv plot: this is a bug in dlenv")


def test_dlenv_traceback_shows_a_faults_traceback_too(monkeypatch, capsys):
    monkeypatch.setenv("DLENV_TRACEBACK", "1")
    monkeypatch.setattr("dlenv.plots.main", _boom(OSError(errno.ENOSPC, "No space left on device", "x")))
    assert cli.main(["plot"]) == 5
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith("dlenv plot: error: no space left")


def test_a_user_error_naming_a_hostile_file_stays_one_line(monkeypatch, capsys):
    from dlenv.errors import UserError

    monkeypatch.setattr("dlenv.plots.main", _boom(UserError("bad file a\nfake line\x1b[2J")))
    assert cli.main(["plot"]) == 2
    assert capsys.readouterr().err == "dlenv plot: error: bad file a\\nfake line\\x1b[2J\n"
