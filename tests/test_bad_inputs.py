"""Hostile inputs and faults of the machine, for every verb: one line, a non-zero exit, nothing changed.

Each row of a table is one bad input. `_refused` runs it through `dlenv.cli.main` in-process (the
same `run_command` the invoke tasks call, so its one handler is what is tested) and asserts: exit code
not 0, no traceback, exactly one line `dlenv VERB: error: ...` that holds what the row expects, and
the workspace exactly as it was (every path and every file's hash). A few rows run as
`python -m dlenv` subprocesses as well, the most faithful form.

Faults of the machine, and how each is made (we run as root in CI, and chmod does not stop root):
- real: a file where a folder is expected; a name too long; RLIMIT_FSIZE, under which the kernel
  refuses a write past the limit (EFBIG) even for root; a tmpfs in a private mount namespace, full
  (ENOSPC) or remounted read-only (EROFS) - skipped where `unshare` is not allowed;
- simulated in-process: ENOSPC in the middle of a checkpoint write (the file's write() raises), a
  read-only (EROFS) --project and a permission-denied (EACCES) --out (mkdir / mkstemp raise).

The workspace is built once per module: a 2-class dataset, one real 1-step run (resnet18, 32 px), and
a folder of wrong files. Rows must not change it; that is what they assert.
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from imagedata import FillsUpAfter, make_image_folder

from dlenv import cli
from dlenv.files import runstate
from dlenv.options import config

ROOT = Path(__file__).resolve().parents[1]
DATA = ["--data", "ds", "--img-size", "32", "--device", "cpu", "--workers", "0"]  # fast train flags


# ---------------------------------------------------------------------------------------------------
# The workspace and the checks.


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace: ds/ (2 classes), runs/exp/ (a real 1-step run), bad/ (wrong files and checkpoints)."""
    root = tmp_path_factory.mktemp("ws")
    make_image_folder(root / "ds" / "train", per_class=6)
    make_image_folder(root / "ds" / "val", per_class=3, seed=1)
    from dlenv.train import train

    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = config.build(config.TrainConfig, data=str(root / "ds"), img_size=32, epochs=1, batch_size=4,
                           workers=0, device="cpu", max_steps=1, model="resnet18")
        train(cfg)
    finally:
        os.chdir(cwd)
    run = root / "runs" / "exp"
    bad = root / "bad"
    bad.mkdir()
    shutil.copy(run / "results.csv", bad / "results.csv")
    shutil.copy(run / "config.yaml", bad / "config.yaml")  # a run's options away from its checkpoints
    (bad / "notes.txt").write_text("lr was 0.1 on Monday\n")
    (bad / "opts.yaml").write_text("lr: 0.1\nepochs: 3\n")
    (bad / "empty.pth").write_bytes(b"")
    (bad / "cut.pth").write_bytes((run / "best_model.pth").read_bytes()[:4096])
    with zipfile.ZipFile(bad / "other.zip", "w") as zf:
        zf.writestr("readme.txt", "not weights")
    with warnings.catch_warnings():  # 2.9+ calls TorchScript deprecated; it is only a wrong file here
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(bad / "model.torchscript.pt"))
    (bad / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (bad / "broken.yaml").write_text("lr: [0.1\n")
    (bad / "list.yaml").write_text("- lr\n- 0.1\n")
    (bad / "nan.yaml").write_text("lr: .nan\n")
    (bad / "afile").write_text("a file, where a folder is expected\n")
    (bad / "run_typo.yaml").write_text((run / "config.yaml").read_text() + "lrate: 0.1\n")
    shutil.copy(run / "best_model.pth", bad / "old_pruned.pth")
    good = runstate.load_state(run / "last.pth")
    for name, change in {
        "nc5.pth": {"num_classes": 5, "class_names": list("abcde")},  # the head has 2 outputs
        "names3.pth": {"class_names": ["a", "b", "c"]},
        "img_abc.pth": {"img_size": "abc"},
        "epoch_x.pth": {"epoch": "x"},
        "cfg_bad.pth": {"config": {**good["config"], "lr": "fast"}},
    }.items():
        runstate.save_state({**good, **change}, bad / name)
    _weights_attacks(root, bad, good)
    from dlenv.model.models import build_model

    five = build_model("resnet18", 5).state_dict()  # a head of 5 while the data has 2 classes
    runstate.save_state({**good, "model": five, "num_classes": 5, "class_names": list("abcde")},
                               bad / "five" / "last.pth")
    return root


# A model file an attacker ships beside a weights file that names it: importing it would leave RAN
# beside it, and every refused row asserts the workspace unchanged.
_EVIL_MODEL = "import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\ndef build(n):\n    pass\n"


class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _weights_attacks(root: Path, bad: Path, good: dict) -> None:
    """bad/ files for WEIGHTS_ATTACKS."""
    (bad / "x.safetensors").mkdir()  # a folder named like weights
    for rel in ("bad/evil/net.py", "data/pets/net.py"):  # data/: where `unpack` puts what archives hold
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text(_EVIL_MODEL)
    sha = hashlib.sha256(_EVIL_MODEL.encode()).hexdigest()
    for name, ref in {"ref_abs": f"{bad / 'evil' / 'net.py'}:build", "ref_dotdot": "../ws/bad/evil/net.py:build",
                      "ref_data": "data/pets/net.py:build"}.items():
        src = {"ref": ref, "sha256": sha, "args": {}, "file": None}
        for suffix in (".pth", ".safetensors"):
            runstate.save_state({**good, "model_name": ref, "model_source": src}, bad / f"{name}{suffix}")
    runstate.save_state({**good, "model_name": f"{bad / 'evil' / 'net.py'}:build", "model_source": None},
                             bad / "ref_no_source.pth")
    runstate.save_state({**good, "img_size": 100000}, bad / "img_huge.pth")
    runstate.save_state({**good, "img_size": 100000}, bad / "img_huge.safetensors")
    runstate.save_state({**good, "num_classes": 10**9}, bad / "classes_huge.pth")
    torch.save({"model": _System(f"touch {bad / 'RAN'}")}, bad / "system.pth")


_HASHES: dict[tuple, str] = {}  # (path, inode, size, mtime_ns) -> sha256: each version hashed once


def _tree(root: Path) -> dict[str, str]:
    """Every path under root -> the sha256 of its bytes ('dir' for a folder)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            st = os.stat(p)
            key = (p, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in _HASHES:
                _HASHES[key] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            out[os.path.relpath(p, root)] = _HASHES[key]
    return out


def _error_lines(verb: str, out: str, err: str, expect: str) -> str:
    """Assert one `dlenv VERB: error:` line holding `expect` and no traceback; return the line."""
    assert "Traceback" not in out + err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"dlenv {verb}: error:")]
    assert len(lines) == 1, err
    assert err.rstrip("\n").endswith(lines[0]), err  # the error is the last thing said
    assert expect in lines[0], lines[0]
    return lines[0]


def _refused(ws: Path, argv: list[str], expect: str, capsys, monkeypatch) -> str:
    monkeypatch.chdir(ws)
    before = _tree(ws)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code != 0, out + err
    line = _error_lines(argv[0], out, err, expect)
    assert _tree(ws) == before, "a refused command changed the workspace"
    return line


# ---------------------------------------------------------------------------------------------------
# Options and --cfg files (every verb).

OPTIONS = [
    (["train", "--lr", "nan"], "--lr 'nan': expected a finite number"),
    (["train", "--lr", "inf"], "--lr 'inf': expected a finite number"),
    (["train", "--epochs", "inf"], "--epochs 'inf': expected an integer"),
    (["train", "--epochs", "1e400"], "--epochs '1e400': expected an integer"),
    (["train", "--batch-size", "0"], "--batch-size '0'"),
    (["train", "--compile", "maybe"], "--compile 'maybe': expected auto, on or off"),
    (["train", "--compile", ""], "--compile '': expected auto, on or off"),
    (["train", "--cache", "sometimes"], "--cache 'sometimes': expected auto, on or off"),
    (["train", "--decoder", "nvimgcodecs"], "--decoder 'nvimgcodecs' is not one of"),
    (["train", *DATA, "--decoder", "nvimgcodec"], "--decoder nvimgcodec: the device is not a GPU; use --decoder auto"),
    (["train", *DATA, "--decoder", "nvjpeg"], "--decoder nvjpeg: the device is not a GPU; use --decoder auto"),
    (["train", "--checkpoint-ratio", "2"], "--checkpoint-ratio '2': expected 'auto' or a fraction"),
    (["train", "--checkpoint-ratio", "nan"], "--checkpoint-ratio 'nan': expected 'auto' or a fraction"),
    (["train", "--checkpoint-ratio", "-0.5"], "--checkpoint-ratio '-0.5': expected 'auto' or a fraction"),
    (["train", "--checkpoint-ratio", "half"], "--checkpoint-ratio 'half': expected 'auto' or a fraction"),
    (["train", "--cfg", "bad/latin1.yaml"], "is not UTF-8 text (byte 0xe9"),
    (["train", "--cfg", "bad/broken.yaml"], "is not valid YAML"),
    (["train", "--cfg", "bad/list.yaml"], "must hold a mapping of option: value, not a list"),
    (["train", "--cfg", "bad/nan.yaml"], "(set in config file bad/nan.yaml)"),
    (["train", "--cfg", "runs/exp/last.pth"], "bytes, more than the 1,048,576 such a file may have"),
    (["train", "--cfg", "bad/cut.pth"], "is not UTF-8 text"),
    (["train", "--cfg", "/dev/zero"], "config file /dev/zero is a character device, not a regular file"),
    (["train", "--cfg", "ds"], "config file ds is a folder"),
    (["train", "--cfg", "bad/opts.yaml", "--name", ""], "--name '': expected a plain folder name"),
    (["train", "--name", "../elsewhere"], "--name '../elsewhere': expected a plain folder name"),
    (["val", "--batch-size", "nan"], "--batch-size 'nan'"),
    (["val", "--cfg", "bad/latin1.yaml"], "is not UTF-8 text"),
    (["prune", "--amount", "nan"], "--amount 'nan': expected a finite number"),
    (["export", "--opset", "x"], "--opset 'x': expected an integer"),
    (["export", "--format", "pickle"], "--format 'pickle' is not one of"),
    (["plot", "--cfg", "bad/list.yaml"], "must hold a mapping"),
    (["verify-env", "--workers", "x"], "--workers 'x'"),
    (["bench-memory", "--gpu-memory-gib", "nan"], "--gpu-memory-gib 'nan': expected a finite number"),
    (["bench-data", "--workers", "a,b"], "--workers 'a,b'"),
    (["demo-data", "--size", "inf"], "--size 'inf'"),
    (["data-report", "--val-split", "nan"], "--val-split 'nan'"),
    (["unpack", "--max-ratio", "nan"], "--max-ratio 'nan': expected a finite number"),
    # issue 34: numbers that used to start 10,000 processes or reach an allocation of terabytes
    (["train", "--workers", "10000"], "the most worker processes dlenv starts here"),
    (["train", "--batch-size", "1e12"], "--batch-size '1e12' is above its maximum 1,048,576 (2^20 images"),
    (["train", "--batch-size", "1000000000000"], "--batch-size '1000000000000' is above its maximum 1,048,576"),
    (["train", "--effective-batch", "1e12"], "--effective-batch '1e12' is above its maximum 1,048,576"),
    (["train", "--img-size", "1000000"], "--img-size '1000000' is above its maximum 2,048"),
    (["val", "--workers", "10000"], "--workers '10000' is above "),
    (["val", "--batch-size", "1e12"], "--batch-size '1e12' is above its maximum 1,048,576"),
    (["val", "--img-size", "1000000"], "--img-size '1000000' is above its maximum 2,048"),
    (["prune", "--workers", "10000"], "--workers '10000' is above "),
    (["export", "--batch-size", "1e12"], "--batch-size '1e12' is above its maximum"),
    (["bench-data", "--workers", "0,10000"], "--workers '0,10000' is above "),
    (["bench-memory", "--img-size", "1000000"], "--img-size '1000000' is above its maximum 2,048"),
    (["bench-memory", "--num-classes", "100000000"], "--num-classes '100000000' is above its maximum 100,000"),
    (["demo-data", "--size", "1000000"], "--size '1000000' is above its maximum 2,048"),
    (["data-report", "--workers", "10000"], "--workers '10000' is above "),
    (["verify-env", "--workers", "10000"], "--workers '10000' is above "),
    (["train", "--cfg", "bad/run_typo.yaml"], "unknown option 'lrate' in config file bad/run_typo.yaml"),
    # a run's own config.yaml is read by val (its train-only options left out in one line): what stops
    # this row is the checkpoint val was not given
    (["val", "--cfg", "bad/config.yaml"], "--weights is required"),
    (["val", "--cfg", "bad/run_typo.yaml"], "unknown option 'lrate' in config file bad/run_typo.yaml"),
]


@pytest.mark.parametrize(("argv", "expect"), OPTIONS, ids=[" ".join(a) for a, _ in OPTIONS])
def test_bad_options_and_cfg_files(ws, argv, expect, capsys, monkeypatch):
    _refused(ws, argv, expect, capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------
# A wrong file as --weights / --resume, in every verb that reads one.

WRONG_FILES = [
    ("bad/results.csv", "bad/results.csv is a results.csv"),
    ("bad/notes.txt", "bad/notes.txt is a text file"),
    ("bad/opts.yaml", "bad/opts.yaml is a text file"),
    ("bad/empty.pth", "bad/empty.pth is an empty file"),
    ("bad/cut.pth", "bad/cut.pth is truncated or corrupt"),
    ("bad/other.zip", "bad/other.zip is a zip archive"),
    ("bad/model.torchscript.pt", "is a TorchScript model"),
    ("ds", "ds is a folder"),
    ("bad/missing.pth", "missing.pth"),  # "not found", worded per verb
]
VERBS = {  # verb -> the argv before the file
    "val": ["val", "--device", "cpu", "--weights"],
    "prune": ["prune", "--device", "cpu", "--weights"],
    "export": ["export", "--weights"],
    "train --weights": ["train", *DATA, "--weights"],
}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("file", "expect"), WRONG_FILES, ids=[f for f, _ in WRONG_FILES])
def test_wrong_file_as_weights(ws, verb, file, expect, capsys, monkeypatch):
    _refused(ws, [*VERBS[verb], file], expect, capsys, monkeypatch)


@pytest.mark.parametrize(("file", "expect"), [
    *[(f, e) for f, e in WRONG_FILES if f not in ("ds", "bad/missing.pth")],
    ("ds", "--resume ds: no such run file"),  # a folder means its last.pth
    ("bad/missing.pth", "--resume bad/missing.pth: no such run file"),
], ids=[*(f for f, _ in WRONG_FILES if f not in ("ds", "bad/missing.pth")), "ds", "bad/missing.pth"])
def test_wrong_file_as_resume(ws, file, expect, capsys, monkeypatch):
    _refused(ws, ["train", "--resume", file, "--device", "cpu"], expect, capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------
# Checkpoint entries that disagree with the weights or have the wrong type.

ENTRIES = [
    ("nc5.pth", "its metadata says num_classes 5 but its weights' head fc.weight has 2 outputs"),
    ("names3.pth", "it lists 3 class names for num_classes 2"),
    ("img_abc.pth", "its 'img_size' is 'abc', not an image size"),
    ("epoch_x.pth", "its 'epoch' is 'x', not a count of epochs"),
    ("cfg_bad.pth", "its saved training options are not valid (--lr 'fast'"),
]
#: the verbs that open a trained model (all through dlenv.runfolder.trained.open_trained): the same file, the same line
READERS = {"val": ["val", "--device", "cpu"], "prune": ["prune", "--device", "cpu"], "export": ["export"],
           "predict": ["predict", "--device", "cpu", "--workers", "0", "--source", "ds"]}

WEIGHTS_ATTACKS = [  # (file, what the line says): nothing imported or unpickled, the workspace unchanged
    ("bad/x.safetensors", "bad/x.safetensors is a folder"),
    ("bad/system.pth", "refusing to unpickle bad/system.pth: it holds more than tensors and plain data (it names "
                       "the global posix.system"),
    ("bad/ref_abs.pth", "names --model /"),
    ("bad/ref_abs.safetensors", "an absolute path; importing it would run its code, so it is not imported"),
    ("bad/ref_dotdot.pth", "a path that climbs out of the working folder with '..'"),
    ("bad/ref_dotdot.safetensors", "a path that climbs out of the working folder with '..'"),
    ("bad/ref_data.pth", "data/pets/net.py, under data/ where unpacked archives go"),
    ("bad/ref_data.safetensors", "data/pets/net.py, under data/ where unpacked archives go"),
    ("bad/ref_no_source.pth", "but not where it came from (no model_source)"),
    ("bad/img_huge.pth", "its 'img_size' is 100000, not an image size of 16 to 2048 pixels"),
    ("bad/img_huge.safetensors", "its 'img_size' is 100000, not an image size of 16 to 2048 pixels"),
    ("bad/classes_huge.pth", "its 'num_classes' is 1000000000, not an integer from 1 to 100,000"),
]


@pytest.mark.parametrize("verb", list(READERS))
@pytest.mark.parametrize(("file", "expect"), WEIGHTS_ATTACKS, ids=[f for f, _ in WEIGHTS_ATTACKS])
def test_weights_files_that_attack(ws, verb, file, expect, capsys, monkeypatch):
    line = _refused(ws, [*READERS[verb], "--weights", file], expect, capsys, monkeypatch)
    assert "No such device" not in line and not list(ws.rglob("RAN"))


@pytest.mark.parametrize("verb", list(READERS))
@pytest.mark.parametrize(("file", "expect"), ENTRIES, ids=[f for f, _ in ENTRIES])
def test_checkpoint_entries_checked(ws, verb, file, expect, capsys, monkeypatch):
    _refused(ws, [*READERS[verb], "--weights", f"bad/{file}"], expect, capsys, monkeypatch)


@pytest.mark.parametrize(("argv", "expect"), [
    (["train", *DATA, "--weights", "bad/epoch_x.pth"], "its 'epoch' is 'x'"),
    (["train", *DATA, "--weights", "bad/img_abc.pth"], "its 'img_size' is 'abc'"),
    (["train", "--device", "cpu", "--resume", "bad/epoch_x.pth"], "its 'epoch' is 'x'"),
    (["train", "--device", "cpu", "--resume", "bad/cfg_bad.pth"], "--lr 'fast'"),
    # its head has 5 outputs, the data it was trained on has 2 classes (the data changed since)
    (["train", "--device", "cpu", "--workers", "0", "--resume", "bad/five/last.pth"],
     "bad/five/last.pth does not match this model (0 missing, 0 unexpected keys, 2 of another shape"),
], ids=["weights-epoch", "weights-img-size", "resume-epoch", "resume-config", "resume-head"])
def test_checkpoint_entries_checked_by_train(ws, argv, expect, capsys, monkeypatch):
    _refused(ws, argv, expect, capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------
# Outputs that cannot be written: a file where a folder is expected, a folder where a file is.

OUTPUTS = [
    (["val", "--device", "cpu", "--weights", "runs/exp/best_model.pth", "--out", "bad/afile"],
     "--out bad/afile is a file, not a folder"),
    (["val", "--device", "cpu", "--weights", "runs/exp/best_model.pth", "--out", "bad/afile/val"],
     "bad/afile is a file, so nothing can be written under it"),
    (["export", "--weights", "runs/exp/best_model.pth", "--out", "bad/afile/m.onnx"],
     "bad/afile is a file, so nothing can be written under it"),
    (["export", "--weights", "runs/exp/best_model.pth", "--out", "bad"], "--out bad is a folder"),
    (["prune", "--device", "cpu", "--weights", "runs/exp/best_model.pth", "--out", "bad/afile/p.pth"],
     "bad/afile is a file"),
    (["prune", "--device", "cpu", "--weights", "runs/exp/best_model.pth", "--out", "runs/exp/best_model.pth"],
     "is the input file"),
    # a run's own files: its resume state, history and options are not an output's to replace
    (["prune", "--device", "cpu", "--weights", "runs/exp/best_model.pth", "--out", "runs/exp/last.pth"],
     "would replace the last.pth of the run in runs/exp"),
    (["export", "--weights", "runs/exp/last.pth", "--out", "runs/exp/best_model.pth"],
     "would replace the best_model.pth of the run"),
    (["export", "--weights", "runs/exp/best_model.pth", "--out", "runs/exp/results.csv"],
     "would replace the results.csv of the run"),
    (["export", "--format", "torchscript", "--weights", "runs/exp/best_model.pth", "--out", "runs/exp/config.yaml"],
     "would replace the config.yaml of the run"),
    (["train", *DATA, "--project", "bad/afile"], "cannot create --project folder bad/afile"),
    (["train", *DATA, "--project", "bad/afile/runs"], "cannot create --project folder bad/afile/runs"),
    (["train", *DATA, "--name", "x" * 300], "is too long for the file system"),
    (["demo-data", "--dest", "bad/afile/demo"], "bad/afile"),
    (["plot", "--log-dir", "bad/afile"], "--log-dir bad/afile is a file, not a folder"),
    (["data-report", "bad/afile"], "dataset bad/afile is not a folder"),
    (["bench-data", "--data", "bad/afile"], "--data bad/afile is a file, not a folder"),
    (["unpack", "bad/notes.txt"], "bad/notes.txt is not an archive"),
]


@pytest.mark.parametrize(("argv", "expect"), OUTPUTS, ids=[" ".join(a[:1] + a[-2:])[:60] for a, _ in OUTPUTS])
def test_outputs_that_cannot_be_written(ws, argv, expect, capsys, monkeypatch):
    _refused(ws, argv, expect, capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------
# Faults of the machine, simulated in-process.


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_write_keeps_the_old_file(ws, capsys, monkeypatch):
    """ENOSPC after 64 KiB of prune's checkpoint write: one line naming it, the old file intact."""
    from dlenv.files import atomic

    real_open = open


    # the one atomic writer opens the checkpoint's temporary file: a file system that fills up under it
    monkeypatch.setattr(atomic, "open", lambda f, mode="r", *a, **kw: (  # writes only: it also reads the umask
        FillsUpAfter(real_open(f, mode, *a, **kw), 64 * 1024) if "w" in mode else real_open(f, mode, *a, **kw)),
        raising=False)
    from dlenv.compress import common

    monkeypatch.setattr(common, "cpu_latencies",  # not measured here
                        lambda models, *a, **kw: [common.Latency(1.0, 1.0, 1.0, 1)] * len(models))
    line = _refused(ws, ["prune", "--device", "cpu", "--workers", "0", "--weights", "runs/exp/best_model.pth",
                         "--out", "bad/old_pruned.pth"], "no space left on the device holding bad/old_pruned.pth",
                    capsys, monkeypatch)
    assert "df -h bad" in line


def test_read_only_project_folder(ws, capsys, monkeypatch):
    """EROFS from creating the run folder (as a read-only mount gives): one line, nothing written."""
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if "runs" in self.parts and self.name != "runs" and not self.exists():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    _refused(ws, ["train", *DATA, "--epochs", "1", "--max-steps", "1"],
             "runs/exp2 is on a read-only file system (Read-only file system); mount it read-write", capsys,
             monkeypatch)


def test_permission_denied_for_reports(ws, capsys, monkeypatch):
    """EACCES creating val's report files (a folder owned by someone else): one line naming the file."""
    import tempfile

    def mkstemp(*a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "x")

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    _refused(ws, ["val", "--device", "cpu", "--workers", "0", "--weights", "runs/exp/best_model.pth",
                  "--out", "bad"], "permission denied for bad/metrics.json", capsys, monkeypatch)


@pytest.mark.parametrize("argv", [
    ["predict", "--device", "cpu", "--workers", "0", "--json", "--weights", "runs/exp/best_model.pth", "--source",
     "ds/val", "--project", "bad/p"],
    ["val", "--device", "cpu", "--workers", "0", "--weights", "runs/exp/best_model.pth", "--out", "bad/val"],
    ["export", "--weights", "runs/exp/best_model.pth", "--format", "torchscript", "--out", "bad/m.pt"],
    ["prune", "--device", "cpu", "--workers", "0", "--weights", "runs/exp/best_model.pth", "--out", "bad/p.pth"],
], ids=["predict", "val", "export", "prune"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_the_work(ws, argv, capsys, monkeypatch):
    """A folder this process may not write in (a read-only mount, someone else's folder) is the fault's one line
    before any image is read: predict --json --project RO used to predict every image, then fail."""
    import dlenv.data.loaders as loaders
    from dlenv.files import atomic

    real = os.access
    monkeypatch.setattr(atomic.os, "access", lambda p, mode: Path(p).name != "bad" and real(p, mode))
    for name in ("build_eval_loader", "build_loaders"):  # nothing is read before the line
        monkeypatch.setattr(loaders, name, lambda *a, **kw: pytest.fail("read images before refusing the output"))
    import dlenv.predict

    monkeypatch.setattr(dlenv.predict, "run", lambda *a, **kw: pytest.fail("predicted before refusing the output"))
    line = _refused(ws, argv, "permission denied for bad", capsys, monkeypatch)
    assert "(--project / --out)" in line


# ---------------------------------------------------------------------------------------------------
# Faults of the machine, real.


@pytest.mark.slow
def test_file_size_limit_mid_checkpoint_write_is_one_line(ws, tmp_path):
    """RLIMIT_FSIZE: the kernel refuses the checkpoint write past 1 MiB (EFBIG), even for root."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    project = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "dlenv", "train", *DATA, "--epochs", "1", "--max-steps", "1",
                        "--batch-size", "4", "--project", str(project)], cwd=ws, env=env, capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 5, r.stderr
    _error_lines("train", r.stdout, r.stderr, "last.pth would grow past the largest file allowed here")
    left = sorted(p.name for p in (project / "exp").iterdir())
    assert not [n for n in left if n.endswith(".tmp")], left  # the half-written file is gone
    assert "last.pth" not in left and "config.yaml" in left


def _namespace_prefix() -> list[str] | None:
    """A command prefix that runs in a private mount namespace where tmpfs can be mounted, or None."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        r = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True)
        if r.returncode == 0:
            return prefix
    return None


@pytest.mark.slow
@pytest.mark.parametrize(("mount", "expect"), [
    ("size=3m", "no space left on the device holding {p}/exp/last.pth"),
    ("ro", "{p}/exp is on a read-only file system"),
], ids=["full-disk", "read-only"])
def test_real_full_and_read_only_project(ws, tmp_path, mount, expect):
    """A real tmpfs as --project, 3 MiB (the checkpoint does not fit) or read-only: one line each."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare not allowed)")
    project = tmp_path / "runs"
    project.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    train = [sys.executable, "-m", "dlenv", "train", *DATA, "--epochs", "1", "--max-steps", "1",
             "--batch-size", "4", "--project", str(project)]
    opts = "size=3m" if mount != "ro" else "size=3m,ro"
    script = f'mount -t tmpfs -o {opts} tmpfs "$1" && shift && exec "$@"'
    r = subprocess.run([*prefix, "sh", "-c", script, "sh", str(project), *train], cwd=ws, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 5, r.stderr
    _error_lines("train", r.stdout, r.stderr, expect.format(p=project))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["full-disk", "file-size-limit"])
def test_a_safetensors_export_that_cannot_be_written_is_one_line(ws, tmp_path, fault):
    """safetensors writes through Rust, whose I/O error is no OSError: it was a traceback (issue 43)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    export = [sys.executable, "-m", "dlenv", "export", "--weights", "runs/exp/best_model.pth", "--format",
              "safetensors", "--out", str(out / "w.safetensors")]
    if fault == "full-disk":
        prefix = _namespace_prefix()
        if prefix is None:
            pytest.skip("no private mount namespace here (unshare not allowed)")
        script = 'mount -t tmpfs -o size=1m tmpfs "$1" && shift && exec "$@"'
        r = subprocess.run([*prefix, "sh", "-c", script, "sh", str(out), *export], cwd=ws, env=env,
                           capture_output=True, text=True, timeout=300)
        expect = f"no space left on the device holding {out}/w.safetensors"
    else:
        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

        r = subprocess.run(export, cwd=ws, env=env, capture_output=True, text=True, preexec_fn=limit, timeout=300)
        expect = f"{out}/w.safetensors would grow past the largest file allowed here"
    assert r.returncode == 5, r.stderr
    _error_lines("export", r.stdout, r.stderr, expect)
    assert not list(out.iterdir())  # no half-written file, no temporary one


# ---------------------------------------------------------------------------------------------------
# The same handler as subprocesses and as invoke tasks.


@pytest.mark.parametrize(("argv", "expect"), [
    (["val", "--weights", "bad/results.csv"], "bad/results.csv is a results.csv"),
    (["train", "--lr", "nan"], "--lr 'nan'"),
    (["train", "--cfg", "bad/latin1.yaml"], "is not UTF-8 text"),
], ids=["val-results-csv", "train-lr-nan", "train-cfg-latin1"])
def test_as_a_subprocess(ws, argv, expect):
    before = _tree(ws)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "dlenv", *argv], cwd=ws, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    _error_lines(argv[0], r.stdout, r.stderr, expect)
    assert _tree(ws) == before


def test_invoke_task_goes_through_the_same_handler(ws, capsys, monkeypatch):
    from invoke import MockContext
    from invoke.exceptions import Exit

    from dlenv import tasks

    monkeypatch.chdir(ws)
    fields = config.options(config.ValConfig)
    kwargs = {f.name: (f.default if isinstance(f.default, bool) else None) for f in fields}
    with pytest.raises(Exit) as exc:
        tasks.ns["val"](MockContext(), **{**kwargs, "weights": "bad/notes.txt", "cfg": None})
    assert exc.value.code == 2
    _error_lines("val", *capsys.readouterr(), "bad/notes.txt is a text file")


# ---------------------------------------------------------------------------------------------------
# Two runs in one folder.


def test_second_run_in_a_locked_folder_is_refused_until_the_first_dies(ws, capsys, monkeypatch):
    """A run holds runs/exp (another process here); `train --name exp --exist-ok` is one line, and once
    the holder is killed with -9 the kernel has released the lock."""
    code = ("import sys, time; from dlenv import runfolder; lock = runfolder.lock_run_dir(sys.argv[1]); "
            "print('held', flush=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", code, str(ws / "runs" / "exp")], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = _refused(ws, ["train", *DATA, "--name", "exp", "--exist-ok"],
                        f"runs/exp is in use by another run (process {holder.pid})", capsys, monkeypatch)
        assert "pass another --name" in line
    finally:
        holder.kill()
        holder.wait()
    from dlenv import runfolder

    lock = runfolder.lock_run_dir(ws / "runs" / "exp")  # free again: taken without waiting
    lock.release()


# ---------------------------------------------------------------------------------------------------
# --resume over a results.csv with corrupt lines: a documented recovery that loses nothing.


def test_resume_over_a_corrupt_results_csv_keeps_every_byte(ws, tmp_path, capsys, monkeypatch, caplog):
    run = tmp_path / "exp"
    shutil.copytree(ws / "runs" / "exp", run)
    good = (run / "results.csv").read_bytes()
    corrupt = good + b"x,0.5,0.6\n" + b"2,\xff\xfe,broken\n" + b"\x00\x13\x37\x00\n"
    (run / "results.csv").write_bytes(corrupt)
    monkeypatch.chdir(ws)
    with caplog.at_level("WARNING"):  # a warning on stderr outside pytest
        code = cli.main(["train", "--resume", str(run / "last.pth"), "--device", "cpu", "--workers", "0"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in out + err, err
    assert "3 line(s) could not be read (line 3, 4, 5) and are left out" in caplog.text
    assert (run / "results.csv").read_bytes() == good  # the good row, as it was
    kept = list(run.glob("results.csv.before-resume-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == corrupt and kept[0].name in caplog.text
