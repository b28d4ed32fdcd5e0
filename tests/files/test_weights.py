"""Weights files from elsewhere (dlenv.files.weights, dlenv.files.pickleguard, dlenv.files.runstate's loading): what
loads without consent, what is refused before any of it runs, what --trust-pickle opens, safetensors of any
origin, and the code a weights file names.

Every table runs on both lanes (torch 1.13.1 and 2.x): the allowlist does not depend on torch's own
unpickler, so no case is switched on or off by the version.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import dlenv
from dlenv import compat
from dlenv.cli import main as cli_main
from dlenv.errors import UserError
from dlenv.files import pickleguard, runstate, torchfile
from dlenv.files.weights import SAFE, LoadPolicy
from dlenv.model.models import build_model

ROOT = Path(__file__).resolve().parents[2]
SIZE = 32
COMMON = ["--workers", "0", "--device", "cpu"]
EXPORT = ["--workers", "0"]  # export runs on the CPU (or CUDA for --half) and has no --device
TRUST = LoadPolicy(trust_pickle=True)


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------------
# Files that run code when unpickled, each leaving a marker file if it ever does


class _Call:
    """Pickles as a call of `func(*args)`: what an attacker's object reduces to."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _touch(marker: Path) -> _Call:
    return _Call(os.system, f"touch {marker}")


def _zip(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None, extra: list | None = None) -> Path:
    """A file in torch's zip layout around the given data.pkl (and storage records)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", "3\n")
        for name, data in extra or []:
            zf.writestr(name, data)
    return path


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))


def _edit_pkl(tmp: Path, name: str, obj, old: bytes, new: bytes) -> Path:
    """torch.save(obj), with `old` replaced by `new` in its data.pkl (the storage records kept)."""
    src = tmp / f"{name}.src.pth"
    torch.save(obj, src)
    out = tmp / f"{name}.pth"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                assert old in data, (old, data)
                data = data.replace(old, new, 1)
            zout.writestr(info, data)
    return out


class _ModulePid(pickle.Pickler):
    def persistent_id(self, obj):
        return ("module", "os", "system") if obj == "pid" else None


def _module_pid() -> bytes:
    buf = io.BytesIO()
    _ModulePid(buf, protocol=2).dump({"w": "pid"})
    return buf.getvalue()


def _tar(path: Path, marker: Path) -> Path:
    """torch.load tries the pre-1.0 tar format first; this one's first name starts like a pickle."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tf:
        for name in ("\x80\x02sys_info", "sys_info", "pickle", "tensors", "storages"):
            data = pickle.dumps(_touch(marker), protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _duplicate(path: Path, marker: Path) -> Path:
    good = pickle.dumps({"w": 1}, protocol=2)
    with zipfile.ZipFile(path, "w") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("archive/data.pkl", good)
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/data.pkl", pickle.dumps(_touch(marker), protocol=2))
    return path


def _p2(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


# (id, how to make the file in tmp with the marker, what the refusal says)
EVIL = [
    ("os.system", lambda t, m: torch.save({"model": _touch(m)}, t / "f.pth"), "global posix.system"),
    ("Path.touch via getattr", lambda t, m: torch.save({"m": _Call(Path.touch, m)}, t / "f.pth"),
     "global __builtin__.getattr"),
    ("builtins.eval", lambda t, m: torch.save({"m": _Call(eval, f"open({str(m)!r}, 'w')")}, t / "f.pth"),
     "global __builtin__.eval"),
    ("builtins.exec, protocol 4", lambda t, m: torch.save(_Call(exec, f"open({str(m)!r}, 'w')"), t / "f.pth",
                                                          pickle_protocol=4), "global builtins.exec"),
    ("the legacy format", lambda t, m: torch.save({"m": _touch(m)}, t / "f.pth",
                                                  _use_new_zipfile_serialization=False), "global posix.system"),
    ("a bare pickle", lambda t, m: (t / "f.pth").write_bytes(pickle.dumps(_touch(m), protocol=2)),
     "GLOBAL where only plain data belongs"),
    ("a bare pickle, protocol 5", lambda t, m: (t / "f.pth").write_bytes(pickle.dumps(_touch(m), protocol=5)),
     "STACK_GLOBAL where only plain data belongs"),
    ("INST", lambda t, m: _zip(t / "f.pth", f"(S'touch {m}'\nios\nsystem\n.".encode()), "opcode INST"),
    ("OBJ", lambda t, m: _zip(t / "f.pth", _p2(b"(ccollections\nOrderedDict\n", b"o")), "opcode OBJ"),
    ("NEWOBJ", lambda t, m: _zip(t / "f.pth", _p2(b"ccollections\nOrderedDict\n)", b"\x81")), "opcode NEWOBJ"),
    ("EXT1", lambda t, m: _zip(t / "f.pth", _p2(b"\x82\x01")), "opcode EXT1"),
    ("BUILD on a non-dict", lambda t, m: _zip(t / "f.pth", _p2(b"ctorch\nSize\n)", b"\x85R}b")), "BUILD"),
    ("a call of a storage type", lambda t, m: _zip(t / "f.pth", _p2(b"ctorch\nFloatStorage\n)R")),
     "it calls torch.FloatStorage"),
    ("a persistent id that is not a storage", lambda t, m: _zip(t / "f.pth", _module_pid()),
     "a persistent id other than a torch storage"),
    ("a storage larger than its bytes", lambda t, m: _edit_pkl(t, "f", {"w": torch.ones(4)}, b"K\x04t", b"M\x00\x10t"),
     "a storage of 4,096 elements in a record of 16 bytes"),
    ("a tensor past its storage", lambda t, m: _edit_pkl(t, "f", {"w": torch.ones(4)}, b"K\x00K\x04\x85",
                                                         b"K\x00K\x40\x85"), "reaches past the end of its storage"),
    ("a tensor offset past its storage", lambda t, m: _edit_pkl(t, "f", {"w": torch.ones(4)}, b"K\x00K\x04\x85",
                                                                b"K\x09K\x00\x85"), "starts past the end"),
    ("a sparse tensor", lambda t, m: torch.save({"s": torch.eye(3).to_sparse()}, t / "f.pth"),
     "_rebuild_sparse_tensor"),
    ("a NumPy array", lambda t, m: torch.save({"a": __import__("numpy").zeros(3)}, t / "f.pth"), "global numpy"),
    ("a torch.device", lambda t, m: torch.save({"d": torch.device("cpu")}, t / "f.pth"), "global torch.device"),
    ("a whole nn.Module", lambda t, m: torch.save(torch.nn.Linear(2, 2), t / "f.pth"), "global torch.nn"),
    ("the pre-1.0 tar format", lambda t, m: _tar(t / "f.pth", m), "pre-1.0 tar format"),
    ("two members of one name", lambda t, m: _duplicate(t / "f.pth", m), "two members whose names are equal"),
]


@pytest.mark.parametrize("make, reason", [e[1:] for e in EVIL], ids=[e[0] for e in EVIL])
def test_a_file_outside_the_allowlist_is_refused_before_torch_sees_it(tmp_path, make, reason, monkeypatch):
    marker = tmp_path / "RAN"
    make(tmp_path, marker)
    path = tmp_path / "f.pth"

    def never(*a, **k):
        raise AssertionError("torch.load was reached")

    with monkeypatch.context() as m:
        m.setattr(compat, "load_weights_only", never)
        with pytest.raises(UserError) as e:
            runstate.load_state(path, SAFE)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"refusing to unpickle {path}: ") and reason in line, line
    assert "nothing in it was run" in line and "--trust-pickle" in line
    assert not marker.exists(), "the file's code ran"
    if "storage" in reason:
        return  # out-of-bounds storages are the memory-corruption class: not handed to torch, even here
    # with consent torch's weights_only loader reads it: it refuses code (never runs it) on both lanes
    with contextlib.suppress(UserError):
        runstate.load_state(path, TRUST)
    assert not marker.exists(), "the file's code ran under --trust-pickle"


@pytest.mark.parametrize("what", ["os.system", "a bare pickle", "a storage larger than its bytes"])
def test_the_attack_files_through_every_verb_run_nothing(tmp_path, trained, what, capsys):
    marker = tmp_path / "RAN"
    dict((e[0], e[1]) for e in EVIL)[what](tmp_path, marker)
    for argv in (["val", "--weights", "f.pth", *COMMON], ["prune", "--weights", "f.pth", *COMMON],
                 ["export", "--weights", "f.pth", *EXPORT],
                 ["train", "--weights", "f.pth", "--model", "resnet18", "--data", str(trained / "ds"), *COMMON]):
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            code = cli_main(argv)
        finally:
            os.chdir(cwd)
        line = error_line(capsys)
        assert code == 2 and "refusing to unpickle f.pth" in line, (argv, line)
    assert not marker.exists()


DAMAGED = [
    ("a cut zip", lambda t: (t / "f.pth").write_bytes((t / "good.pth").read_bytes()[:-300])),
    ("a cut legacy file", lambda t: (t / "f.pth").write_bytes((t / "legacy.pth").read_bytes()[:-5])),
    ("a pickle without its end", lambda t: _zip(t / "f.pth", b"\x80\x02}q\x00")),
    ("a storage record missing", lambda t: _zip(t / "f.pth", _data_pkl(t / "good.pth"))),
]


@pytest.mark.parametrize("make", [d[1] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_damaged_file_is_named_as_damaged(tmp_path, make):
    torch.save({"w": torch.arange(100.0)}, tmp_path / "good.pth")
    torch.save({"w": torch.arange(100.0)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    make(tmp_path)
    with pytest.raises(UserError, match="truncated or corrupt") as e:
        runstate.load_state(tmp_path / "f.pth", SAFE)
    assert "\n" not in str(e.value)


# whole files whose pickle pickle never writes: crafted (or bytes changed in place), not cut short, so not
# "truncated or corrupt" (a user would fetch the same file again): refused as built, even with --trust-pickle
MALFORMED = [
    ("a memo entry never stored", _p2(b"h\x07")),
    ("a stack that runs dry", _p2(b"}0" + b"0")),
    ("APPENDS without a mark", _p2(b"]e")),
    ("an odd DICT", _p2(b"(Nd")),
    ("a list as a key", _p2(b"}]Ns")),
    ("a dict in a frozenset", _p2(b"(}\x91")),
]


@pytest.mark.parametrize("pkl", [m[1] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("policy", [SAFE, TRUST], ids=["safe", "trust-pickle"])
def test_a_malformed_pickle_is_refused_as_built_not_called_truncated(tmp_path, pkl, policy):
    with pytest.raises(UserError) as e:
        runstate.load_state(_zip(tmp_path / "f.pth", pkl), policy)
    line = str(e.value)
    assert "built in a way torch.save never writes (a malformed pickle" in line and "corrupt" not in line, line
    assert "\n" not in line


# ---------------------------------------------------------------------------------------------------
# What loads without consent


def _tensors():
    base = torch.arange(12.0).reshape(3, 4)
    return {"f32": torch.randn(2, 3), "f16": torch.ones(2, dtype=torch.float16),
            "bf16": torch.ones(2, dtype=torch.bfloat16), "i64": torch.arange(3),
            "u8": torch.zeros(4, dtype=torch.uint8),
            "bool": torch.tensor([True, False]), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 5),
            "view": torch.arange(10)[2:5], "transposed": base.t(), "shares": base[1], "c64": torch.ones(2) * 1j}


def _timm_state():
    timm = pytest.importorskip("timm")
    return timm.create_model("resnet18", pretrained=False, num_classes=3).state_dict()


ALLOWED = [
    ("a torchvision state dict", lambda: build_model("resnet18", 3).state_dict(), {}),
    ("the legacy format", lambda: build_model("squeezenet1_1", 3).state_dict(),
     {"_use_new_zipfile_serialization": False}),
    ("pickle protocol 4", lambda: build_model("squeezenet1_1", 3).state_dict(), {"pickle_protocol": 4}),
    ("pickle protocol 5, legacy format", lambda: build_model("squeezenet1_1", 3).state_dict(),
     {"pickle_protocol": 5, "_use_new_zipfile_serialization": False}),
    ("nested under state_dict", lambda: {"state_dict": build_model("squeezenet1_1", 3).state_dict(), "epoch": 3}, {}),
    ("parameters (keep_vars)", lambda: build_model("squeezenet1_1", 3).state_dict(keep_vars=True), {}),
    ("dtypes, views and shared storage", _tensors, {}),
    ("dtypes in the legacy format", _tensors, {"_use_new_zipfile_serialization": False}),
    ("plain data", lambda: {"n": None, "t": (1, "a", -7), "l": [True, False], "dt": torch.float16,
                            "big": 2**80, "od": collections.OrderedDict(a=1), "w": torch.ones(2)}, {}),
    ("floats", lambda: {"lr": 0.1, "w": torch.ones(2)}, {}),
    ("a timm state dict", _timm_state, {}),
]


@pytest.mark.parametrize("make, save", [a[1:] for a in ALLOWED], ids=[a[0] for a in ALLOWED])
def test_state_dicts_and_plain_data_load_without_consent(tmp_path, make, save):
    obj = make()
    path = tmp_path / "w.pth"
    torch.save(obj, path, **save)
    with open(path, "rb") as fh:
        torchfile.check(fh)  # the allowlist passes it, on both lanes
    # built by dlenv from the bytes it judged, not by torch's weights_only loader (which knows no FRAME,
    # and on 1.13 no float): every case loads on both lanes, exactly as torch itself reads it
    back = runstate.load_state(path, SAFE)
    want = torch.load(path, weights_only=False)  # we made it: the reference reading
    flat_back, flat_want = _flat(back), _flat(want)
    assert flat_back.keys() == flat_want.keys()
    for k, v in flat_want.items():
        assert (torch.equal(flat_back[k], v) if torch.is_tensor(v) else flat_back[k] == v), k


def _flat(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix: obj}


def test_the_seed_workflow_copy_best_model_anywhere_and_validate_it(trained, tmp_path):
    """As the articles do: copy best_model.pth out of its run folder and `python val.py --weights` it,
    in a folder with no key, no sidecar, nothing of the project; the lane's own Python and PyTorch."""
    elsewhere = tmp_path / "downloads"
    elsewhere.mkdir()
    shutil.copy(trained / "runs" / "exp" / "best_model.pth", elsewhere / "best_model.pth")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dlenv.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "workspace" / "val.py"), "--weights", "best_model.pth",
                           "--data", str(trained / "ds" / "val"), *COMMON], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "top-1" in proc.stdout.lower() and (elsewhere / "val" / "metrics.json").is_file()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["best_model.pth", "val"]  # no key, no sidecar made


def test_consent_opens_what_torch_allows_and_only_from_the_command_line(trained, tmp_path, capsys):
    sparse = tmp_path / "sparse.pth"  # torch's weights_only loader reads sparse tensors; the allowlist does not
    torch.save({"s": torch.eye(3).to_sparse()}, sparse)
    with pytest.raises(UserError, match="refusing to unpickle"):
        runstate.load_state(sparse, SAFE)
    assert torch.equal(runstate.load_state(sparse, TRUST)["s"].to_dense(), torch.eye(3))

    args = ["val", "--weights", str(sparse), "--model", "resnet18", "--data", str(trained / "ds" / "val"),
            "--img-size", str(SIZE), "--out", str(tmp_path / "val"), *COMMON]
    assert cli_main(args) == 2
    assert error_line(capsys).startswith("dlenv val: error: refusing to unpickle")
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("trust_pickle: true\n")  # a config file someone sent cannot consent
    assert cli_main([*args, "--cfg", str(cfg)]) == 2
    assert "refusing to unpickle" in error_line(capsys)
    # consented: torch reads it (and then it is not a resnet18's weights)
    assert cli_main([*args, "--trust-pickle"]) == 2
    line = error_line(capsys)
    assert "refusing" not in line and "no linear layer found" in line, line
    # train --weights takes the command's policy too
    train = ["train", "--weights", str(sparse), "--model", "resnet18", "--data", str(trained / "ds"), "--img-size",
             str(SIZE), "--epochs", "1", "--max-steps", "1", "--project", str(tmp_path / "runs"), *COMMON]
    assert cli_main(train) == 2
    assert "refusing to unpickle" in error_line(capsys)
    assert cli_main([*train, "--trust-pickle"]) == 2
    line = error_line(capsys)
    assert "refusing" not in line and "does not fit resnet18" in line, line


@pytest.mark.parametrize("typed, in_yaml, want", [(None, True, False), (True, False, True), ("true", True, True),
                                                  (None, False, False)])
def test_only_the_command_line_can_consent(typed, in_yaml, want):
    from dlenv.options import config, declare

    cfg = config.build(config.ValConfig, trust_pickle=in_yaml)  # as a --cfg file would set it
    given = {} if typed is None else {"trust_pickle": typed}
    cfg = declare.command_line_consent(cfg, given)
    assert cfg.trust_pickle is want and LoadPolicy.of(cfg).trust_pickle is want


# ---------------------------------------------------------------------------------------------------
# Paths that are not regular files


@pytest.mark.parametrize("name", ["x.pth", "x.safetensors"])
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_folder_or_fifo_named_like_weights_is_one_line_not_a_hang(tmp_path, name, kind, capsys):
    path = tmp_path / name
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    with pytest.raises(UserError) as e:
        runstate.load_state(path, SAFE)
    line = str(e.value)
    assert "\n" not in line and str(path) in line and "No such device" not in line
    assert ("a folder" if kind == "folder" else "a named pipe (FIFO)") in line, line
    assert cli_main(["val", "--weights", str(path), *COMMON]) == 2
    assert "No such device" not in error_line(capsys)


# ---------------------------------------------------------------------------------------------------
# safetensors


def test_save_checkpoint_to_safetensors_writes_weights_and_description_without_pickle(tmp_path):
    state = {"format": runstate.FORMAT, "model": {"fc.weight": torch.randn(3, 4), "fc.bias": torch.zeros(3)},
             "model_name": "resnet18", "num_classes": 3, "class_names": ["a", "b", "c"], "img_size": 64,
             "config": {"lr": 0.001, "data": "data/x"}, "optimizer": {"state": {}}}
    path = tmp_path / "w.safetensors"
    runstate.save_state(state, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: a little-endian header length, then JSON
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["model_name"] == "resnet18" and "optimizer" not in raw[8:8 + n].decode()
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(raw)
    back = runstate.load_state(path)
    assert runstate.is_run_state(back)
    assert back["class_names"] == ["a", "b", "c"] and back["img_size"] == 64 and back["config"]["lr"] == 0.001
    assert torch.equal(back["model"]["fc.weight"], state["model"]["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def _st(path: Path, tensors: dict, meta: dict | None) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


HUB = [("huggingface/timm", {"format": "pt"}), ("no metadata", None), ("other keys", {"format": "np", "x": "y"})]


@pytest.mark.parametrize("meta", [h[1] for h in HUB], ids=[h[0] for h in HUB])
def test_a_safetensors_from_a_hub_loads_with_model(tmp_path, trained, meta, capsys):
    src = build_model("resnet18", num_classes=2)
    path = _st(tmp_path / "hub.safetensors", src.state_dict(), meta)
    assert set(runstate.load_state(path)) == set(src.state_dict())  # a bare state dict
    model = build_model("resnet18", num_classes=2, weights=str(path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values(),
                                                  strict=True))
    assert cli_main(["val", "--weights", str(path), "--model", "resnet18", "--data",
                     str(trained / "ds" / "val"), "--img-size", str(SIZE), "--out", str(tmp_path / "v"),
                     *COMMON]) == 0
    assert cli_main(["val", "--weights", str(path), "--data", str(trained / "ds" / "val"), *COMMON]) == 2
    assert "bare state dict with no architecture; name it with --model" in error_line(capsys)


def _dlenv_meta(**change):
    meta = {"format": runstate.FORMAT, "model_name": "squeezenet1_1", "num_classes": "2",
            "class_names": '["a", "b"]', "img_size": "32", "config": "{}"}
    meta.update(change)
    return {k: v for k, v in meta.items() if v is not None}


BAD_META = [
    ("img_size 100000", {"img_size": "100000"}, "its 'img_size' is 100000, not an image size of 16 to 2048 pixels"),
    ("num_classes huge", {"num_classes": "999999999"}, "its 'num_classes' is 999999999, not an integer from 1 to"),
    ("num_classes not a count", {"num_classes": "-3"}, "num_classes '-3' is not a count"),
    ("num_classes too long", {"num_classes": "9" * 5000}, "is not a count"),
    ("class_names not JSON", {"class_names": "[a"}, "its dlenv metadata is incomplete or malformed"),
    ("no model_name", {"model_name": None}, "its dlenv metadata is incomplete or malformed ('model_name')"),
    ("model_source args huge", {"model_name": "models/net.py:build",
                                "model_source": '{"ref": "models/net.py:build", "args": {"width": 100000000}}'},
     "beyond the bounds"),
]


@pytest.mark.parametrize("change, expect", [b[1:] for b in BAD_META], ids=[b[0] for b in BAD_META])
def test_numbers_in_safetensors_metadata_are_bounded(tmp_path, trained, change, expect, capsys):
    path = _st(tmp_path / "w.safetensors", build_model("squeezenet1_1", 2).state_dict(), _dlenv_meta(**change))
    assert cli_main(["val", "--weights", str(path), "--data", str(trained / "ds" / "val"), *COMMON]) == 2
    line = error_line(capsys)
    assert expect in line and str(path) in line, line


def test_a_broken_safetensors_file_is_one_user_error(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        runstate.load_state(path)


# ---------------------------------------------------------------------------------------------------
# A run of dlenv's own, and code named by a weights file


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real squeezenet1_1 run of one short epoch on tiny data."""
    from imagedata import make_train_val

    root = tmp_path_factory.mktemp("w")
    make_train_val(root / "ds", per_class=4, size=(SIZE, SIZE))
    code = cli_main(["train", "--data", str(root / "ds"), "--model", "squeezenet1_1", "--img-size", str(SIZE),
                     "--batch-size", "4", "--epochs", "1", "--max-steps", "1", "--project", str(root / "runs"),
                     *COMMON])
    assert code == 0
    return root


@pytest.mark.slow  # 10 s on 2 cores: five commands in a row
def test_safetensors_through_export_val_prune_export_and_train(trained, tmp_path, capsys):
    run = trained / "runs" / "exp"
    st = tmp_path / "model.safetensors"
    assert cli_main(["export", "--weights", str(run / "best_model.pth"), "--format", "safetensors",
                     "--out", str(st), *EXPORT]) == 0
    out = capsys.readouterr().out
    assert "every tensor identical" in out and f"--weights {st}" in out
    assert cli_main(["val", "--weights", str(st), "--out", str(tmp_path / "val"), *COMMON]) == 0
    assert json.loads((tmp_path / "val" / "metrics.json").read_text())["weights"] == str(st)
    assert cli_main(["prune", "--weights", str(st), "--amount", "0.3", *COMMON]) == 0
    assert (tmp_path / "model_pruned.pth").is_file()
    assert cli_main(["export", "--weights", str(st), "--format", "torchscript", *EXPORT]) == 0
    assert (tmp_path / "model.torchscript.pt").is_file()
    assert cli_main(["train", "--weights", str(st), "--model", "squeezenet1_1", "--data", str(trained / "ds"),
                     "--img-size", str(SIZE), "--batch-size", "4", "--epochs", "1", "--max-steps", "1",
                     "--project", str(tmp_path / "runs"), "--name", "from-st", *COMMON]) == 0


def test_export_safetensors_refuses_half_and_quantize(trained, capsys):
    code = cli_main(["export", "--weights", str(trained / "runs" / "exp" / "best_model.pth"), "--format",
                     "safetensors", "--quantize", "dynamic", *EXPORT])
    assert code == 2 and "--format safetensors writes the float32 weights" in error_line(capsys)


def test_dlenvs_own_files_resume_and_validate_without_the_flag(trained, tmp_path):
    run = trained / "runs" / "exp"
    for name in ("last.pth", "best_model.pth"):
        with open(run / name, "rb") as fh:
            torchfile.check(fh)
    assert cli_main(["val", "--weights", str(run / "best_model.pth"), "--out", str(tmp_path / "v2"), *COMMON]) == 0
    assert cli_main(["train", "--resume", str(run / "last.pth"), *COMMON]) == 0  # 1 of 1 epochs: done at once
    assert not list(run.glob("*.hmac"))


MODEL_FILE = """
import pathlib
pathlib.Path(__file__).with_name("RAN").touch()
import torch.nn as nn
def build(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
"""

# where a downloaded weights file says its model comes from -> what the refusal says
NAMED_CODE = [
    ("absolute", lambda proj, out: f"{out}/net.py:build", "an absolute path"),
    ("dotdot", lambda proj, out: "../outside/net.py:build", "climbs out of the working folder"),
    ("symlink out", lambda proj, out: "linked/net.py:build", "which leads outside the working folder"),
    ("unpacked under data/", lambda proj, out: "data/pets/net.py:build", "under data/ where unpacked archives go"),
    ("a module outside", lambda proj, out: "net:build", "a module not found in the working folder"),
]


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
@pytest.mark.parametrize("source", [True, False], ids=["with-model_source", "without"])
@pytest.mark.parametrize("place, expect", [n[1:] for n in NAMED_CODE], ids=[n[0] for n in NAMED_CODE])
def test_code_a_weights_file_names_is_never_imported_by_val_prune_export(tmp_path, trained, place, expect, fmt,
                                                                          source, capsys, monkeypatch):
    """The attack: a downloaded file whose metadata names a model file the attacker also placed. Its
    import would leave RAN beside it; val, prune and export refuse in one line and nothing runs."""
    import hashlib

    proj, out = tmp_path / "proj", tmp_path / "outside"
    for folder in (out, proj / "data" / "pets"):
        folder.mkdir(parents=True)
        (folder / "net.py").write_text(MODEL_FILE)
    (proj / "linked").symlink_to(out)
    monkeypatch.chdir(proj)
    monkeypatch.syspath_prepend(str(out))  # "a module outside": importable from the path, not the project
    ref = place(proj, out)
    sha = hashlib.sha256(MODEL_FILE.encode()).hexdigest()
    ckpt = {"format": runstate.FORMAT, "model": {"1.weight": torch.zeros(2, 3 * 32 * 32), "1.bias": torch.zeros(2)},
            "model_name": ref, "num_classes": 2, "class_names": ["cat", "dog"], "img_size": 32, "config": {},
            "model_source": {"ref": ref, "sha256": sha, "args": {}, "file": None} if source else None}
    path = runstate.save_state(ckpt, proj / f"downloaded.{fmt}")
    data = ["--data", str(trained / "ds" / "val")]
    for argv in (["val", "--weights", path.name, *data, *COMMON], ["prune", "--weights", path.name, *data, *COMMON],
                 ["export", "--weights", path.name, *data, *EXPORT]):
        assert cli_main(argv) == 2, argv
        line = error_line(capsys)
        assert f"names --model {ref}" in line and "it is not imported" in line, line
        assert (expect if source else "no model_source") in line, line
    assert not list(tmp_path.rglob("RAN")), "the model file named by the weights file ran"
    # named by the user, the same file is the user's choice
    given = str(out / "net.py") + ":build"
    assert cli_main(["val", "--weights", path.name, "--model", given, *data, "--out", "v", *COMMON]) == 0
    assert (out / "RAN").exists()


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_a_mutated_file_passes_or_is_refused_never_anything_else(tmp_path, fmt):
    """400 files with 1-3 bytes of their pickle changed: the check says pass or Refused, and nothing else
    (no other exception, no hang); a file it passes still has every tensor inside its storage."""
    import random

    obj = {"model": build_model("squeezenet1_1", 2).state_dict(), "epoch": 3, "names": ["a", "b"],
           "view": torch.arange(10)[2:5]}
    src = tmp_path / "src.pth"
    torch.save(obj, src, **({} if fmt == "zip" else {"_use_new_zipfile_serialization": False}))
    raw = src.read_bytes()
    with zipfile.ZipFile(src) if fmt == "zip" else contextlib.nullcontext() as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()} if zf else None
    pkl_name = next((n for n in members if n.endswith("data.pkl")), None) if members else None
    rng = random.Random(0)
    outcomes = collections.Counter()
    for _ in range(400):
        if fmt == "zip":
            data = bytearray(members[pkl_name])
            cut = len(data)
        else:
            data = bytearray(raw)
            cut = raw.index(b"\x80\x02", 100)  # the pickles' region: after magic/protocol/sys_info
            cut = min(len(data), cut + 4000)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(2, cut)] = rng.randrange(256)
        buf = io.BytesIO()
        if fmt == "zip":
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
                for name, blob in members.items():
                    zout.writestr(name, bytes(data) if name == pkl_name else blob)
        else:
            buf.write(bytes(data))
        try:
            torchfile.check(buf)
            outcomes["passed"] += 1
        except pickleguard.Refused:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 400, outcomes


def test_a_length_field_cannot_make_the_check_read_a_large_file_into_memory(tmp_path, monkeypatch):
    """A legacy-format file whose pickle says a string of 2 GiB follows: the check stops at its bound."""
    monkeypatch.setattr(pickleguard, "PICKLE_LIMIT", 4096)
    head = b"".join(pickle.dumps(v, protocol=2) for v in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}))
    path = tmp_path / "big.pth"
    path.write_bytes(head + b"\x80\x02X\x00\x00\x00\x80" + bytes(64 * 1024))
    with open(path, "rb") as fh, pytest.raises(pickleguard.Damaged, match="more than the 4,096 bytes"):
        torchfile.check(fh)
