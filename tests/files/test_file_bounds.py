"""Numbers a bare state dict gives (issue 34, item 5): the class count val reads from a head's shape is
bounded as a dlenv checkpoint's num_classes is (1 to 100,000, dlenv.files.runstate.MAX_CLASSES), and read only
from a tensor whose every element is stored: a stride of 0 (expand) or overlapping strides give a shape
that costs no bytes. Each refusal is one line naming the file, the tensor and the bound. A key is as
long as the file's bytes allow: prefixes are stripped in work linear in it, and messages cut it short.
And the work a weights file describes (issue 43, item 4): shared containers, keys that hash alike or cost
their weight at every use, nesting, each refused while the pickle is played, before the work.
(A dlenv checkpoint's own entries: tests/test_bad_inputs.py and test_runstate.py.)"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import zipfile

import pytest
import torch
from torchvision.models import resnet18

from dlenv import cli
from dlenv.errors import UserError
from dlenv.files import pickleguard, picklework, runstate, weights
from dlenv.model import models, statedict

#: fc.weight of a bare state dict -> the class count read from it, or the line that refuses it
HEADS = [
    ("10^10 rows, zero stride (no bytes)", lambda: torch.zeros(1, 1).expand(10**10, 512),
     "its head fc.weight (10000000000x512) gives 10,000,000,000 classes, not a class count of 1 to 100,000"),
    ("100,001 rows, stored", lambda: torch.zeros(100_001, 1), "gives 100,001 classes, not a class count of 1 to"),
    ("2^63-1 rows", lambda: torch.zeros(1, 1).expand(2**63 - 1, 1), "gives 9,223,372,036,854,775,807 classes"),
    ("no rows", lambda: torch.zeros(0, 512), "gives 0 classes, not a class count of 1 to 100,000"),
    ("10 rows, zero stride", lambda: torch.zeros(1, 512).expand(10, 512),
     "its head fc.weight (10x512) repeats stored numbers (strides (0, 1): zero or overlapping)"),
    ("10 rows, zero stride inside", lambda: torch.zeros(10, 1).expand(10, 512), "strides (1, 0): zero or"),
    ("10 rows overlapping", lambda: torch.zeros(600).as_strided((10, 512), (8, 1)), "strides (8, 1): zero or"),
    ("100,000 rows, stored", lambda: torch.zeros(100_000, 1), 100_000),
    ("1 row", lambda: torch.zeros(1, 512), 1),
    ("10 rows, transposed (strided, not overlapping)", lambda: torch.zeros(512, 10).t(), 10),
    ("10 rows, every other column (gaps)", lambda: torch.zeros(10, 1024)[:, ::2], 10),
    ("10x1, stride 0 on the size-1 dimension", lambda: torch.zeros(10).as_strided((10, 1), (1, 0)), 10),  # moot
]


@pytest.mark.parametrize("make, expect", [h[1:] for h in HEADS], ids=[h[0] for h in HEADS])
def test_the_class_count_of_a_bare_state_dict_is_bounded(make, expect):
    sd = {"layer.weight": torch.zeros(4, 4), "fc.weight": make(), "fc.bias": torch.zeros(1)}
    if isinstance(expect, int):
        assert statedict.num_classes_from(sd, "w.pth") == expect
        return
    with pytest.raises(UserError) as err:
        statedict.num_classes_from(sd, "w.pth")
    line = str(err.value)
    assert "\n" not in line and line.startswith("w.pth: its head fc.weight (") and expect in line, line
    assert "use another weights file" in line


@pytest.mark.parametrize("make, expect", [
    (lambda sd: {**sd, "fc.weight": torch.zeros(1, 1).expand(10**10, 512)}, "gives 10,000,000,000 classes"),
    (lambda sd: {**sd, "fc.weight": sd["fc.weight"][:1].expand(10, 512)}, "repeats stored numbers"),
    (lambda sd: {k: v for k, v in sd.items() if v.ndim != 2}, "cannot tell the number of classes"),
    (lambda sd: sd, None),
], ids=["10^10-classes", "zero-stride-head", "no-linear-layer", "a-real-state-dict"])
def test_a_bare_state_dict_is_rebuilt_only_within_the_bounds(make, expect):
    """model_from_state is what val --model NAME calls on a bare state dict."""
    sd = make(resnet18(num_classes=10).state_dict())
    if expect is None:
        model, names, size = models.model_from_state(sd, "resnet18", source="w.pth")
        assert names == [str(i) for i in range(10)] and model.fc.out_features == 10 and size is None
        return
    with pytest.raises(UserError, match=expect) as err:
        models.model_from_state(sd, "resnet18", source="w.pth")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_dlenv_val_refuses_a_head_beyond_the_bound_in_one_line(tmp_path, monkeypatch, capsys, suffix):
    """The issue's command, in-process through the CLI: a bare state dict whose head has 100,001 rows (a
    stored tensor: its bytes are in the file) is one line and a non-zero exit, nothing allocated for it."""
    monkeypatch.chdir(tmp_path)
    sd = {**resnet18(num_classes=2).state_dict(), "fc.weight": torch.zeros(100_001, 1), "fc.bias": torch.zeros(2)}
    runstate.save_state(sd, tmp_path / f"w{suffix}")
    (tmp_path / "ds" / "cat").mkdir(parents=True)
    code = cli.main(["val", "--weights", f"w{suffix}", "--model", "resnet18", "--data", "ds", "--device", "cpu",
                     "--workers", "0"])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlenv val: error: "), err
    assert f"w{suffix}: its head fc.weight (100001x1) gives 100,001 classes, not a class count of 1 to 100,000" \
        in lines[0]


# ---------------------------------------------------------------------------------------------------
# Keys: as long as the file's bytes allow


@pytest.mark.parametrize("key, stripped", [
    ("module." * 1_000_000 + "fc.weight", "fc.weight"),  # 7 MB of prefixes: one slice, not a copy per prefix
    ("module._orig_mod.fc.weight", "fc.weight"),
    ("_orig_mod.module.fc.weight", "module.fc.weight"),  # DDP inside compile: module. is stripped first
    ("module.module._orig_mod._orig_mod.fc.weight", "fc.weight"),
    ("fc.module.weight", "fc.module.weight"),
])
def test_prefixes_are_stripped(key, stripped):
    assert list(statedict.strip_prefixes({key: torch.zeros(1)})) == [stripped]


class _CountedKey(str):
    """A key that counts the characters every slice of it copies (its slices count too)."""

    copied = 0

    def __getitem__(self, index):
        part = str.__getitem__(self, index)
        _CountedKey.copied += len(part)
        return _CountedKey(part)


@pytest.mark.parametrize("prefixes", [1, 100, 10_000])
def test_prefixes_are_stripped_in_work_linear_in_the_key(prefixes):
    # counted, not timed: the old cut-one-at-a-time loop copied the rest of the key per prefix (350 million
    # characters here for 10,000 prefixes, hours for the million above); one slice copies the name only
    key = _CountedKey("module." * prefixes + "_orig_mod.fc.weight")
    _CountedKey.copied = 0
    assert list(statedict.strip_prefixes({key: torch.zeros(1)})) == ["fc.weight"]
    assert _CountedKey.copied <= len("fc.weight"), _CountedKey.copied


@pytest.mark.parametrize("key", ["x" * 1_000_000, "a\nb\x1b[2J" * 1000, "fc.weight\n" * 10])
def test_a_state_dict_that_does_not_fit_names_its_keys_in_one_short_line(key):
    sd = {**resnet18(num_classes=10).state_dict(), key: torch.zeros(1)}
    with pytest.raises(UserError, match=r"w.pth does not match architecture 'resnet18' \(0 missing, 1 unexpected") \
            as err:
        models.model_from_state(sd, "resnet18", source="w.pth")
    line = str(err.value)
    assert "\n" not in line and "\x1b" not in line and len(line) < 600, line[:200]
    model = resnet18(num_classes=10)
    with pytest.raises(UserError) as err:
        statedict.load_lenient(model, sd, "resnet18", 10, "--weights w.pth")  # train --weights
    assert "\n" not in str(err.value) and len(str(err.value)) < 600


# ---------------------------------------------------------------------------------------------------
# Work (issue 43, item 4): a few KB of allowed pickle describe work without bound. Each file is refused
# while its pickle is played, before the work: one line, --trust-pickle or not, and the work counted
# (picklework.Budget) stays within the budget plus the one charge that broke it.


def _u(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _put(i: int) -> bytes:  # LONG_BINPUT
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:  # LONG_BINGET
    return b"j" + struct.pack("<I", i)


def _long(n: int) -> bytes:  # LONG1
    data = pickle.encode_long(n)
    return b"\x8a" + bytes([len(data)]) + data


def _float(x: float) -> bytes:  # BINFLOAT
    return b"G" + struct.pack(">d", x)


def _pkl(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def _dag(levels: int, node: bytes, top: bytes = b"") -> bytes:
    """Memo 0 an empty container of `node`'s kind; memo i+1 made of memo i twice by `node` (its opcodes
    around two GETs, @); then `top`."""
    ops = [{b"}": b"}", b"(": b"]", b"@": b")"}[node[:1]] + _put(0)]
    for i in range(levels):
        ops.append(node.replace(b"@", _get(i)) + _put(i + 1))
    return b"".join(ops) + top


#: 2**61 - 1: the modulus of Python's hash of numbers; ints (and floats) a multiple of it apart hash alike
_P = 2**61 - 1

WORK = [
    ("a 50-level DAG of dicts (the decoder walked 2**50 paths)",
     _pkl(_dag(50, b"}(" + _u("a") + b"@" + _u("b") + b"@u")), "a walk through them visits more than"),
    ("a 60-level DAG of lists", _pkl(_dag(60, b"(@@l")), "a walk through them visits more than"),
    ("a DAG of tuples as a dict key (hashed in C, SIGTERM had no effect)",
     _pkl(_dag(50, b"@@\x86", b"}" + _get(50) + b"Ns")), "a key of more than 16,777,216 values"),
    ("a key of 2**20 values inserted 64 times",
     _pkl(_dag(19, b"@@\x86", b"}" + b"".join(_get(19) + _long(i) + b"s" for i in range(64)))),
     "keys of 1,048,575 values each, hashed at every use"),
    ("150,000 int keys that hash alike, one SETITEMS",
     _pkl(b"}(" + b"".join(_long(7 + i * _P) + b"N" for i in range(150_000)) + b"u"), "hash alike"),
    ("int keys that hash alike, one SETITEM each",
     _pkl(b"}" + b"".join(_long(7 + i * _P) + b"Ns" for i in range(1000))), "hash alike"),
    ("floats that hash alike (2.0 ** (61 k))",
     _pkl(b"}" + b"".join(_float(2.0 ** (61 * k)) + b"Ns" for k in range(17))), "hash alike"),
    ("negative ints that hash alike", _pkl(b"(" + b"".join(_long(-7 - i * _P) for i in range(100)) + b"\x91"),
     "hash alike"),
    ("a tuple 300,000 deep as a key (crashed: rc 139)", _pkl(b"})" + b"\x85" * 300_000 + b"Ns"),
     "nested more than 64 deep"),
    ("lists 20,000 deep", _pkl(b"]" * 20_000 + b"a" * 19_999), "nested more than 64 deep"),
    ("dicts 20,000 deep", _pkl(b"}" + (_u("k") + b"}") * 20_000 + b"s" * 20_000), "nested more than 64 deep"),
    ("a text PUT of an index that hashes like 0", _pkl(b"Np" + str(_P).encode() + b"\n"), "memo index past 2**32"),
]



@pytest.mark.parametrize("pkl, reason", [w[1:] for w in WORK], ids=[w[0] for w in WORK])
def test_a_pickle_that_describes_unbounded_work_is_refused_before_the_work(pkl, reason):
    budget = picklework.Budget()
    with pytest.raises(pickleguard.Refused, match=re.escape(reason)):
        picklework.play(io.BytesIO(pkl), None, budget=budget)
    opcodes = sum(1 for _ in pickletools.genops(pkl))
    # the work done: the opcodes, their values, and at most the one charge that went past the budget
    assert budget.spent <= 4 * opcodes + pickleguard.MAX_WORK + 1, budget.spent


def _torch_zip(path, data_pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trust-pickle"])
@pytest.mark.parametrize("pkl", [WORK[0][1], WORK[2][1], WORK[4][1]], ids=["dict-DAG", "tuple-DAG-key", "alike"])
def test_every_reader_says_so_in_one_line_and_trust_does_not_open_it(tmp_path, pkl, trust):
    path = _torch_zip(tmp_path / "f.pth", pkl)
    with pytest.raises(UserError) as err:
        runstate.load_state(path, weights.LoadPolicy(trust_pickle=trust))
    line = str(err.value)
    assert "\n" not in line and "corrupt" not in line, line
    assert line.startswith(f"refusing to unpickle {path}: reading it would take work without bound ("), line
    assert "--trust-pickle does not open it" in line


def test_a_real_checkpoint_costs_a_small_part_of_the_budget(tmp_path):
    """A model, its optimizer (whose param groups share one betas tuple) and a dlenv-like config: well
    within the budget, and what it loads is what was saved."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
    model(torch.zeros(2, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "config": {"lr": 0.1, "size": (3, 4)}},
               tmp_path / "c.pth")
    with open(tmp_path / "c.pth", "rb") as fh, zipfile.ZipFile(fh) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    budget = picklework.Budget()
    picklework.play(io.BytesIO(data), lambda pid: pickleguard.Storage(2**40), budget=budget)
    assert budget.spent < pickleguard.MAX_WORK // 100, budget.spent
    got = weights.read(tmp_path / "c.pth", weights.SAFE)[0]
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999) and got["config"]["size"] == (3, 4)


def test_the_decoder_visits_a_shared_container_once(monkeypatch):
    """runstate.decode (floats back from their hex) on a 60-level DAG of dicts and lists, as torch.load
    under --trust-pickle may return it: each container once, not each of its 2**60 paths."""
    node: object = {"x": {"__float__": (0.5).hex()}}
    for _ in range(60):
        node = {"a": [node, node], "b": node}
    calls = []
    real = runstate.decode

    def counted(obj, seen=None):
        calls.append(1)
        return real(obj, seen)

    monkeypatch.setattr(runstate, "decode", counted)
    out = runstate.decode(node)
    assert len(calls) <= 6 * 60 + 10, len(calls)
    for _ in range(60):
        assert out["a"][0] is out["a"][1] is out["b"]  # still shared, decoded once
        out = out["b"]
    assert out == {"x": 0.5}
