"""dlenv.errors and the CLI's one handler: a fault of the machine is one line, a bug keeps its traceback."""

from __future__ import annotations

import errno
import os

import pytest

from dlenv import cli, errors
from dlenv.archives import ARCHIVE_SUFFIXES
from dlenv.errors import cut_at_word, environment_fault, first_line, printable, torch_write_failure, with_path

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
    (errno.EBUSY, "runs/exp/last.pth is busy: a mount point", "mount its parent folder instead"),
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


def test_a_fault_is_one_line_with_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dlenv.runfolder.plots.main",
                        _boom(OSError(errno.EROFS, "Read-only file system", "runs/a.png")))
    assert cli.main(["plot", "--log-dir", str(tmp_path)]) == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dlenv plot: error: runs/a.png is on a read-only file system")


def test_a_bug_keeps_its_traceback_and_says_it_is_a_bug(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("dlenv.runfolder.plots.main", _boom(ZeroDivisionError("division by zero")))
    assert cli.main(["plot", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert err.splitlines()[-1].startswith("dlenv plot: this is a bug in dlenv")


def test_dlenv_traceback_shows_a_faults_traceback_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DLENV_TRACEBACK", "1")
    monkeypatch.setattr("dlenv.runfolder.plots.main", _boom(OSError(errno.ENOSPC, "No space left on device", "x")))
    assert cli.main(["plot", "--log-dir", str(tmp_path)]) == 5
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1].startswith("dlenv plot: error: no space left")


def test_a_user_error_naming_a_hostile_file_stays_one_line(tmp_path, monkeypatch, capsys):
    from dlenv.errors import UserError

    monkeypatch.setattr("dlenv.runfolder.plots.main", _boom(UserError("bad file a\nfake line\x1b[2J")))
    assert cli.main(["plot", "--log-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "dlenv plot: error: bad file a\\nfake line\\x1b[2J\n"


# ---------------------------------------------------------------------------------------------------
# One table of exit codes (issue 25 item 8: 5 meant both "the machine" and "lost its peer").


def test_exit_codes_are_one_table_of_distinct_values():
    from dlenv import errors

    names = {n: getattr(errors, n) for n in dir(errors) if n.startswith("EXIT_") and n != "EXIT_CODES"}
    assert len(set(names.values())) == len(names), names  # no two meanings share a number
    assert set(names.values()) == set(errors.EXIT_CODES)
    assert errors.EXIT_FAULT != errors.EXIT_PEER


@pytest.mark.parametrize(("where", "name"), [
    ("dlenv.cluster.launch", "EXIT_PEER"),
    ("dlenv.train", "EXIT_OOM"),
    ("dlenv.train", "EXIT_NONFINITE"),
])
def test_every_module_takes_its_exit_codes_from_the_table(where, name):
    import importlib

    from dlenv import errors

    assert getattr(importlib.import_module(where), name) == getattr(errors, name)


def test_a_peer_failure_exits_differently_from_a_fault_of_the_machine():
    pytest.importorskip("torch")
    from dlenv import errors
    from dlenv.cluster.distributed import PeerFailure

    assert PeerFailure("x").exit_code == errors.EXIT_PEER != errors.EXIT_FAULT


def test_docs_faults_table_lists_every_exit_code():
    """docs/faults.md's table has a row ending in each code of EXIT_CODES, and no other codes."""
    import re
    from pathlib import Path

    from dlenv.errors import EXIT_CODES, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM

    text = (Path(__file__).resolve().parents[1] / "docs" / "faults.md").read_text()
    table = text[text.index("| what went wrong | you see | exit |"):].split("\n\n")[0]
    shown = {int(c) for row in table.splitlines()[2:] for c in re.findall(r"\d+", row.rsplit("|", 2)[1])}
    assert shown == set(EXIT_CODES) - {EXIT_OK}, shown
    assert {EXIT_SIGINT, EXIT_SIGTERM} <= shown


# ---------------------------------------------------------------------------------------------------
# DataLoader workers that die (issue 24 item 2, issue 25 item 6): torch's messages, as raised.

_DIED = "DataLoader worker (pid(s) 4242) exited unexpectedly"
WORKER_DEATHS = [
    ("bus-error", "DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's "
                  "workers are out of shared memory. Please try to raise your shared memory limit.", "--ipc=host"),
    ("shm-write-1.13", "unable to write to file </torch_17880_634821884_1>: No space left on device (28)",
     "--shm-size"),
    ("shm-write-2.x", "unable to write to file </torch_1_2_3>: No space left on device", "/dev/shm"),
    ("oom-killer", "DataLoader worker (pid 4242) is killed by signal: Killed. ", "killed by the system"),
    ("oom-killer-pids", "DataLoader worker (pid 1, 2) is killed by signal: Killed.", "docker run --memory"),
]


@pytest.mark.parametrize(("message", "expect"), [c[1:] for c in WORKER_DEATHS], ids=[c[0] for c in WORKER_DEATHS])
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "as-cause"])
def test_a_dead_worker_is_one_fault_line(message, expect, wrapped):
    """As torch raises it in the main process: the signal message, or "exited unexpectedly" raised
    from it (the traceback's "direct cause")."""
    exc = RuntimeError(message)
    if wrapped:
        outer = RuntimeError(_DIED)
        outer.__cause__ = exc
        exc = outer
    line = environment_fault(exc)
    assert line is not None and expect in line and "\n" not in line


@pytest.mark.parametrize("message", [
    _DIED,  # the cause unknown: not blamed on the machine
    "DataLoader worker (pid 4242) is killed by signal: Segmentation fault.",
    "Caught RuntimeError in DataLoader worker process 0.",
])
def test_other_worker_deaths_are_not_blamed_on_the_machine(message):
    assert environment_fault(RuntimeError(message)) is None


@pytest.mark.parametrize(("message", "expect"), [c[1:] for c in WORKER_DEATHS], ids=[c[0] for c in WORKER_DEATHS])
def test_a_dead_worker_through_the_cli_is_one_line_and_exit_5(tmp_path, monkeypatch, capsys, message, expect):
    from dlenv.errors import EXIT_FAULT

    outer = RuntimeError(_DIED)
    outer.__cause__ = RuntimeError(message)
    monkeypatch.setattr("dlenv.runfolder.plots.main", _boom(outer))
    assert cli.main(["plot", "--log-dir", str(tmp_path)]) == EXIT_FAULT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "bug in dlenv" not in err
    assert expect in err


CUTS = [  # (text, limit, the line): cut after a whole word, never in one (issue 43: "... could not be lo")
    ("short enough", 20, "short enough"),
    ("exactly twenty chars", 20, "exactly twenty chars"),
    ("the model could not be loaded from this file", 30, "the model could not be..."),
    ("the model could not be loaded", 26, "the model could not be..."),   # the cut falls on a space
    ("a, b; c: d e", 9, "a, b..."),                                        # no comma or colon before the dots
    ("averyveryverylongwordwithoutspaces then more", 20, "averyveryverylong..."),  # one word longer than half
    ("x" * 300, 10, "x" * 7 + "..."),
]


@pytest.mark.parametrize(("text", "limit", "line"), CUTS)
def test_a_long_line_is_cut_at_a_word_with_dots(text, limit, line):
    assert cut_at_word(text, limit) == line and len(line) <= limit
    assert first_line(RuntimeError(text), limit, named=False) == line


def test_first_line_is_the_one_rule_for_a_one_line_report():
    e = RuntimeError("  first\nsecond  ")
    assert first_line(e) == "RuntimeError: first"
    assert first_line(e, named=False) == "first"
    assert first_line(RuntimeError("x" * 300), 10, named=False) == "x" * 7 + "..."
    assert first_line(ValueError()) == first_line(ValueError(), named=False) == "ValueError"
    assert first_line("a warning\nits detail") == "a warning" and first_line("") == ""


def test_the_trainers_stop_signals_exit_by_the_table():
    pytest.importorskip("torch")
    import signal

    from dlenv import errors
    from dlenv.train import console

    assert console.SIGNAL_EXIT == {signal.SIGINT: errors.EXIT_SIGINT, signal.SIGTERM: errors.EXIT_SIGTERM,
                                   signal.SIGHUP: errors.EXIT_SIGHUP}


def _raised_in(folder, filename: str, exc: BaseException) -> BaseException:
    """`exc` as raised by a function of a module file named `filename` (its traceback passes there)."""
    import importlib.util

    path = folder / filename
    path.write_text("def fail(exc):\n    raise exc\n")
    spec = importlib.util.spec_from_file_location(f"_fake_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.fail(exc)
    except BaseException as e:  # noqa: BLE001 - the test hands it back
        return e
    raise AssertionError("not raised")


@pytest.mark.parametrize(("filename", "exc", "killed"), [
    # a worker SIGKILLed between sending a batch and handing over its memory: the main process's fetch of the
    # tensor's file descriptor fails inside multiprocessing's resource_sharer (seen in CI on 1.13)
    ("resource_sharer.py", ConnectionResetError(104, "Connection reset by peer"), True),
    ("resource_sharer.py", EOFError(), True),
    ("resource_sharer.py", ValueError("not a connection error"), False),
    ("somewhere_else.py", ConnectionResetError(104, "Connection reset by peer"), False),
])
def test_a_worker_gone_mid_handoff_is_a_killed_worker(tmp_path, filename, exc, killed):
    raised = _raised_in(tmp_path, filename, exc)
    assert errors.worker_killed(raised) is killed
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = raised
    assert errors.worker_killed(wrapped) is killed


@pytest.mark.parametrize(("make", "name", "said"), [
    (None, "nowhere", "--data nowhere: no such folder; pass X"),
    ("file", "notes.txt", "--data notes.txt is a file, not a folder; pass X"),
    ("file", "dataset.zip", "--data dataset.zip is an archive, not a folder; unpack it first "
                            "(invoke unpack dataset.zip)"),
    ("file", "photos.TAR.GZ", "is an archive, not a folder"),
    ("link", "dangling", "--data dangling: no such folder"),
])
def test_need_folder_tells_missing_from_file_from_archive(tmp_path, monkeypatch, make, name, said):
    monkeypatch.chdir(tmp_path)
    if make == "file":
        (tmp_path / name).write_bytes(b"x")
    elif make == "link":
        os.symlink(tmp_path / "gone", tmp_path / name)
    with pytest.raises(errors.UserError) as e:
        errors.need_folder(name, "--data", "pass X")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_need_folder_passes_a_folder_and_a_link_to_one(tmp_path):
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "l")
    errors.need_folder(tmp_path / "d", "--data", "x")
    errors.need_folder(tmp_path / "l", "--data", "x")


@pytest.mark.parametrize("suffix", ARCHIVE_SUFFIXES)
def test_need_folder_names_every_suffix_of_the_formats_table_as_an_archive(tmp_path, suffix):
    (tmp_path / f"pets{suffix.upper()}").write_bytes(b"x")
    with pytest.raises(errors.UserError, match="is an archive, not a folder; unpack it first"):
        errors.need_folder(tmp_path / f"pets{suffix.upper()}", "--data", "x")


# ---------------------------------------------------------------------------------------------------
# An optional library that is installed but broken: one line naming it and pip check.

#: (what, the module's body, whether it counts as installed-but-broken)
BROKEN_IMPORTS = [
    ("RuntimeError: built for NumPy 2", "raise RuntimeError('module compiled against ABI version 0x2000000 but this "
                                        "version of numpy is 0x1000009')", True),
    ("SystemError", "raise SystemError('initialization of _core raised unreported exception')", True),
    ("AttributeError", "raise AttributeError('_ARRAY_API not found')", True),
    ("ValueError", "raise ValueError('numpy.dtype size changed, may indicate binary incompatibility')", True),
    ("an ImportError of its own", "raise ImportError('numpy.core.multiarray failed to import')", True),
    ("a dependency missing", "import dlenv_no_such_dependency", True),
    ("a clean import", "VALUE = 1", False),
]


@pytest.mark.parametrize("body, broken", [b[1:] for b in BROKEN_IMPORTS], ids=[b[0] for b in BROKEN_IMPORTS])
def test_an_optional_library_that_fails_to_import_is_one_line_naming_it_and_pip_check(body, broken, tmp_path,
                                                                                      monkeypatch):
    import sys

    name = f"dlenv_fake_lib_{abs(hash(body))}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    if not broken:
        assert errors.optional_import(name, "not installed").VALUE == 1
        return
    with pytest.raises(errors.UserError) as e:
        errors.optional_import(name, "not installed")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{name} is installed but fails to import") and "pip check" in line
    assert e.value.exit_code == errors.EXIT_INPUT


@pytest.mark.parametrize("name", ["dlenv_not_installed_lib", "dlenv_not_installed_lib.quantization"])
def test_an_optional_library_not_installed_says_what_it_was_given_or_none(name):
    with pytest.raises(errors.UserError, match="^pip install it$"):
        errors.optional_import(name, "pip install it")
    assert errors.optional_import(name) is None


def test_a_stop_converted_inside_an_optional_import_stays_a_stop(tmp_path, monkeypatch):
    """torch 1.13 turns a Stopped raised in a C extension's start-up into RuntimeError('Stopped: 15 ...')."""
    (tmp_path / "dlenv_fake_stopped.py").write_text(
        "from dlenv import errors\nerrors._stops.append(15)\nraise RuntimeError('Stopped: 15 At: ...')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(errors, "_stops", [])
    with pytest.raises(errors.Stopped):
        errors.optional_import("dlenv_fake_stopped", "not installed")


#: the optional libraries dlenv imports, each only through errors.optional_import (the ONNX child imports
#: onnxruntime itself and its parent says the same line, onnxchild.Child)
OPTIONAL = {"onnx", "onnxruntime", "cv2", "timm", "torch_pruning", "pynvml", "safetensors"}
OWN_IMPORT = {"files/onnxchild.py"}


def test_every_optional_library_is_imported_through_optional_import():
    import ast
    from pathlib import Path

    root = Path(errors.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{where}:{node.lineno} {n}" for n in names if n.split(".")[0] in OPTIONAL
                      and where not in OWN_IMPORT]
    assert not found, "import these through dlenv.errors.optional_import: " + ", ".join(found)
