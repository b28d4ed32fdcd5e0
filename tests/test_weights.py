"""dlenv.weights: safetensors for train/val/prune/export, and no unpickling without consent where
torch.load(weights_only=True) can be beaten (PyTorch < 2.10).

The gate is on by itself on the image-pins lane (1.13.1) and off on the newest lane; the `gate` fixture
switches it on on both (compat.WEIGHTS_ONLY_TRUSTED forced False) and takes away the consent the other
test modules give their own pickles (tests/conftest.py), so every case below runs on both lanes.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch

from dlenv import compat, runstate, weights
from dlenv.cli import main as cli_main
from dlenv.errors import UserError
from dlenv.models import build_model

SIZE = 32
COMMON = ["--workers", "0", "--device", "cpu"]
EXPORT = ["--workers", "0"]  # export runs on the CPU (or CUDA for --half) and has no --device


@pytest.fixture
def gate(monkeypatch):
    monkeypatch.setattr(compat, "WEIGHTS_ONLY_TRUSTED", False)
    monkeypatch.setattr(weights, "_trust", False)


@pytest.fixture
def key(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "project" / ".dlenv" / "key"
    monkeypatch.setenv(weights.KEY_ENV, str(path))
    return path


class Payload:
    """A pickle that runs code when loaded without weights_only: it creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_gate_follows_the_torch_version():
    assert compat.WEIGHTS_ONLY_TRUSTED is (compat.TORCH_VERSION >= (2, 10))


# ---------------------------------------------------------------------------------------------------
# The gate


def test_a_foreign_pth_is_refused_before_anything_is_unpickled(tmp_path, gate, key, monkeypatch):
    marker = tmp_path / "ran"
    evil = tmp_path / "downloaded.pth"
    torch.save({"model": Payload(marker)}, evil)

    def never(*a, **k):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(compat, "load_weights_only", never)
    with pytest.raises(UserError) as e:
        runstate.load_checkpoint(evil)
    msg = str(e.value)
    assert "\n" not in msg and str(evil) in msg
    for needle in ("refusing to unpickle", "CVE-2025-32434", "--trust-pickle", ".safetensors"):
        assert needle in msg
    assert not marker.exists()


def test_consent_opens_it_and_weights_only_still_refuses_code(tmp_path, gate, key):
    plain = tmp_path / "other_tool.pth"
    torch.save({"fc.weight": torch.ones(2, 3)}, plain)
    with weights.trust_pickle(True):
        assert torch.equal(runstate.load_checkpoint(plain)["fc.weight"], torch.ones(2, 3))
        evil = tmp_path / "evil.pth"
        torch.save({"model": Payload(tmp_path / "ran")}, evil)
        with pytest.raises(UserError, match="refusing to load"):
            runstate.load_checkpoint(evil)
    assert not (tmp_path / "ran").exists()


def test_with_the_gate_off_a_foreign_pth_loads_without_consent(tmp_path, monkeypatch, key):
    monkeypatch.setattr(compat, "WEIGHTS_ONLY_TRUSTED", True)
    monkeypatch.setattr(weights, "_trust", False)
    plain = tmp_path / "other_tool.pth"
    torch.save({"fc.weight": torch.ones(2, 3)}, plain)
    assert "fc.weight" in runstate.load_checkpoint(plain)


def test_files_dlenv_wrote_here_load_without_consent_and_changed_ones_do_not(tmp_path, gate, key):
    path = tmp_path / "runs" / "exp" / "last.pth"
    runstate.save_checkpoint({"format": runstate.FORMAT, "lr": 0.1, "w": torch.arange(3.0)}, path)
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    assert runstate.load_checkpoint(path)["lr"] == 0.1
    sidecar = json.loads((tmp_path / "runs" / "exp" / "last.pth.hmac").read_text())
    assert len(sidecar["hmac-sha256"]) == 1

    data = bytearray(path.read_bytes())  # one byte changed after dlenv wrote it
    data[-30] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="refusing to unpickle"):
        runstate.load_checkpoint(path)


def test_a_signed_file_under_another_projects_key_is_refused(tmp_path, gate, key, monkeypatch):
    path = tmp_path / "best_model.pth"
    runstate.save_checkpoint({"w": torch.ones(2)}, path)
    runstate.load_checkpoint(path)
    # the same file and sidecar, downloaded into a project with its own key
    monkeypatch.setenv(weights.KEY_ENV, str(tmp_path / "elsewhere" / ".dlenv" / "key"))
    weights.project_key(create=True)
    with pytest.raises(UserError, match="refusing to unpickle"):
        runstate.load_checkpoint(path)


def test_a_crash_between_signing_and_renaming_leaves_a_pair_that_verifies(tmp_path, gate, key, monkeypatch):
    path = tmp_path / "last.pth"
    runstate.save_checkpoint({"epoch": 1}, path)
    real = os.replace

    def crash(src, dst):
        if Path(dst) == path:
            raise KeyboardInterrupt  # killed after the sidecar got the new MAC, before the rename
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        runstate.save_checkpoint({"epoch": 2}, path)
    monkeypatch.setattr(os, "replace", real)
    assert runstate.load_checkpoint(path)["epoch"] == 1  # the old file, still trusted
    runstate.save_checkpoint({"epoch": 3}, path)
    assert runstate.load_checkpoint(path)["epoch"] == 3
    assert len(json.loads((tmp_path / "last.pth.hmac").read_text())["hmac-sha256"]) == 3  # bounded


def test_the_key_goes_to_dot_dlenv_of_the_working_directory(tmp_path, gate, monkeypatch):
    monkeypatch.setenv(weights.KEY_ENV, "")
    monkeypatch.chdir(tmp_path)
    runstate.save_checkpoint({"w": torch.ones(1)}, tmp_path / "runs" / "exp" / "last.pth")
    assert (tmp_path / ".dlenv" / "key").is_file()
    assert runstate.load_checkpoint(tmp_path / "runs" / "exp" / "last.pth")["w"].item() == 1.0


def test_no_key_no_signature_but_the_checkpoint_is_still_written(tmp_path, gate, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(weights.KEY_ENV, str(blocker / ".dlenv" / "key"))
    monkeypatch.setattr(weights, "_warned_key", False)
    path = tmp_path / "last.pth"
    for _ in range(2):
        runstate.save_checkpoint({"w": torch.ones(1)}, path)
    err = capsys.readouterr().err
    assert err.count("cannot sign last.pth") == 1 and "--trust-pickle" in err  # said once
    with pytest.raises(UserError, match="refusing to unpickle"):
        runstate.load_checkpoint(path)
    with weights.trust_pickle(True):
        assert runstate.load_checkpoint(path)["w"].item() == 1.0


@pytest.mark.parametrize("typed, in_yaml, want", [(None, True, False), (True, False, True), ("true", True, True),
                                                  (None, False, False)])
def test_only_the_command_line_can_consent(typed, in_yaml, want):
    from dlenv import config

    cfg = config.build(config.ValConfig, trust_pickle=in_yaml)  # as a --cfg file would set it
    given = {} if typed is None else {"trust_pickle": typed}
    assert weights.command_line_consent(cfg, given).trust_pickle is want


# ---------------------------------------------------------------------------------------------------
# safetensors


def test_save_checkpoint_to_safetensors_writes_weights_and_description_without_pickle(tmp_path, gate, key):
    state = {"format": runstate.FORMAT, "model": {"fc.weight": torch.randn(3, 4), "fc.bias": torch.zeros(3)},
             "model_name": "resnet18", "num_classes": 3, "class_names": ["a", "b", "c"], "img_size": 64,
             "config": {"lr": 0.001, "data": "data/x"}, "optimizer": {"state": {}}}
    path = tmp_path / "w.safetensors"
    runstate.save_checkpoint(state, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: a little-endian header length, then JSON
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["model_name"] == "resnet18" and "optimizer" not in raw[8:8 + n].decode()
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(raw)
    back = runstate.load_checkpoint(path)
    assert runstate.is_dlenv_checkpoint(back)
    assert back["class_names"] == ["a", "b", "c"] and back["img_size"] == 64 and back["config"]["lr"] == 0.001
    assert torch.equal(back["model"]["fc.weight"], state["model"]["fc.weight"])
    assert not (tmp_path / "w.safetensors.hmac").exists()  # nothing to vouch for: no code can run
    assert path.stat().st_mode & 0o077 == 0o644 & 0o077 & ~_umask()


def _umask() -> int:
    from dlenv.atomic import umask

    return umask()


def test_a_bare_safetensors_from_another_tool_loads_as_weights(tmp_path, gate, key):
    from safetensors.torch import save_file

    src = build_model("squeezenet1_1", num_classes=3)
    path = tmp_path / "hub.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    model = build_model("squeezenet1_1", num_classes=3, weights=str(path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values(),
                                                  strict=True))


def test_a_broken_safetensors_file_is_one_user_error(tmp_path, gate):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        runstate.load_checkpoint(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real squeezenet1_1 run of one short epoch on tiny data, written by dlenv (signed)."""
    from imagedata import make_train_val

    root = tmp_path_factory.mktemp("w")
    make_train_val(root / "ds", per_class=4, size=(SIZE, SIZE))
    session_key = os.environ.get(weights.KEY_ENV, "")
    os.environ[weights.KEY_ENV] = str(root / ".dlenv" / "key")  # this module's project
    try:
        code = cli_main(["train", "--data", str(root / "ds"), "--model", "squeezenet1_1", "--img-size", str(SIZE),
                         "--batch-size", "4", "--epochs", "1", "--max-steps", "1", "--project", str(root / "runs"),
                         *COMMON])
    finally:
        os.environ[weights.KEY_ENV] = session_key
    assert code == 0
    return root


@pytest.fixture
def project(trained, gate, monkeypatch) -> Path:
    monkeypatch.setenv(weights.KEY_ENV, str(trained / ".dlenv" / "key"))
    return trained


def test_safetensors_through_export_val_prune_export_and_train(project, capsys):
    run = project / "runs" / "exp"
    st = project / "model.safetensors"
    assert cli_main(["export", "--weights", str(run / "best_model.pth"), "--format", "safetensors",
                     "--out", str(st), *EXPORT]) == 0
    out = capsys.readouterr().out
    assert "every tensor identical" in out and f"--weights {st}" in out
    assert cli_main(["val", "--weights", str(st), "--out", str(project / "val"), *COMMON]) == 0
    assert json.loads((project / "val" / "metrics.json").read_text())["weights"] == str(st)
    assert cli_main(["prune", "--weights", str(st), "--amount", "0.3", *COMMON]) == 0
    assert (project / "model_pruned.pth").is_file()
    assert cli_main(["export", "--weights", str(st), "--format", "torchscript", *EXPORT]) == 0
    assert (project / "model.torchscript.pt").is_file()
    assert cli_main(["train", "--weights", str(st), "--model", "squeezenet1_1", "--data", str(project / "ds"),
                     "--img-size", str(SIZE), "--batch-size", "4", "--epochs", "1", "--max-steps", "1",
                     "--project", str(project / "runs"), "--name", "from-st", *COMMON]) == 0


def test_export_safetensors_refuses_half_and_quantize(project, capsys):
    code = cli_main(["export", "--weights", str(project / "runs" / "exp" / "best_model.pth"), "--format",
                     "safetensors", "--quantize", "dynamic", *EXPORT])
    assert code == 2 and "--format safetensors writes the float32 weights" in error_line(capsys)


def test_dlenvs_own_files_resume_and_validate_without_the_flag(project):
    run = project / "runs" / "exp"
    assert cli_main(["val", "--weights", str(run / "best_model.pth"), "--out", str(project / "v2"), *COMMON]) == 0
    assert cli_main(["train", "--resume", str(run / "last.pth"), *COMMON]) == 0  # 1 of 1 epochs: done at once


def test_a_foreign_pth_needs_the_flag_on_the_command_line(project, tmp_path, capsys):
    foreign = tmp_path / "from_the_internet.pth"
    torch.save(build_model("resnet18", num_classes=2).state_dict(), foreign)
    args = ["val", "--weights", str(foreign), "--model", "resnet18", "--data", str(project / "ds" / "val"),
            "--img-size", str(SIZE), "--out", str(tmp_path / "val"), *COMMON]
    assert cli_main(args) == 2
    line = error_line(capsys)
    assert line.startswith("dlenv val: error: refusing to unpickle") and "--trust-pickle" in line
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("trust_pickle: true\n")  # a config file someone sent cannot consent
    assert cli_main([*args, "--cfg", str(cfg)]) == 2
    assert "refusing to unpickle" in error_line(capsys)
    assert cli_main([*args, "--trust-pickle"]) == 0
