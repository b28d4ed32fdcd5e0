"""A stop signal at any moment of a command: never an exception a library can swallow (dlenv.errors.Stopped,
noted by dlenv.errors.stop), never a broken image or a corrupt file, always its one line and 143 / 129.

The quick tables raise the signal in the process itself, where a library would meet it: inside PyTorch's
import (torch 1.13's C++ start-up turns it into RuntimeError("Stopped: 15 ..."); an extension's start-up on
2.x drops it), inside an image decoder (which may turn it into an error of its own, or drop it), inside the
weights reader. The slow table sends SIGTERM / SIGHUP to real `dlenv train` / `val` / `predict` processes
after delays spread over each command's own run time measured first on this machine, so start-up, the torch
import, loading the weights, decoding, validation and saving are all hit, however loaded the machine is;
it asserts what each case ends with, never how long it took.
"""

from __future__ import annotations

import ast
import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from imagedata import make_train_val

from dlenv import cli, errors
from dlenv.cli import main as cli_main
from dlenv.data import badimages

SRC = Path(__file__).resolve().parents[1] / "src" / "dlenv"
CPU = ["--workers", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small_cnn trained for two steps on two classes of 32 px images: (root, best_model.pth)."""
    root = tmp_path_factory.mktemp("stops")
    make_train_val(root / "ds", per_class=6, val_per_class=3, size=(32, 32))
    assert cli_main(["train", "--data", str(root / "ds"), "--model", "small_cnn", "--img-size", "32",
                     "--batch-size", "4", "--epochs", "1", "--max-steps", "2", "--project", str(root / "runs"),
                     *CPU]) == 0
    return root, root / "runs" / "exp" / "best_model.pth"


def test_a_stop_is_a_base_exception_and_is_noted():
    assert issubclass(errors.Stopped, BaseException) and not issubclass(errors.Stopped, Exception)
    assert errors.stop_received() is None
    errors.check_stop()  # nothing noted: nothing raised
    with pytest.raises(errors.Stopped) as caught:
        errors.stop(signal.SIGHUP)
    assert caught.value.signum == signal.SIGHUP
    assert errors.stop_received() == signal.SIGHUP
    with pytest.raises(errors.Stopped):  # swallowed on the way, found again
        errors.check_stop()


def test_no_dlenv_code_catches_every_exception_and_goes_on():
    """`except BaseException` / a bare `except:` / suppress(BaseException) would take a stop: each one in
    src/dlenv must raise again, or hand what it caught on (a thread's failure, raised in the main thread)."""
    wide = {"BaseException"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler):
                names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in
                         ([] if node.type is None else node.type.elts if isinstance(node.type, ast.Tuple)
                          else [node.type])}
                catches_all = node.type is None or bool(names & wide)
                reraises = isinstance(node.body[-1], ast.Raise) or (node.name is not None and any(
                    isinstance(n, ast.Name) and n.id == node.name for b in node.body for n in ast.walk(b)))
                if catches_all and not reraises:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "suppress" and any(
                    getattr(a, "id", getattr(a, "attr", "")) in wide for a in node.args):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, found


# ---------------------------------------------------------------------------------------------------
# What a library may do with the stop it met, and what the command must end with all the same


def _passes(exc):
    raise exc


def _converts(exc):  # torch 1.13's C++ start-up, a C decoder, a file reader's own error
    raise RuntimeError(f"{type(exc).__name__}: {exc.args[0]}\n\nAt:\n  handler") from None


def _drops(exc):  # an extension's start-up on torch 2.x; a library's `except BaseException: pass`
    return None


class _RaisesWhenDropped:
    def __init__(self, exc):
        self.exc = exc

    def __del__(self):
        raise self.exc


def _cannot_raise(exc):  # met where Python cannot raise: a destructor, a weakref callback, the import system's
    _RaisesWhenDropped(exc)  # module-lock cleanup while PyTorch loads; Python hands it to sys.unraisablehook
    return None


LIBRARY = {"passes it on": _passes, "turns it into an error": _converts, "drops it": _drops,
           "meets it where Python cannot raise": _cannot_raise}


def _meets_the_signal(what, signum=signal.SIGTERM):
    """Raise `signum` here, as a library running at this moment meets it, and do `what` with the stop."""
    try:
        signal.raise_signal(signum)
    except BaseException as e:  # noqa: BLE001 (the library under test)
        return LIBRARY[what](e)
    raise AssertionError("the handler did not raise")


@pytest.mark.parametrize("what", list(LIBRARY))
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_while_pytorch_imports_ends_in_one_line(what, signum, code, monkeypatch, capsys, data, tiny):
    real = importlib.import_module

    def import_module(name, *a):
        module = real(name, *a)
        _meets_the_signal(what, signum)
        return module

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    printed = []  # what would reach Python's own hook: a traceback on stderr (seen on a loaded machine)
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    assert cli_main(["train", "--data", str(data), "--epochs", "1", *CPU]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"dlenv train: stopped by {signal.Signals(signum).name} while "
                                            "starting (loading PyTorch); nothing was done")
    assert "Traceback" not in err and "bug in dlenv" not in err
    assert printed == [] and sys.unraisablehook == printed.append  # given back as it was


@pytest.mark.parametrize("verb", ["predict", "val"])
@pytest.mark.parametrize("what", list(LIBRARY))
def test_a_stop_while_decoding_is_never_a_broken_image(verb, what, trained, tmp_path, monkeypatch, capsys, caplog):
    """With --workers 0 the signal lands in the decoder itself: whatever the decoder does with it, the pass
    ends with the stop's one line and 143, no image is called unreadable, no result is written."""
    from dlenv.data import decode

    root, best = trained
    real, opened = decode.open_regular, []

    def open_regular(*a, **k):
        opened.append(a[0])
        if len(opened) == 3:
            _meets_the_signal(what)
        return real(*a, **k)

    monkeypatch.setattr(decode, "open_regular", open_regular)
    where = ["--source", str(root / "ds" / "val"), "--project", str(tmp_path / "p")] if verb == "predict" else \
        ["--data", str(root / "ds" / "val")]
    assert cli_main([verb, "--weights", str(best), *where, "--batch-size", "2", *CPU]) == 143
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"dlenv {verb}: stopped by SIGTERM before it finished"
    assert "unreadable" not in err + caplog.text and "Traceback" not in err
    if LIBRARY[what] not in (_drops, _cannot_raise):  # stopped in the pass: nothing of it written
        assert not list(tmp_path.rglob("predictions.csv")) and not list((best.parent).rglob("metrics.json"))


@pytest.mark.parametrize("what", list(LIBRARY))
def test_a_stop_while_reading_weights_is_never_a_corrupt_file(what, trained, tmp_path, monkeypatch, capsys):
    from dlenv.files import torchfile

    root, best = trained
    real = torchfile.load

    def load(fh):
        _meets_the_signal(what)
        return real(fh)

    monkeypatch.setattr(torchfile, "load", load)
    code = cli_main(["predict", "--weights", str(best), "--source", str(root / "ds" / "val"), "--project",
                     str(tmp_path / "p"), *CPU])
    err = capsys.readouterr().err
    assert code == 143, err
    assert err.strip().splitlines()[-1] == "dlenv predict: stopped by SIGTERM before it finished"
    assert "corrupt" not in err and "Traceback" not in err


@pytest.mark.parametrize("convert", [
    lambda e: RuntimeError("Error calling __set_name__ on 'Field' instance 'archive' in 'UnpackConfig'"),  # 3.10
    lambda e: ImportError("cannot import name 'config'"),
    lambda e: ValueError(f"_Stopped: {e.signum}"),
])
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_converted_while_the_flags_are_read_ends_in_one_line(convert, signum, code, monkeypatch, capsys):
    """A signal while the CLI imports its option declarations (a class being made: Python 3.10 wraps what
    __set_name__ raises in RuntimeError) is the stop's one line, not a traceback."""
    def converted(argv):
        try:
            errors.stop(signum)
        except errors.Stopped as e:
            raise convert(e) from e

    monkeypatch.setattr(cli, "_main", converted)
    assert cli_main(["train"]) == code
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert err == f"dlenv: stopped by {name} while starting (loading PyTorch); nothing was done\n"


def test_an_error_without_a_stop_while_the_flags_are_read_still_propagates(monkeypatch):
    monkeypatch.setattr(cli, "_main", lambda argv: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli_main(["train"])


def test_the_bad_image_rule_never_takes_a_stop_for_a_bad_file():
    samples = [("a.png", 0), ("b.png", 1)]

    def load(i):
        if i == 0:
            _meets_the_signal("turns it into an error")
        return "image"

    known: dict[int, str] = {}
    old = signal.signal(signal.SIGTERM, lambda signum, frame: errors.stop(signum))  # as the CLI's handler
    try:
        with pytest.raises(errors.Stopped):
            badimages.first_readable(0, samples, load, known, "skip")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert known == {}


# ---------------------------------------------------------------------------------------------------
# Real processes, a signal after each of many delays


def _dlenv(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from dlenv.cli import main; sys.exit(main())", *args]


def _commands(root: Path, best: Path) -> dict[str, list[str]]:
    common = ["--batch-size", "2", "--img-size", "32", *CPU]
    return {
        "train": ["train", "--data", str(root / "ds"), "--model", "small_cnn", "--epochs", "3", "--project",
                  str(root / "sweep"), *common],
        "val": ["val", "--weights", str(best), "--data", str(root / "ds" / "val"), *common],
        "predict": ["predict", "--weights", str(best), "--source", str(root / "ds"), "--project",
                    str(root / "sweep-predict"), *common],
    }


def _run(cmd: list[str], delay: float | None, signum: int = signal.SIGTERM) -> tuple[str, int, str]:
    """(what happened, exit status, output) of `cmd` sent `signum` after `delay` seconds (None: not sent).
    What happened: 'finished' when the process had ended before the signal could be sent."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent = False
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signum)
            sent = True
    out, _ = proc.communicate(timeout=600)  # a safety net far above the few seconds each case takes
    return ("signalled" if sent else "finished"), proc.returncode, out


@pytest.mark.slow  # 30 dlenv processes on a CPU
@pytest.mark.parametrize("verb", ["train", "val", "predict"])
def test_a_signal_after_any_delay_ends_the_command_in_one_line(verb, trained):
    root, best = trained
    # the images predict reads on this pass (--source ds: train and val, 36 images) and val's (6)
    cmd = _dlenv(*_commands(root, best)[verb])
    t0 = time.monotonic()
    how, code, out = _run(cmd, None)
    whole = time.monotonic() - t0
    assert code == 0, out
    done = out.strip().splitlines()[-1]
    outcomes = []
    # delays over the command's own run time on this machine now: start-up, imports, the weights, the pass
    for fraction in (0.03, 0.1, 0.2, 0.3, 0.45, 0.55, 0.7, 0.85, 0.95):
        signum = signal.SIGHUP if fraction == 0.55 else signal.SIGTERM
        how, code, out = _run(cmd, whole * fraction, signum)
        lines = out.strip().splitlines()
        case = f"{verb} after {fraction:.0%} of {whole:.1f} s: {how}, exit {code}, last line {lines[-1:]}"
        assert "Traceback" not in out and "bug in dlenv" not in out, case
        assert "unreadable" not in out and "corrupt" not in out, case
        if how == "finished":  # the command was done before the signal: nothing to stop
            assert code == 0, case
            continue
        name = signal.Signals(signum).name
        if code == 0:  # the signal came once the command's work was done and said: it ends as it would have
            assert lines and lines[-1].split()[:2] == done.split()[:2], case
            continue
        if code == -signum:
            # the signal's default action: before dlenv's start (nothing printed) or once the command's work
            # was done and said (the interpreter shutting down): the process ends by the signal all the same
            assert not lines or lines[-1].split()[:2] == done.split()[:2], case
        else:
            assert code == 128 + signum, case
            assert f"stopped by {name}" in lines[-1], case
        outcomes.append(code)
    assert 0 not in outcomes
    assert 143 in outcomes  # at least one landed in dlenv's own hands (the delays span the whole run)
