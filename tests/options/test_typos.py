"""Typos get the right name (dlenv.options.typos, dlenv.cli, dlenv.tasks, dlenv.pathcheck, dlenv.model.modelnames):
a flag, a verb, a choice, a model name, a number given as a percentage, a run file's name or a dataset's split
for its root is answered in one line with the closest right word, and a flag or verb also with the usage of the
command as typed (`python train.py`, `dlenv train`, `invoke train`); exit 2, no traceback, and PyTorch never
loaded for any of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv.errors import UserError
from dlenv.model import modelnames
from dlenv.options import typos

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


@pytest.fixture
def ws(tmp_path):
    """A project: data/digits (train/, val/), runs/exp with its run files, a weights file of its own."""
    for split in ("train", "val"):
        (tmp_path / "data" / "digits" / split / "a").mkdir(parents=True)
    (tmp_path / "runs" / "exp").mkdir(parents=True)
    for name in ("best_model.pth", "last.pth"):
        (tmp_path / "runs" / "exp" / name).write_bytes(b"x")
    (tmp_path / "my_model.pth").write_bytes(b"x")
    (tmp_path / "w.pth").write_bytes(b"x")
    return tmp_path


# a script of the template passes its verb itself: main(["train", ...]) as `python train.py`
SCRIPT_FLAGS = [  # (what follows `python train.py`, the words of the line)
    (["--epoch", "1"], "did you mean --epochs?"),
    (["--epochz", "2"], "did you mean --epochs?"),
    (["--checkpiont"], "did you mean --checkpoint?"),
    (["--chekpoint"], "did you mean --checkpoint?"),
    (["--batch_size", "8"], "did you mean --batch-size?"),
    (["--Batch-Size", "8"], "did you mean --batch-size?"),
    (["--batchsize", "8"], "did you mean --batch-size?"),
    (["--lr0", "0.1"], "did you mean --lr?"),
    (["--imgsz", "64"], "did you mean --img-size?"),
    (["--amp-dtyp", "bf16"], "did you mean --amp-dtype?"),
    (["--wokers", "2"], "did you mean --workers?"),
    (["--reume", "auto"], "did you mean --resume?"),
    (["--pretraind"], "did you mean --pretrained?"),
    (["--weight", "w.pth"], "did you mean --weights?"),
    (["--dataset", "data/digits"], "did you mean --data?"),
    (["--epochs"], "argument --epochs: expected one argument"),
]
VERB_FLAGS = [  # (dlenv argv, the words of the line)
    (["val", "--weigths", "w.pth"], "did you mean --weights?"),
    (["predict", "--sorce", "x.png"], "did you mean --source?"),
    (["prune", "--method", "l1"], "prune ranks weights by their L1 magnitude"),
    (["export", "--formatt", "onnx"], "did you mean --format?"),
    (["plot", "--logdir", "runs"], "did you mean --log-dir?"),
    (["unpack", "a.zip", "--overwirte"], "did you mean --overwrite?"),
    (["bench-memory", "--modle", "resnet18"], "did you mean --model?"),
    (["val", "--no-amps"], "did you mean --no-amp?"),
]
VERBS = [(["trian"], "train"), (["tarin"], "train"), (["vall"], "val"), (["predcit"], "predict"),
         (["verify_env"], "verify-env"), (["expor"], "export"), (["bench-mem"], "bench-memory"),
         (["unpak", "a.zip"], "unpack"), (["Train"], "train")]
VALUES = [  # value errors: one line, no usage (dlenv argv, the words of the line)
    (["export", "--weights", "w.pth", "--format", "onx"], "did you mean onnx?"),
    (["export", "--weights", "w.pth", "--format", "ONNX"], "did you mean onnx?"),
    (["train", "--decoder", "pill"], "did you mean pil?"),
    (["train", "--augment", "standrad"], "did you mean standard?"),
    (["train", "--bad-images", "skpi"], "did you mean skip?"),
    (["val", "--weights", "w.pth", "--precision", "fp61"], "did you mean fp16?"),
    (["predict", "--weights", "w.pth", "--source", "w.pth", "--tta", "flp"], "did you mean flip?"),
    (["train", "--model", "resnet-18"], "did you mean resnet18"),
    (["train", "--model", "ResNet50"], "did you mean resnet50"),
    (["train", "--model", "vit-b-16"], "did you mean vit_b_16"),
    (["train", "--model", "mobilenetv2"], "did you mean mobilenet_v2"),
    (["train", "--model", "convnext-tiny"], "did you mean convnext_tiny"),
    (["train", "--model", "resnet50_pretrained"], "use --model resnet50 --pretrained"),
    (["bench-memory", "--model", "efficientnet-b0"], "did you mean efficientnet_b0"),
    (["val", "--weights", "w.pth", "--model", "resnet-18"], "did you mean resnet18"),
    (["prune", "--weights", "w.pth", "--amount", "30"], "30 is outside (0, 1); as a share, 30% is 0.3"),
    (["prune", "--weights", "w.pth", "--amount", "0"], "0 is outside (0, 1)"),
    (["prune", "--weights", "w.pth", "--amount", "-0.2"], "-0.2 is outside (0, 1)"),
    (["prune", "--weights", "w.pth", "--amount", "1"], "1 is outside (0, 1)"),
    (["val", "--weights", "best_modle.pth"], "did you mean best_model.pth? (the newest run's is "
                                             "runs/exp/best_model.pth)"),
    (["predict", "--weights", "bestmodel.pth", "--source", "w.pth"], "did you mean best_model.pth?"),
    (["prune", "--weights", "lastt.pth"], "did you mean last.pth? (the newest run's is runs/exp/last.pth)"),
    (["export", "--weights", "best_model.pt"], "did you mean best_model.pth?"),
    (["val", "--weights", "my_modle.pth"], "did you mean my_model.pth?"),  # the folder's own is nearer
    (["train", "--data", "./dataset/val"], "did you mean data/digits? (--data takes the dataset root"),
    (["train", "--data", "dataset/train"], "did you mean data/digits? (--data takes the dataset root"),
    (["val", "--weights", "w.pth", "--data", "../images/val"], "did you mean data/digits?"),
    (["train", "--data", "data/digts/val"], "did you mean data/digits/val?"),  # a near path of its own
]


def _drive(ws: Path, argv0: str, cases: list[list[str]]) -> tuple[list[tuple[int, str]], bool]:
    """cli.main of each case in one fresh Python started as `argv0`: [(exit status, stderr)], torch imported?"""
    code = ("import json, sys\nsys.argv[0] = sys.argv.pop(1)\nfrom dlenv.cli import main\n"
            "for line in sys.stdin.read().splitlines():\n"
            "    try:\n        rc = main(json.loads(line))\n    except SystemExit as e:\n        rc = e.code\n"
            "    print(rc, flush=True)\n    sys.stderr.write('\\n---\\n'); sys.stderr.flush()\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    r = subprocess.run([sys.executable, "-c", code, argv0], cwd=ws, input="\n".join(json.dumps(c) for c in cases),
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    codes = [int(line) for line in r.stdout.splitlines() if line.lstrip("-").isdigit()]
    errors = [e.strip() for e in r.stderr.split("\n---\n")][: len(cases)]
    assert len(codes) == len(cases), r.stdout + r.stderr
    return list(zip(codes, errors, strict=False)), r.stdout.splitlines()[-1] == "torch imported"


def _usage(err: str) -> str:
    return err.splitlines()[-1]


def test_flag_typos_of_the_template_script_name_the_flag_and_its_usage(ws):
    results, torch = _drive(ws, "train.py", [["train", *argv] for argv, _ in SCRIPT_FLAGS])
    assert not torch
    for (argv, expect), (rc, err) in zip(SCRIPT_FLAGS, results, strict=False):
        assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 2, (argv, err)
        assert err.startswith("dlenv train: error: ") and expect in err.splitlines()[0], (argv, err)
        assert _usage(err) == "usage: python train.py [options]; python train.py --help lists them", (argv, err)


def test_flag_typos_of_a_verb_name_the_flag_and_its_usage(ws):
    results, torch = _drive(ws, "/usr/local/bin/dlenv", [argv for argv, _ in VERB_FLAGS])
    assert not torch
    for (argv, expect), (rc, err) in zip(VERB_FLAGS, results, strict=False):
        assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 2, (argv, err)
        assert expect in err.splitlines()[0] and _usage(err) == f"usage: dlenv {argv[0]} [options]; dlenv " \
            f"{argv[0]} --help lists them", (argv, err)


def test_a_verb_typo_names_the_verb(ws):
    results, torch = _drive(ws, "/usr/local/bin/dlenv", [argv for argv, _ in VERBS])
    assert not torch
    for (argv, verb), (rc, err) in zip(VERBS, results, strict=False):
        assert rc == 2 and "Traceback" not in err, (argv, err)
        assert err.splitlines()[0] == f"dlenv: error: {argv[0]!r} is not a verb; did you mean {verb}?", (argv, err)
        assert _usage(err) == "usage: dlenv VERB [options]; dlenv --help lists the verbs"


def test_values_are_answered_in_one_line_before_pytorch_loads(ws):
    results, torch = _drive(ws, "/usr/local/bin/dlenv", [argv for argv, _ in VALUES])
    assert not torch, "a value that needs no PyTorch was checked after it loaded"
    for (argv, expect), (rc, err) in zip(VALUES, results, strict=False):
        assert rc == 2 and len(err.splitlines()) == 1 and expect in err, (argv, err)


def _invoke(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HOME": str(folder)}  # no ~/.invoke.yaml
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "invoke", *argv], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, line, usage", [
    (["train", "--epoch", "1"], "dlenv train: error: unrecognized arguments: --epoch; did you mean --epochs?",
     "usage: invoke train [options]; invoke train --help lists them"),
    (["train", "--checkpiont"], "dlenv train: error: unrecognized arguments: --checkpiont; did you mean "
                                "--checkpoint?", "usage: invoke train [options]; invoke train --help lists them"),
    (["prune", "--method", "l1"], "prune ranks weights by their L1 magnitude",
     "usage: invoke prune [options]; invoke prune --help lists them"),
    (["trian"], "invoke: error: 'trian' is not a verb; did you mean train?",
     "usage: invoke VERB [options]; invoke --list lists the verbs"),
])
def test_invoke_answers_typos_as_dlenv_does(tmp_path, argv, line, usage):
    shutil.copy(ROOT / "workspace" / "tasks.py", tmp_path / "tasks.py")
    r = _invoke(tmp_path, *argv)
    err = [e for e in r.stderr.splitlines() if not e.startswith("import time:")]
    imported = {e.rsplit("|", 1)[-1].strip() for e in r.stderr.splitlines() if e.startswith("import time:")}
    assert r.returncode == 2 and len(err) == 2 and line in err[0] and err[1] == usage, r.stderr[-3000:]
    assert "torch" not in imported and "dlenv.tasks" in imported


def test_invoke_keeps_its_own_errors_and_help(tmp_path):
    shutil.copy(ROOT / "workspace" / "tasks.py", tmp_path / "tasks.py")
    r = _invoke(tmp_path, "train", "--epochs")  # a flag without its value: invoke's own line, as before
    assert r.returncode == 1 and "needed value and was not given one" in r.stderr
    r = _invoke(tmp_path, "train", "--help")
    assert r.returncode == 0 and "--epochs" in r.stdout


@pytest.mark.parametrize("word, candidates, near", [
    ("--epoch", ["--epochs", "--lr"], "--epochs"), ("train", ["train"], "train"), ("xyz", ["train", "val"], None),
    ("TRAIN", ["train", "val"], "train"), ("vall", ["val", "plot"], "val"),
])
def test_closest(word, candidates, near):
    assert typos.closest(word, candidates) == near


def test_a_flag_far_from_every_flag_gets_no_guess():
    assert typos.flag_hint("train", "--zzzzzz", ["--epochs", "--lr"]) == ""
    assert typos.flag_hint("train", "--imgsz", ["--epochs"]) == ""  # a FOREIGN word the command lacks


def test_the_names_read_without_torch_are_torchvisions_own():
    from torchvision import models as tvm

    assert modelnames.torchvision_names() == frozenset(tvm.list_models(module=tvm))


@pytest.mark.parametrize("name", ["resnet18", "vit_b_16", "convnext_tiny", "auto", "small_cnn", "timm/convnext_atto",
                                  "models/net.py:build", "mypkg.nets:build", "net.py"])
def test_the_early_check_passes_what_the_late_one_builds(name):
    modelnames.check_early(name)  # no error


def test_dlenvs_own_names_are_the_models_own():
    from dlenv.model import pretrained, smallcnn

    assert smallcnn.NAME in modelnames.OWN_NAMES and pretrained.TIMM_PREFIX == modelnames.TIMM_PREFIX


def test_unreadable_torchvision_leaves_the_check_to_the_late_one(monkeypatch):
    monkeypatch.setattr(modelnames, "torchvision_names", lambda: frozenset())
    modelnames.check_early("resnet-18")  # nothing to compare with: build_model answers later
    with pytest.raises(UserError, match="did you mean resnet18"):
        modelnames.check_name("resnet-18", ["resnet18", "resnet34"])
