"""dlenv.pathcheck: every path option answered before PyTorch loads, with "did you mean"; what no --data
means (dlenv.data.demo.default_data); a bare --weights best_model.pth (dlenv.runfolder.find_weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv import invocation
from dlenv.data import demo
from dlenv.errors import UserError
from dlenv.runfolder import find_weights

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A workspace: data/digits (class folders), models/net.py, runs/exp and runs/exp2 with run files."""
    for cls in ("a", "b"):
        (tmp_path / "data" / "digits" / "train" / cls).mkdir(parents=True)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("def build(num_classes):\n    raise SystemExit\n")
    for i, run in enumerate(("exp", "exp2")):
        (tmp_path / "runs" / run).mkdir(parents=True)
        for name in ("best_model.pth", "last.pth"):
            (tmp_path / "runs" / run / name).write_bytes(b"x")
            os.utime(tmp_path / "runs" / run / name, (1000 + i, 1000 + i))
    (tmp_path / "notes.txt").write_text("a file\n")
    (tmp_path / "photo.png").write_bytes(b"x")
    (tmp_path / "textures.zip").write_bytes(b"x")
    (tmp_path / "data" / "birds.tar.gz").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# (argv, the one error line's words); each must end before torch is imported
TYPOS = [
    (["train", "--data", "data/digts"], "--data data/digts: no such folder; did you mean data/digits?"),
    (["train", "--data", "dta/digts/train"], "did you mean data/digits/train?"),
    (["train", "--data", "elsewhere"], "--data elsewhere: no such folder; pass a folder of class folders"),
    (["train", "--resume", "runs/exp3/last.pth"], "did you mean runs/exp/last.pth?"),
    (["train", "--resume", "nothing/last.pth"], "--resume nothing/last.pth: no such run file"),
    (["train", "--weights", "runs/exp/bset_model.pth"], "did you mean runs/exp/best_model.pth?"),
    (["train", "--model", "modles/net.py:build"], "--model modles/net.py:build: no such file; did you mean "
                                                  "models/net.py:build?"),
    (["train", "--project", "notes.txt/runs"], "notes.txt is a file, so nothing can be written under it"),
    (["train", "--cfg", "runs/exp/confg.yaml"], "--cfg runs/exp/confg.yaml: no such file"),
    (["val", "--weights", "runs/ex/best_model.pth"], "did you mean runs/exp/best_model.pth?"),
    (["val", "--weights", "best_model.pth", "--data", "data/digit"], "did you mean data/digits?"),
    (["prune", "--weights", "runs/exp2/lsat.pth"], "did you mean runs/exp2/last.pth?"),
    (["export", "--weights", "best_model.pth", "--out", "notes.txt/m.onnx"], "notes.txt is a file"),
    (["predict", "--weights", "best_model.pth", "--source", "phot.png"], "--source phot.png: no such file or "
                                                                         "folder; did you mean photo.png?"),
    (["plot", "--log-dir", "./rnus"], "--log-dir ./rnus: no such folder; did you mean runs?"),
    (["data-report", "data/dgits"], "dataset folder data/dgits: no such folder; did you mean data/digits?"),
    (["bench-data", "--data", "data/digitz"], "did you mean data/digits?"),
    (["unpack", "texture.zip"], "archive texture.zip: no such file; did you mean textures.zip?"),
    (["unpack", "birds.tar.gz"], "archive birds.tar.gz: no such file; did you mean data/birds.tar.gz?"),
    (["unpack", "bird.tar.gz"], "did you mean data/birds.tar.gz?"),
    (["unpack", "nothing.7z"], "archive nothing.7z: no such file; pass the path of a .zip"),
]


def _run_cli(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """cli.main(argv) in a fresh Python; stdout ends with whether torch was imported."""
    code = ("import sys; from dlenv.cli import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True, env=env,
                       timeout=120)
    return r.returncode, r.stdout, r.stderr


def test_typos_are_answered_before_pytorch_loads(ws):
    script = "\n".join(json.dumps(argv) for argv, _ in TYPOS)
    # one Python for the whole table (each case a fresh main): torch must not be imported by any of them
    code = ("import json, sys\nfrom dlenv.cli import main\n"
            "for line in sys.stdin.read().splitlines():\n"
            "    print(main(json.loads(line)), flush=True)\n"
            "    sys.stderr.write('\\n---\\n'); sys.stderr.flush()\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ws, input=script, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=300)
    codes = [line for line in r.stdout.splitlines() if line.isdigit()]  # the lines "--weights ..." resolved aside
    errors = [e.strip() for e in r.stderr.split("\n---\n")][: len(TYPOS)]
    assert r.stdout.splitlines()[-1] == "no torch" and len(codes) == len(TYPOS), r.stdout
    for (argv, expect), rc, err in zip(TYPOS, codes, errors, strict=True):
        assert rc == "2", (argv, rc, err)
        assert len(err.splitlines()) == 1 and expect in err, (argv, err)


@pytest.mark.parametrize("argv, expect", [
    (["train"], "2 datasets under data/ (data/digits, data/pets); choose one with --data, e.g. --data data/digits"),
    (["val", "--weights", "best_model.pth"], "no such file here and no run under runs/ has one"),
])
def test_questions_before_pytorch(tmp_path, argv, expect):
    """Several datasets: train asks for --data (exit 2); no run yet: val says to train one. No torch."""
    for ds in ("digits", "pets"):
        (tmp_path / "data" / ds / "a").mkdir(parents=True)
    rc, out, err = _run_cli(argv, tmp_path)
    assert rc == 2 and out.strip().endswith("no torch"), (out, err)
    assert len(err.strip().splitlines()) == 1 and expect in err, err


@pytest.mark.parametrize("folders, want", [
    ([], (None, "no dataset under data/; --data to choose")),
    (["digits/train/a"], ("data/digits", "the one dataset under data/; --data to choose")),
    (["digits/a", "demo/a", ".digits.tmp-1/a", "loose"], ("data/digits", "the one dataset under data/; "
                                                                          "--data to choose")),
    (["demo/a"], (None, "no dataset under data/; --data to choose")),
])
def test_default_data(tmp_path, monkeypatch, folders, want):
    """None, one, or one beside the demo, unpack's temporary folders and a folder without folders."""
    monkeypatch.chdir(tmp_path)
    for f in folders:
        (tmp_path / "data" / f).mkdir(parents=True)
    if "demo/a" in folders:
        (tmp_path / "data" / "demo" / demo.MARKER).write_text("{}")
    assert demo.default_data(None) == want


def test_default_data_given_or_several(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for ds in ("b", "a", "c"):
        (tmp_path / "data" / ds / "x").mkdir(parents=True)
    assert demo.default_data("data/b") == ("data/b", "--data data/b")
    assert demo.default_data(None, synthetic=True) == (None, "--synthetic")
    with pytest.raises(UserError, match=r"3 datasets under data/ \(data/a, data/b, data/c\); choose one with --data"):
        demo.default_data(None)


def test_bare_run_file_names_the_newest_runs(ws):
    # the fixture dates exp2's files after exp's
    assert find_weights("best_model.pth") == (Path("runs/exp2/best_model.pth"),
                                              "--weights best_model.pth: runs/exp2/best_model.pth (the newest run's "
                                              "of 2 runs, by file time: it has no readable config.yaml)")
    assert find_weights("last.pth")[0] == Path("runs/exp2/last.pth")
    assert find_weights("runs/exp/best_model.pth") == (Path("runs/exp/best_model.pth"), None)  # a path: itself
    assert find_weights("other.pth") == (Path("other.pth"), None)  # not a run file's name: the reader says
    (ws / "best_model.pth").write_bytes(b"x")
    assert find_weights("best_model.pth") == (Path("best_model.pth"), None)  # a file here wins


@pytest.mark.parametrize("used, verb, want", [
    ("python val.py", "train", "python train.py"),
    ("python plot_results.py", "val", "python val.py"),
    ("python tools/mine.py", "train", "dlenv train"),  # no seed script beside it
    ("python val.py", "export", "dlenv export"),     # no seed script for the verb
    ("invoke val", "train", "invoke train"),
])
def test_messages_name_the_seed_script(tmp_path, monkeypatch, used, verb, want):
    monkeypatch.chdir(tmp_path)
    for script in ("train.py", "val.py", "plot_results.py", "predict.py"):
        (tmp_path / script).write_text("")
    monkeypatch.setenv(invocation.ENV, used)
    assert invocation.command(verb, "") == want
