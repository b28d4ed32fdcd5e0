"""dlenv.torchfile: a .pth file is judged and loaded from the same bytes, through torch's own zip reader.

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
from pathlib import Path
from typing import Tuple  # noqa: UP035 (TorchScript on 1.13 reads typing.Tuple)

import pytest
import torch

from dlenv import compat, pickleguard, runstate, torchfile, weights
from dlenv.errors import UserError

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
    ("end record vs concatenated-zip correction", two_directories_by_concatenation, "see different members"),
    ("zip64 locator", two_directories_by_zip64, "see different members"),
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
        runstate.load_checkpoint(path, weights.LoadPolicy(trust_pickle=trust))
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
    from dlenv import pretrained

    return pretrained.Weights(model="resnet18", name="ResNet18_Weights.IMAGENET1K_V1", source="torchvision",
                              file=f"resnet18-{prefix}.pth", url=f"http://127.0.0.1:9/resnet18-{prefix}.pth",
                              num_classes=1000, img_size=224, hash_prefix=prefix)


def test_a_pretrained_file_with_a_matching_hash_prefix_is_judged_like_any_other(tmp_path, monkeypatch, capfd):
    """torchvision's file names carry 8 hex digits of the sha256: no proof. A cached file that fools the two
    readers, named with its own prefix so the prefix check passes, is refused, not run."""
    from dlenv import pretrained

    blob = two_directories_by_concatenation(BENIGN)
    import hashlib

    prefix = hashlib.sha256(blob).hexdigest()[:8]
    w = _weights(prefix)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    cached = tmp_path / "th" / "hub" / "checkpoints" / w.file
    cached.parent.mkdir(parents=True)
    cached.write_bytes(blob)
    with pytest.raises(UserError) as e:
        pretrained.load_state(w, pretrained.fetch(w, progress=False))
    assert "\n" not in str(e.value) and "refusing to unpickle" in str(e.value)
    assert MARKER not in capfd.readouterr().out


def test_a_refused_download_does_not_stay_in_the_cache(tmp_path, monkeypatch):
    """From a mirror: judged before it is moved into the cache; refused, nothing is left there."""
    from dlenv import pretrained

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
