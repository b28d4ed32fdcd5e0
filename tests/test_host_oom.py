"""Out of host memory (RAM) is one line, as CUDA's out-of-memory is (issue 44 item 4): what failed, the
batch that did it and what to try, exit 3, no traceback, no "bug in dlenv"; through the CLI's one handler
for every verb and through the trainer's step (whose batch is the state's, not the flag's)."""

from __future__ import annotations

import errno

import pytest

from dlenv import cli, errors
from dlenv.errors import EXIT_FAULT, EXIT_OOM, host_memory_line, host_memory_short

# torch's CPU allocator, as 1.13.1 and 2.x raise it (measured: torch.empty(2**50, dtype=torch.uint8))
ALLOC_113 = ("[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
             "to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")
ALLOC_2X = ALLOC_113.replace("alloc_cpu.cpp:75", "alloc_cpu.cpp:127")
# as a DataLoader worker's failure comes back to the main process (torch's ExceptionWrapper.reraise)
IN_WORKER = ("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
             '  File "x.py", line 1, in f\nRuntimeError: ' + ALLOC_2X)


def _numpy_memory_error() -> BaseException:
    np = pytest.importorskip("numpy")
    try:
        np.empty(2 ** 60, dtype=np.uint8)
    except MemoryError as e:
        return e
    pytest.skip("NumPy allocated 1 EiB")


HOST_OOMS = [
    ("torch-1.13", lambda: RuntimeError(ALLOC_113), "could not allocate 2.00 GiB"),
    ("torch-2.x", lambda: RuntimeError(ALLOC_2X), "could not allocate 2.00 GiB"),
    ("in-a-worker", lambda: RuntimeError(IN_WORKER), "could not allocate 2.00 GiB"),
    ("windows", lambda: RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes"),
     "could not allocate 64 bytes"),
    ("MiB", lambda: RuntimeError(ALLOC_2X.replace("2147483648", "50331648")), "could not allocate 48 MiB"),
    ("MemoryError", lambda: MemoryError(), "an allocation failed"),
    ("numpy", _numpy_memory_error, "an allocation failed"),
]


def _some(*names: str) -> list[tuple]:
    return [c for c in HOST_OOMS if c[0] in names]


@pytest.mark.parametrize(("make", "what"), [c[1:] for c in HOST_OOMS], ids=[c[0] for c in HOST_OOMS])
def test_the_host_running_out_of_memory_is_known(make, what):
    assert host_memory_short(make()) == what
    outer = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    outer.__cause__ = make()
    assert host_memory_short(outer) == what  # also as the cause of another error


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # CUDA's has its own line (memory.oom_message)
    RuntimeError("size mismatch"), ValueError("can't allocate memory"), OSError(errno.ENOMEM, "x"),
    RuntimeError("[enforce fail at inline_container.cc:325] . unexpected pos 320 vs 248"),
])
def test_other_errors_are_not_the_host_out_of_memory(exc):
    assert host_memory_short(exc) is None and host_memory_line(exc, 64) is None


@pytest.mark.parametrize(("sizes", "said", "tries"), [
    (dict(batch_size=512, img_size=224, workers=8, accum_steps=1), "at batch size 512, image size 224, 8 workers",
     ["1) --batch-size 256 --accum-steps 2", "2) --workers 4", "3) a smaller --img-size", "4) give the container"]),
    (dict(batch_size=64, img_size=None, workers="auto"), "at batch size 64;",
     ["1) --batch-size 32;", "2) give the container more memory (docker run --memory"]),
    (dict(batch_size=1, img_size=16, workers=0), "at batch size 1, image size 16, 0 workers;",
     ["1) give the container"]),
    ({}, "could not allocate 2.00 GiB;", ["1) give the container"]),
])
def test_the_line_names_the_sizes_and_what_to_try_in_order(sizes, said, tries):
    line = host_memory_line(RuntimeError(ALLOC_2X), **sizes)
    assert line.startswith("out of host memory (RAM): could not allocate 2.00 GiB") and "\n" not in line
    assert said in line and all(t in line for t in tries), line


# ---------------------------------------------------------------------------------------------------
# Through the CLI: every verb's failure ends in cli.run_command.


def _boom(exc):
    def run(cfg):
        raise exc
    return run


def _files_named(folder, monkeypatch):
    """The files the flags below name, in `folder` made the working folder (paths are checked early)."""
    monkeypatch.chdir(folder)
    for name in ("w.pth", "x.png"):
        (folder / name).write_bytes(b"x")


CLI_CASES = ("torch-1.13", "torch-2.x", "in-a-worker", "MemoryError")  # (in HOST_OOMS's order)
# verb, what runs it, its flags, the batch size the line must name
VERBS = [
    ("val", "dlenv.evaluate.main", ["--weights", "w.pth", "--batch-size", "96", "--workers", "3"], "96"),
    ("predict", "dlenv.predict.main", ["--weights", "w.pth", "--source", "x.png", "--batch-size", "40"], "40"),
    ("bench-data", "dlenv.bench.data.main", ["--batch-size", "256", "--img-size", "224"], "256"),
    ("export", "dlenv.compress.export_main", ["--weights", "w.pth", "--batch-size", "16"], "16"),
]


@pytest.mark.parametrize(("make", "what"), [c[1:] for c in _some(*CLI_CASES)], ids=CLI_CASES)
@pytest.mark.parametrize(("verb", "target", "flags", "batch"), VERBS, ids=[v[0] for v in VERBS])
def test_every_verb_says_the_host_ran_out_in_one_line_and_exit_3(tmp_path, monkeypatch, capsys, verb, target, flags,
                                                                 batch, make, what):
    _files_named(tmp_path, monkeypatch)
    monkeypatch.setattr(target, _boom(make()))
    assert cli.main([verb, *flags]) == EXIT_OOM
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "bug in dlenv" not in err, err
    assert err.startswith(f"dlenv {verb}: error: out of host memory (RAM): {what} at batch size {batch}")
    assert f"--batch-size {int(batch) // 2}" in err


def test_a_worker_killed_by_the_system_names_the_batch_and_stays_a_fault(tmp_path, monkeypatch, capsys):
    _files_named(tmp_path, monkeypatch)
    outer = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    outer.__cause__ = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    monkeypatch.setattr("dlenv.evaluate.main", _boom(outer))
    assert cli.main(["val", "--weights", "w.pth", "--batch-size", "96", "--workers", "3"]) == EXIT_FAULT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "bug in dlenv" not in err
    assert "killed by the system at batch size 96, 3 workers (SIGKILL; out of host memory?" in err
    assert errors.environment_fault(outer) is not None and " at " not in errors.environment_fault(outer)[:60]


# ---------------------------------------------------------------------------------------------------
# Through the trainer: its step fails, the line names the micro-batch and the last good checkpoint.


@pytest.mark.parametrize(("make", "what"), [c[1:] for c in _some("torch-2.x", "in-a-worker", "MemoryError")],
                         ids=["torch-2.x", "in-a-worker", "MemoryError"])
def test_train_says_the_host_ran_out_at_its_micro_batch(tmp_path, data, tiny, monkeypatch, capsys, make, what):
    pytest.importorskip("torch")
    from dlenv.train import loop

    real = loop.forward_backward

    def fb(parts, *a, **k):
        if parts.scheduler.last_epoch >= 4:  # after the first epoch's checkpoint
            raise make()
        return real(parts, *a, **k)

    monkeypatch.setattr(loop, "forward_backward", fb)
    code = cli.main(["train", "--data", str(data), "--project", str(tmp_path / "runs"), "--model", "tiny",
                     "--optimizer", "sgd", "--img-size", "16", "--batch-size", "4", "--accum-steps", "1",
                     "--workers", "0", "--epochs", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == EXIT_OOM, err
    assert err.count("\n") == 1 and "Traceback" not in err and "bug in dlenv" not in err, err
    assert err.startswith(f"dlenv train: error: out of host memory (RAM): {what} at batch size 4, image size 16")
    assert "--batch-size 2 --accum-steps 2" in err
    assert f"The last good run file is {tmp_path / 'runs' / 'exp' / 'last.pth'}." in err


def test_a_peer_error_is_not_confused_with_the_host_out_of_memory():
    pytest.importorskip("torch")
    from dlenv.cluster import distributed

    assert not distributed.is_peer_error(RuntimeError(ALLOC_2X))  # both say "[enforce fail at"
    assert distributed.is_peer_error(RuntimeError("[enforce fail at ProcessGroupGloo.cpp:1] Connection closed by peer"))


# ---------------------------------------------------------------------------------------------------
# While decoding: memory exhausted is the machine, never a bad image (issue 52 item 5). Every skipper of
# unreadable images asks badimages.bad_image_reason, which raises it again.

DECODE_OOMS = _some("torch-2.x", "in-a-worker", "MemoryError", "numpy")


@pytest.mark.parametrize("bad_images", ["skip", "error"])
@pytest.mark.parametrize(("make", "what"), [c[1:] for c in DECODE_OOMS], ids=[c[0] for c in DECODE_OOMS])
def test_a_decode_that_runs_out_of_memory_is_not_a_bad_image(make, what, bad_images):
    from dlenv.data import badimages

    exc = make()

    def load(i):
        raise exc

    known = badimages.KnownBad()
    with pytest.raises(type(exc)) as got:
        badimages.first_readable(0, [("a.jpg", 0), ("b.jpg", 1)], load, known, bad_images)
    assert got.value is exc and not known  # raised as it was, and no file was marked bad
    assert host_memory_short(got.value) == what


@pytest.mark.parametrize("exc", [OSError("image file is truncated"), ValueError("bad marker"),
                                 RuntimeError("size mismatch"), OSError(errno.ENOMEM, "x")])
def test_a_decoder_error_is_still_a_bad_image(exc):
    from dlenv.data import badimages

    def load(i):
        raise exc

    with pytest.raises(badimages.BadImageError, match="no other image in the dataset decodes"):
        badimages.first_readable(0, [("a.jpg", 0), ("b.jpg", 1)], load, badimages.KnownBad(), "skip")


def _pil_out_of_memory(monkeypatch, make):
    def no_memory(*a, **k):
        raise make()
    monkeypatch.setattr("PIL.Image.open", no_memory)


@pytest.mark.parametrize(("make", "what"), [c[1:] for c in DECODE_OOMS], ids=[c[0] for c in DECODE_OOMS])
def test_data_report_check_says_out_of_memory_not_cannot_decode(tmp_path, monkeypatch, make, what):
    from imagedata import make_image_folder

    from dlenv.data import report

    make_image_folder(tmp_path, classes=("cat",), per_class=1)
    path = next(tmp_path.rglob("*.png"), None) or next(p for p in tmp_path.rglob("*") if p.is_file())
    _pil_out_of_memory(monkeypatch, make)
    with pytest.raises(Exception) as got:  # noqa: PT011 (each kind of its own type)
        report.decode_problem(str(path))
    assert host_memory_short(got.value) == what


@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize(("make", "what"), [c[1:] for c in _some("MemoryError", "torch-2.x")],
                         ids=["MemoryError", "torch-2.x"])
def test_val_out_of_memory_while_decoding_is_exit_3(tmp_path, monkeypatch, capsys, make, what, workers):
    pytest.importorskip("torch")
    from imagedata import make_image_folder
    from test_evaluate import _dlenv_ckpt

    make_image_folder(tmp_path / "ds", classes=("cat", "dog", "fox"), per_class=2, size=(20, 20))
    weights = _dlenv_ckpt(tmp_path / "runs" / "exp" / "best_model.pth")
    _pil_out_of_memory(monkeypatch, make)  # workers fork: they inherit it
    code = cli.main(["val", "--weights", str(weights), "--data", str(tmp_path / "ds"), "--workers", workers,
                     "--batch-size", "4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == EXIT_OOM, err
    assert err.count("\n") == 1 and "Traceback" not in err and "could not be decoded" not in err, err
    assert err.startswith(f"dlenv val: error: out of host memory (RAM): {what} at batch size 4"), err
