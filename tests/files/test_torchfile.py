"""dlenv.files.torchfile: a .pth file is judged and loaded from the same bytes, through torch's own zip reader.

The files here are built as an attacker builds them: one archive shown to Python's zipfile (a plain state
dict) and another to torch's reader (a TorchScript archive whose __setstate__ prints a marker), in both
known ways (the end record against Python's "concatenated zip" correction; the zip64 locator torch follows
and Python ignores), and a second data.pkl that differs only in letter case. Each is first shown to fool
the two readers as intended (so the case tests what it says), then loaded through every path dlenv has:
refused in one line, torch.load and torch.jit.load never called, the marker never printed. Both lanes.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Tuple  # noqa: UP035 (TorchScript on 1.13 reads typing.Tuple)

import pytest
import torch

from dlenv import compat
from dlenv.errors import UserError
from dlenv.files import pickleguard, runstate, torchfile, weights

MARKER = "PAYLOAD-RAN-7f3a"


class Payload(torch.nn.Module):
    """TorchScript whose __setstate__ runs when torch.jit.load opens the archive."""

    def __init__(self):
        super().__init__()
        self.x = 1

    def forward(self, x):
        return x

    @torch.jit.export
    def __getstate__(self) -> Tuple[int, bool]:  # noqa: UP006 (TorchScript wants typing.Tuple on 1.13)
        return (self.x, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[int, bool]) -> None:  # noqa: UP006
        self.x = state[0]
        self.training = state[1]
        print("PAYLOAD-RAN-7f3a")  # MARKER (TorchScript takes no global)


def _torchscript() -> bytes:
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Payload()), buf)
    return buf.getvalue()


def _members(obj) -> list[tuple[str, bytes]]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        return [(n, zf.read(n)) for n in zf.namelist()]


def _cd_of(blob: bytes) -> tuple[int, int, int]:
    """(entries, size, offset) of the central directory a plain zip's end record names."""
    at = blob.rindex(b"PK\x05\x06")
    _, _, _, entries, _, size, offset, _ = struct.unpack("<4s4H2LH", blob[at:at + 22])
    return entries, size, offset


def _stored(members: list[tuple[str, bytes]], base: int, shift: int = 0) -> tuple[bytes, bytes]:
    """(local entries, central directory) of stored members written at file offset `base`; each
    directory entry records its header's offset minus `shift` (what a reader correcting by it expects)."""
    local, central = io.BytesIO(), io.BytesIO()
    for name, data in members:
        raw = name.encode()
        crc = zipfile.crc32(data)
        offset = base + local.tell()
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                                len(raw), 0) + raw + data)
        central.write(struct.pack("<4s6H3L5HLL", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, len(data),
                                  len(data), len(raw), 0, 0, 0, 0, 0, offset - shift) + raw)
    return local.getvalue(), central.getvalue()


def _padded(members, at_least: int) -> list[tuple[str, bytes]]:
    """`members` plus one with a long name, so that their directory is at least `at_least` bytes."""
    size = sum(46 + len(n.encode()) for n, _ in members)
    return members + [("archive/" + "p" * max(1, at_least - size - 46 - 8), b"")]


def two_directories_by_concatenation(benign) -> bytes:
    """T, then S whose end record names T's directory (torch reads it) while Python, correcting for what
    it takes as data before a concatenated zip, finds S's directory right before that record."""
    t = _torchscript()
    t_entries, t_size, t_offset = _cd_of(t)
    members = _padded(_members(benign), t_size)
    s_local_len = sum(30 + len(n.encode()) + len(d) for n, d in members)
    s_cd_abs = len(t) + s_local_len
    shift = s_cd_abs - t_offset  # Python's correction: where the directory is minus where the record says
    local, central = _stored(members, len(t), shift)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, t_entries, t_entries, len(central), t_offset, 0)
    return t + local + central + end


def two_directories_by_zip64(benign) -> bytes:
    """T, a zip64 end record for T's directory, then S with its own zip64 record just before the locator:
    Python reads the record before the locator, torch follows the locator's offset to T's."""
    t = _torchscript()
    t_entries, t_size, t_offset = _cd_of(t)

    def z64(entries: int, size: int, offset: int) -> bytes:
        return struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, size, offset)

    t64_at = len(t)
    head = t + z64(t_entries, t_size, t_offset)
    members = _members(benign)
    local, central = _stored(members, len(head))
    cd_at = len(head) + len(local)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, t64_at, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return head + local + central + z64(len(members), len(central), cd_at) + locator + end


def letter_case(benign) -> bytes:
    """data.pkl plus DATA.PKL describing a storage far larger than its record (torch's lookup ignores case)."""
    members = _members(benign)
    pkl = next(d for n, d in members if n.endswith("/data.pkl"))
    evil = pkl.replace(b"K\x04t", b"J\x00\x00\x10\x00t", 1)  # 4 elements -> 1,048,576 (4 MiB of floats)
    assert evil != pkl
    local, central = _stored(members + [("archive/DATA.PKL", evil)], 0)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members) + 1, len(members) + 1, len(central),
                      len(local), 0)
    return local + central + end


CONSTRUCTIONS = [
    ("end record vs concatenated-zip correction", two_directories_by_concatenation, "directory in different places"),
    ("zip64 locator", two_directories_by_zip64, "zip64 locator that points elsewhere"),
    ("data.pkl and DATA.PKL", letter_case, "differ only in letter case"),
]
BENIGN = {"fc.weight": torch.ones(4), "fc.bias": torch.zeros(2)}


def _python_names(blob: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(blob)).namelist()


def _torch_names(blob: bytes) -> list[str] | None:
    try:
        return list(torch._C.PyTorchFileReader(io.BytesIO(blob)).get_all_records())
    except RuntimeError:  # 2.x's reader refuses some constructions outright
        return None


@pytest.mark.parametrize("make, reason", [c[1:] for c in CONSTRUCTIONS], ids=[c[0] for c in CONSTRUCTIONS])
def test_the_two_readers_are_fooled_as_built(make, reason):
    """The construction works on the readers themselves: otherwise the refusal below proves nothing."""
    blob = make(BENIGN)
    python = _python_names(blob)
    assert "archive/data.pkl" in python and not any("constants.pkl" in n for n in python), python
    seen = _torch_names(blob)
    if make is letter_case:
        assert seen is not None and "data.pkl" in seen and "DATA.PKL" in seen, seen
        return
    if seen is None:
        assert compat.TORCH_VERSION >= (2, 0), "torch 1.13's reader opens both constructions"
        return
    assert "constants.pkl" in seen and "code/__torch__/test_torchfile.py" in seen, seen


@pytest.mark.skipif(compat.TORCH_VERSION >= (2, 0), reason="2.x's torch.load refuses these files itself")
@pytest.mark.parametrize("make", [two_directories_by_concatenation, two_directories_by_zip64])
def test_on_torch_1_13_its_own_loader_runs_the_payload(tmp_path, make, capfd):
    """Why dlenv never hands such a file to torch.load: 1.13 goes to torch.jit.load, even weights_only."""
    path = tmp_path / "w.pth"
    path.write_bytes(make(BENIGN))
    torch.load(path, weights_only=True)
    assert MARKER in capfd.readouterr().out


@pytest.fixture
def no_torch_loader(monkeypatch):
    def never(*a, **k):
        raise AssertionError("torch's own loader was reached")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(torch.jit, "load", never)
    monkeypatch.setattr(compat, "load_weights_only", never)


@pytest.mark.parametrize("trust", [False, True], ids=["no flag", "--trust-pickle"])
@pytest.mark.parametrize("make, reason", [c[1:] for c in CONSTRUCTIONS], ids=[c[0] for c in CONSTRUCTIONS])
def test_a_file_read_two_ways_is_refused_and_runs_nothing(tmp_path, make, reason, trust, no_torch_loader, capfd):
    path = tmp_path / "w.pth"
    path.write_bytes(make(BENIGN))
    with pytest.raises(UserError) as e:
        runstate.load_state(path, weights.LoadPolicy(trust_pickle=trust))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"refusing to unpickle {path}") or "truncated or corrupt" in line
    if _torch_names(path.read_bytes()) is not None:  # torch's reader opens it: the disagreement is named
        assert reason in line and "nothing in it was run" in line and "--trust-pickle does not open it" in line
    assert MARKER not in capfd.readouterr().out


@pytest.mark.parametrize("verb", ["val", "prune", "export"])
@pytest.mark.parametrize("make", [c[1] for c in CONSTRUCTIONS], ids=[c[0] for c in CONSTRUCTIONS])
def test_every_verb_refuses_it_in_one_line(tmp_path, make, verb, capfd):
    from dlenv.cli import main

    path = tmp_path / "w.pth"
    path.write_bytes(make(BENIGN))
    extra = ["--model", "resnet18"] + (["--data", str(tmp_path)] if verb == "val" else [])
    assert main([verb, "--weights", str(path), *extra]) == 2
    out = capfd.readouterr()
    err = out.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(path) in err, err
    assert MARKER not in out.out + out.err


# ---------------------------------------------------------------------------------------------------
# What loads is what was judged: the builder's tensors against torch's own reading of honest files


def _honest():
    base = torch.arange(12.0).reshape(3, 4)
    p = torch.nn.Parameter(torch.randn(3))
    return {"t": base.t(), "row": base[1], "p": p, "h": torch.ones(2, dtype=torch.float16), "i": torch.arange(3),
            "b": torch.tensor([True]), "s": torch.tensor(2.5), "e": torch.empty(0, 3),
            "bf": torch.full((2,), 3.0, dtype=torch.bfloat16)}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_tensors_are_built_from_the_judged_bytes_exactly_as_torch_reads_them(tmp_path, legacy):
    path = tmp_path / "w.pth"
    torch.save(_honest(), path, _use_new_zipfile_serialization=not legacy)
    with open(path, "rb") as fh:
        back = torchfile.load(fh)
    want = torch.load(path)  # our own file: the reference reading
    assert back.keys() == want.keys()
    for k, v in want.items():
        assert type(back[k]) is type(v) and back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert back[k].stride() == v.stride() and torch.equal(back[k], v), k
        assert back[k].requires_grad == v.requires_grad, k
    # tensors that shared a storage when saved share it again (tied weights stay tied)
    back["t"][0, 1] = 99.0
    assert back["row"][0] == 99.0
    # writable memory: an optimizer state loaded from a file is updated in place
    back["i"] += 1
    assert back["i"].tolist() == [1, 2, 3]


def test_the_check_reads_with_torchs_reader_not_pythons(tmp_path, monkeypatch):
    """The guard's view comes from the reader that loads: take Python's zipfile away and it still judges."""
    path = tmp_path / "w.pth"
    torch.save(BENIGN, path)
    seen = []
    real = torch._C.PyTorchFileReader

    def spy(fh):
        seen.append(fh)
        return real(fh)

    monkeypatch.setattr(torch._C, "PyTorchFileReader", spy)
    with open(path, "rb") as fh:
        torchfile.check(fh)
    assert seen, "torch's reader was not used"


BIG_ENDIAN = [
    ("zip byteorder record", "zip"),
    ("legacy sys_info", "legacy"),
]


@pytest.mark.parametrize("fmt", [b[1] for b in BIG_ENDIAN], ids=[b[0] for b in BIG_ENDIAN])
def test_weights_from_a_big_endian_machine_are_refused_not_misread(tmp_path, fmt):
    path = tmp_path / "w.pth"
    if fmt == "zip":
        members = _members(BENIGN)
        members = [(n, b"big" if n.endswith("/byteorder") else d) for n, d in members]
        if not any(n.endswith("/byteorder") for n, _ in members):  # 1.13 writes no byteorder record
            members.append(("archive/byteorder", b"big"))
        local, central = _stored(members, 0)
        path.write_bytes(local + central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members),
                                                       len(members), len(central), len(local), 0))
    else:
        torch.save(BENIGN, path, _use_new_zipfile_serialization=False)
        blob = path.read_bytes()
        assert b"little_endianq\x02\x88" in blob
        path.write_bytes(blob.replace(b"little_endianq\x02\x88", b"little_endianq\x02\x89", 1))
    with open(path, "rb") as fh, pytest.raises(pickleguard.Refused, match="big-endian"):
        torchfile.load(fh)


def test_a_huge_legacy_storage_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    path = tmp_path / "w.pth"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    blob = path.read_bytes()
    assert b"cpuq\x06K\x04N" in blob
    path.write_bytes(blob.replace(b"cpuq\x06K\x04N", b"cpuq\x06\x8a\x05\x00\x00\x00\x00\x10N", 1))  # 2^36
    allocated = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real(*a, **k))
    with open(path, "rb") as fh, pytest.raises(pickleguard.Forged, match="in a file of"):
        torchfile.load(fh)
    assert not allocated


def _weights(prefix: str):
    from dlenv.model import pretrained

    return pretrained.Weights(model="resnet18", name="ResNet18_Weights.IMAGENET1K_V1", source="torchvision",
                              file=f"resnet18-{prefix}.pth", url=f"http://127.0.0.1:9/resnet18-{prefix}.pth",
                              num_classes=1000, img_size=224, hash_prefix=prefix)


def test_a_pretrained_file_with_a_matching_hash_prefix_is_judged_like_any_other(tmp_path, monkeypatch, capfd):
    """torchvision's file names carry 8 hex digits of the sha256: no proof. A cached file that fools the two
    readers, named with its own prefix so the prefix check passes, is refused, not run."""
    from dlenv.model import pretrained

    blob = two_directories_by_concatenation(BENIGN)
    import hashlib

    prefix = hashlib.sha256(blob).hexdigest()[:8]
    w = _weights(prefix)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    cached = tmp_path / "th" / "hub" / "checkpoints" / w.file
    cached.parent.mkdir(parents=True)
    cached.write_bytes(blob)
    with pytest.raises(UserError) as e:
        pretrained.fetched_state_dict(w, pretrained.fetch(w, progress=False))
    assert "\n" not in str(e.value) and "refusing to unpickle" in str(e.value)
    assert MARKER not in capfd.readouterr().out


def test_a_refused_download_does_not_stay_in_the_cache(tmp_path, monkeypatch):
    """From a mirror: judged before it is moved into the cache; refused, nothing is left there."""
    from dlenv.model import pretrained

    blob = two_directories_by_zip64(BENIGN)
    import hashlib

    prefix = hashlib.sha256(blob).hexdigest()[:8]
    w = _weights(prefix)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))

    def download(url, dst, hash_prefix=None, progress=True):
        Path(dst).write_bytes(blob)

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    with pytest.raises(UserError, match="refusing to unpickle"):
        pretrained.fetch(w, progress=False)
    folder = tmp_path / "th" / "hub" / "checkpoints"
    assert not folder.exists() or not list(folder.iterdir()), list(folder.iterdir())


# ---------------------------------------------------------------------------------------------------
# Attack constructions, each a variant of a class: refused in one line (nothing ran, torch's loader never
# reached), or, where the variant is harmless, loaded as exactly the bytes it holds


def _L(n: int) -> bytes:  # an int of any size (LONG1 / LONG4)
    b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return (b"\x8a" + bytes([len(b)]) if len(b) < 256 else b"\x8b" + struct.pack("<i", len(b))) + b


def _S(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s.encode())) + s.encode()


def _T(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _G(mod: str, name: str) -> bytes:
    return f"c{mod}\n{name}\n".encode()


_HOOKS = _G("collections", "OrderedDict") + b")R"


def _pid(stype="FloatStorage", key="0", numel=4, view: bytes | None = None) -> bytes:
    return _T(_S("storage"), _G("torch", stype), _S(key), _S("cpu"), _L(numel), *([view] if view else [])) + b"Q"


def _tensor(pid: bytes, offset=0, size=(4,), stride=(1,), grad=b"\x89") -> bytes:
    return _G("torch._utils", "_rebuild_tensor_v2") + _T(pid, _L(offset), _T(*map(_L, size)), _T(*map(_L, stride)),
                                                          grad, _HOOKS) + b"R"


def _dict(*pairs) -> bytes:
    return b"\x80\x02}(" + b"".join(_S(k) + v for k, v in pairs) + b"u."


def _zip(members, **override) -> bytes:
    """A zip of stored `members` ((name, data[, {field: value}])), with archive/version added; a member's
    dict overrides its method, sizes, local name or offset as a forger would."""
    if not any(str(m[0]).endswith("version") for m in members):
        members = [*members, ("archive/version", b"3\n")]
    local, central = io.BytesIO(), io.BytesIO()
    for name, data, *rest in members:
        o = rest[0] if rest else {}
        raw = name if isinstance(name, bytes) else name.encode()
        method = o.get("method", 0)
        body = data
        if method == 8:
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            body = c.compress(data) + c.flush()
        crc, usize, csize = zlib.crc32(data), o.get("usize", len(data)), o.get("csize", len(body))
        at = local.tell()
        lname = o.get("lname", raw)
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, o.get("flags", 0), method, 0, 0x21, crc,
                                o.get("lsize", csize), o.get("lsize", usize), len(lname), 0) + lname + body)
        central.write(struct.pack("<4s6H3L5HLL", b"PK\x01\x02", 20, 20, o.get("flags", 0), method, 0, 0x21, crc,
                                  csize, usize, len(raw), 0, 0, 0, 0, 0, o.get("off", at)) + raw)
    n = len(members)
    lo, ce = local.getvalue(), central.getvalue()
    return lo + ce + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(ce), len(lo), 0)


def _one(t: bytes, record: bytes = b"\0" * 16, key: str = "0") -> bytes:
    return _zip([("archive/data.pkl", _dict(("w", t))), (f"archive/data/{key}", record)])


_W = _tensor(_pid())


def _legacy(obj: bytes, keys, storages, sys_info: bytes | None = None) -> bytes:
    import pickle

    out = pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2)
    out += sys_info if sys_info is not None else pickle.dumps({"protocol_version": 1001, "little_endian": True}, 2)
    out += obj + pickle.dumps(keys, 2)
    return out + b"".join(struct.pack("<q", n) + data for n, data in storages)


def _deflated_bomb() -> bytes:  # 64 MiB of zeros in ~64 KB: inflated in full before any size was checked
    big = 64 << 20
    return _zip([("archive/data.pkl", _dict(("w", _tensor(_pid("ByteStorage", numel=big), size=(big,))))),
                 ("archive/data/0", bytes(big), {"method": 8})])


def _concatenated() -> bytes:  # a zip after other data, its offsets as if it began the file
    inner = _zip([("archive/data.pkl", _dict(("w", _W))), ("archive/data/0", b"\0" * 16)])
    return b"PK\x03\x04" + b"\0" * 60 + inner


def _locator_elsewhere() -> bytes:  # a zip64 locator that points at a record other than Python's
    blob = _zip([("archive/data.pkl", _dict(("w", _W))), ("archive/data/0", b"\0" * 16)])
    entries, size, offset = _cd_of(blob)
    end = blob.rindex(b"PK\x05\x06")
    z64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, size, offset)
    decoy = z64
    return (blob[:end] + decoy + z64 + struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1) + blob[end:])


def _million() -> bytes:  # a zip64 end record that says 2**20 members (Python would list each)
    blob = _zip([("archive/data.pkl", _dict(("w", _W))), ("archive/data/0", b"\0" * 16)])
    _, size, offset = _cd_of(blob)
    end = blob.rindex(b"PK\x05\x06")
    z64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 1 << 20, 1 << 20, size, offset)
    tail = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return blob[:end] + z64 + struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1) + tail


_PAYLOAD = "touch {marker}"
ATTACKS = [  # (id, build(marker) -> bytes, refusal reason or None for a file that loads as it is)
    # two readers: where the directory is, what a member holds
    ("zip: data before the archive", lambda m: _concatenated(), "different places"),
    ("zip: zip64 locator elsewhere", lambda m: _locator_elsewhere(), "zip64 locator"),
    ("zip: deflated data.pkl", lambda m: _zip([("archive/data.pkl", _dict(("w", _W)), {"method": 8}),
                                              ("archive/data/0", b"\0" * 16)]), "compressed member"),
    ("zip: deflate bomb in a record", lambda m: _deflated_bomb(), "compressed member"),
    ("zip: stored with two sizes", lambda m: _zip([("archive/data.pkl", _dict(("w", _W)), {"csize": 5}),
                                                  ("archive/data/0", b"\0" * 16)]), "compressed member"),
    ("zip: a record size past the file", lambda m: _zip([("archive/data.pkl", _dict(("w", _W))),
                                                        ("archive/data/0", b"\0" * 16,
                                                         {"usize": 1 << 20, "csize": 1 << 20})]),
     "truncated or corrupt"),
    ("zip: Kelvin sign and k", lambda m: _zip([("archive/data.pkl", _dict(("w", _tensor(_pid(key="k"))))),
                                              ("archive/data/\u212a", b"\1" * 16), ("archive/data/k", b"\0" * 16)]),
     "refusing"),
    ("zip: long s", lambda m: _zip([("archive/data.pkl", _dict(("w", _W))), ("archive/data/0", b"\0" * 16),
                                   ("archive/data.pk\u017f", b"")]), "refusing"),
    ("zip: NUL in a name", lambda m: _zip([(b"archive/data.pkl\0x", _dict(("w", _W))), ("archive/data/0", b"\0" * 16)]),
     "truncated or corrupt"),
    ("zip: backslashes", lambda m: _zip([("archive\\data.pkl", _dict(("w", _W))), ("archive\\data\\0", b"\0" * 16),
                                        ("archive\\version", b"3\n")]), "truncated or corrupt"),
    ("zip: two archive folders", lambda m: _zip([("archive/data.pkl", _dict(("w", _W))),
                                                 ("ARCHIVE/data/0", b"\0" * 16)]),
     "truncated or corrupt"),
    ("zip: local name differs (both read the directory)", lambda m: _zip([
        ("archive/data.pkl", _dict(("w", _W)), {"lname": b"archive/evil.pkl"}), ("archive/data/0", b"\0" * 16)]), None),
    ("zip: data descriptor", lambda m: _zip([("archive/data.pkl", _dict(("w", _W)), {"flags": 8, "lsize": 0}),
                                            ("archive/data/0", b"\0" * 16)]), None),
    ("zip: empty folder name", lambda m: _zip([("/data.pkl", _dict(("w", _W))), ("/data/0", b"\0" * 16),
                                              ("/version", b"3\n")]), None),
    ("zip: trailing data", lambda m: _zip([("archive/data.pkl", _dict(("w", _W))), ("archive/data/0", b"\0" * 16)])
     + b"junk" * 8, None),
    # the pickle: numbers, memo games, values that are not data
    ("pickle: size product past int64", lambda m: _one(_tensor(_pid(), size=(1 << 40, 1 << 40), stride=(0, 0))),
     "shows"),
    ("pickle: 64 dims of 2, stride 0", lambda m: _one(_tensor(_pid(), size=(2,) * 64, stride=(0,) * 64)), "shows"),
    ("pickle: 65 dims", lambda m: _one(_tensor(_pid(), size=(1,) * 65, stride=(0,) * 65)), "not counts"),
    ("pickle: petabytes of stride 0", lambda m: _one(_tensor(_pid(), size=(1 << 30, 1 << 20), stride=(0, 0))), "shows"),
    ("pickle: size 0 beside 2**70", lambda m: _one(_tensor(_pid(), size=(0, 1 << 70), stride=(1, 1))), "not counts"),
    ("pickle: stride 2**63 on size 0", lambda m: _one(_tensor(_pid(), size=(0, 4), stride=(1 << 63, 1))), "not counts"),
    ("pickle: offset 2**63", lambda m: _one(_tensor(_pid(), offset=1 << 63, size=(0,))), "past the end"),
    ("pickle: negative stride", lambda m: _one(_tensor(_pid(), stride=(-1,))), "not counts"),
    ("pickle: stride overflows", lambda m: _one(_tensor(_pid(), size=(2, 2), stride=(1 << 61, 0))), "past the end"),
    ("pickle: numel a bool", lambda m: _one(_tensor(_pid(numel=0).replace(_L(0), b"\x88"))), "malformed"),
    ("pickle: storage type as text", lambda m: _one(_tensor(_T(_S("storage"), _S("torch.FloatStorage"), _S("0"),
                                                               _S("cpu"), _L(4)) + b"Q")), "plain ones"),
    ("pickle: one record as two types", lambda m: _zip([("archive/data.pkl", _dict(
        ("a", _W), ("b", _tensor(_pid("DoubleStorage", numel=2), size=(2,))))), ("archive/data/0", b"\0" * 16)]),
     "two types"),
    ("pickle: memo storage called", lambda m: _zip([("archive/data.pkl", _dict(("a", _pid() + b"q\x00h\x00)R"))),
                                                   ("archive/data/0", b"\0" * 16)]), "it calls"),
    ("pickle: a tensor as a storage", lambda m: _zip([("archive/data.pkl", _dict(
        ("a", _W + b"q\x01"), ("b", _G("torch._utils", "_rebuild_tensor_v2") + _T(b"h\x01", _L(0), _T(_L(1)), _T(_L(1)),
                                                                              b"\x89", _HOOKS) + b"R"))),
        ("archive/data/0", b"\0" * 16)]), "other than a storage"),
    ("pickle: a bare storage as a value", lambda m: _one(_pid()), "left as a value"),
    ("pickle: a storage type as a value", lambda m: _one(_G("torch", "FloatStorage")), "left as a value"),
    ("pickle: a callable as a value", lambda m: _one(_G("torch._utils", "_rebuild_tensor_v2")), "left as a value"),
    ("pickle: 10,000 nested lists", lambda m: _zip([("archive/data.pkl",
                                                    b"\x80\x02" + b"]" * 10000 + b"a" * 9999 + b"."),
                                                   ("archive/data/0", b"")]), "nested more than"),
    ("pickle: a list that holds itself", lambda m: _one(b"]q\x00h\x00a"), "holds itself"),
    ("pickle: a state dict that holds itself", lambda m: _zip([("archive/data.pkl", b"\x80\x02}q\x00(" + _S("s")
                                                                + b"h\x00u."), ("archive/data/0", b"")]),
     "holds itself"),
    ("pickle: _metadata a list", lambda m: _zip([("archive/data.pkl", b"\x80\x02" + _G("collections", "OrderedDict")
                                                  + b")R(" + _S("w") + _W + b"u}(" + _S("_metadata") + b"]ub."),
                                                 ("archive/data/0", b"\0" * 16)]), "_metadata"),
    ("pickle: integer tensor asks for gradients", lambda m: _one(_tensor(_pid("LongStorage", numel=2), size=(2,),
                                                                         grad=b"\x88")), "gradients"),
    ("pickle: os.system by REDUCE", lambda m: _one(_G("os", "system") + _T(_S(_PAYLOAD.format(marker=m))) + b"R"),
     "os.system"),
    ("pickle: STACK_GLOBAL posix.system", lambda m: _one(_S("posix") + _S("system") + b"\x93"
                                                         + _T(_S(_PAYLOAD.format(marker=m))) + b"R"), "posix.system"),
    ("pickle: INST", lambda m: _one(b"(ios\nsystem\nS'" + _PAYLOAD.format(marker=m).encode() + b"'\no"), "opcode"),
    ("pickle: expanded buffer (stride 0)", lambda m: _one(_tensor(_pid(), size=(10, 4), stride=(0, 1))), None),
    ("pickle: a storage read under a memo twice", lambda m: _zip([("archive/data.pkl", _dict(
        ("a", _tensor(_pid() + b"q\x00")), ("b", _tensor(b"h\x00", size=(2,))))), ("archive/data/0", b"\0" * 16)]),
     None),
    # resources
    ("resources: 5M one-byte opcodes", lambda m: _zip([("archive/data.pkl", b"\x80\x02" + b"N0" * (5 << 19) + b"N."),
                                                      ("archive/data/0", b"")]), "opcodes"),
    ("resources: a million members said", lambda m: _million(), "members"),
    ("resources: BINUNICODE8 of 2**60", lambda m: _zip([
        ("archive/data.pkl", b"\x80\x04\x8d" + struct.pack("<Q", 1 << 60) + b"ab."), ("archive/data/0", b"")]),
     "truncated"),
    # the older format
    ("legacy: storages that add up past the file", lambda m: _legacy(
        b"\x80\x02}(" + b"".join(_S(f"k{i}") + _tensor(_pid("ByteStorage", str(i), 4096, b"N"), size=(1,))
                                 for i in range(64)) + b"u.", [str(i) for i in range(64)], [(4096, bytes(4096))]),
     "in all"),
    ("legacy: a view past its storage", lambda m: _legacy(_dict(("a", _tensor(_pid(view=_T(_S("0"), _L(2), _L(3))),
                                                                             size=(3,)))), ["0"], [(4, bytes(16))]),
     "past the end"),
    ("legacy: a count that lies", lambda m: _legacy(_dict(("w", _tensor(_pid(view=b"N")))), ["0"], [(5, bytes(16))]),
     "truncated or corrupt"),
    ("legacy: sys_info runs os.system", lambda m: _legacy(_dict(("w", _tensor(_pid(view=b"N")))), ["0"],
                                                          [(4, bytes(16))], _G("os", "system")
                                                          + _T(_S(_PAYLOAD.format(marker=m))) + b"R."), "GLOBAL"),
    ("legacy: overlapping views", lambda m: _legacy(_dict(
        ("a", _tensor(_pid(view=_T(_S("0"), _L(0), _L(3))), size=(3,))),
        ("b", _tensor(_pid(view=_T(_S("0"), _L(1), _L(3))), size=(3,)))), ["0"], [(4, bytes(16))]), None),
    ("legacy: keys in another order", lambda m: _legacy(_dict(
        ("a", _tensor(_pid(key="a", numel=1, view=b"N"), size=(1,))),
        ("b", _tensor(_pid(key="b", numel=2, view=b"N"), size=(2,)))), ["b", "a"], [(2, bytes(8)), (1, bytes(4))]),
     None),
]


@pytest.mark.parametrize("make, reason", [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_attack_variants_are_refused_in_one_line_or_load_as_they_are(tmp_path, make, reason, no_torch_loader):
    marker = tmp_path / "PAYLOAD-RAN"
    path = tmp_path / "w.pth"
    path.write_bytes(make(marker))
    if reason is None:
        got = weights.read(path, weights.LoadPolicy())[0]
        assert all(isinstance(v, torch.Tensor) for v in got.values()), got
        return
    with pytest.raises(UserError) as e:
        weights.read(path, weights.LoadPolicy())
    line = str(e.value)
    assert "\n" not in line and reason in line and "nothing in it was run" in line, line
    assert not marker.exists()
