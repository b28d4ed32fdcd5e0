"""The one reader of a .pth file: judged and loaded from the same bytes, never by torch.load.

A zip can be read two ways. Python's `zipfile` and torch's reader (miniz, behind torch.load) find the
central directory differently (Python corrects for data before the archive and ignores the zip64
locator's offset; torch follows it), and torch looks records up without regard to letter case. So a
file can show Python a plain state dict and torch a TorchScript archive, which torch 1.13's
`torch.load(weights_only=True)` hands to `torch.jit.load`, running its code. A guard that reads the file
with one reader and then lets another load it guards nothing.

Here one reader does both: torch's own (`torch._C.PyTorchFileReader`, the one torch.load uses) lists the
records and gives their bytes; dlenv.files.pickleguard plays data.pkl against its allowlist and, through the
builder below, makes each checked storage and tensor from those very bytes (`torch.frombuffer`,
`as_strided`). torch.load is never called on a file that has not been consented to (--trust-pickle), on
any PyTorch. As a second line, Python's view of the zip must list the same members in the same order;
a file the two readers see differently is forged (torch.save never writes one) and refused even with
--trust-pickle. The older non-zip format is read with Python's own reads, as torch's legacy loader does.

Tensors are built on the CPU, each storage once (tensors that shared memory when saved share it again).
"""

from __future__ import annotations

import io
import struct
import tarfile
import zipfile
from collections.abc import Callable
from typing import Any, BinaryIO

from dlenv.files import pickleguard
from dlenv.files.pickleguard import Damaged, Forged, Refused, Storage, StorageType, is_count, storage_pid
from dlenv.files.picklework import Budget, play

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
#: members of one zip: a run file has one per storage (a model, its optimizer and EMA: tens of
#: thousands); a million empty ones would take Python's reader seconds and ~1 GB to list
_MAX_MEMBERS = 2**19

#: storage type -> the dtype its elements are
_DTYPE = {"Double": "float64", "Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
          "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
          "ComplexFloat": "complex64", "ComplexDouble": "complex128", "Untyped": "uint8", "_Untyped": "uint8"}


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:100]


class _TorchArchive:
    """A zip as torch.load's reader sees it, refused unless Python's zipfile sees the same members."""

    def __init__(self, fh: BinaryIO):
        import torch

        try:
            said = _directory_said(fh)
            zf = zipfile.ZipFile(fh)
            infos = zf.infolist()
        except Refused:  # a ValueError too: ours, said as it is
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error) as e:
            raise Damaged(f"a damaged zip ({_first(e)})") from None
        if zf.start_dir != said:
            # Python found the directory elsewhere than the end record says (it corrects for data before
            # a "concatenated" zip; torch does not): each reader may be reading a directory of its own
            raise Forged("Python's zip reader and torch's find its directory in different places")
        for i in infos:
            # torch.save stores every record as it is; a deflated one is inflated in full before any size
            # is checked (a zip bomb: a few MB of file, gigabytes of memory)
            if i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size:
                raise Forged(f"a compressed member {i.filename[:40]} (torch.save stores them as they are)")
        python = [i.filename for i in infos]
        fh.seek(0)
        try:
            self._reader = torch._C.PyTorchFileReader(fh)
            self._names = list(self._reader.get_all_records())
        except (RuntimeError, ValueError, OSError) as e:
            raise Damaged(f"a zip torch's reader cannot open ({_first(e)})") from None
        folder = python[0].split("/", 1)[0] + "/" if python and "/" in python[0] else ""
        if not folder or [folder + n for n in self._names] != python:
            raise Forged(f"Python's zip reader and torch's see different members in it ({len(python)} against "
                         f"{len(self._names)}, or other names): two directories, one for each reader")
        folded = [n.casefold() for n in self._names]
        if len(set(folded)) != len(folded):
            # torch's record lookup ignores letter case: with two such names, which one it loads is not ours
            raise Forged("a zip with two members whose names are equal or differ only in letter case")
        # one directory (checked above), so Python's sizes are torch's: no record is read to learn its size
        self._sizes = {n: i.file_size for n, i in zip(self._names, infos, strict=True)}
        own = getattr(self._reader, "get_record_size", None)  # torch 2.x says it too: a second witness
        if own and any(own(n) != size for n, size in self._sizes.items()):
            raise Forged("Python's zip reader and torch's see members of different sizes")

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> bytes:
        try:
            data = self._reader.get_record(name)
        except (RuntimeError, ValueError, OSError, MemoryError) as e:
            raise Damaged(f"a damaged zip member {name[:40]} ({_first(e)})") from None
        if len(data) != self._sizes[name]:
            raise Forged(f"a member {name[:40]} whose size torch's reader and Python's see differently")
        return data

    def size(self, name: str) -> int:
        return self._sizes[name]


def _directory_said(fh: BinaryIO) -> int:
    """Where the end record says the central directory starts, after checking that a zip64 locator, if
    there is one, points at the zip64 record Python reads (right before it; torch follows the locator)."""
    end = zipfile._EndRecData(fh)  # Python's own reading of the end record (and of the zip64 one)
    if end is None:
        raise Damaged("a damaged zip (no end record)")
    if end[zipfile._ECD_ENTRIES_TOTAL] > _MAX_MEMBERS:
        raise Refused(f"a zip of {end[zipfile._ECD_ENTRIES_TOTAL]:,} members, more than a weights file has")
    at = end[zipfile._ECD_LOCATION]
    if at >= 20:
        fh.seek(at - 20)
        locator = fh.read(20)
        if locator[:4] == b"PK\x06\x07" and struct.unpack("<4sLQL", locator)[2] != at - 20 - 56:
            raise Forged("a zip64 locator that points elsewhere than the record Python's reader reads")
    return end[zipfile._ECD_OFFSET]


class _Tensors(pickleguard.Builder):
    """Real CPU tensors for the values pickleguard has checked."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def storage(self, stype: StorageType, numel: int, data: Callable[[], bytes] | None) -> Storage:
        torch = self.torch
        nbytes = numel * stype.itemsize
        if data is None or not nbytes:
            flat = torch.empty(nbytes, dtype=torch.uint8)
        else:  # one copy of the record, writable (the optimizer state loaded from it is updated in place)
            record = data()
            if len(record) < nbytes:  # checked against the directory's size; the bytes must agree
                raise Damaged("a storage record shorter than its size")
            flat = torch.frombuffer(bytearray(memoryview(record)[:nbytes]), dtype=torch.uint8)
        name = stype.name.rsplit(".", 1)[1].removesuffix("Storage")
        return Storage(numel, flat.view(getattr(torch, _DTYPE[name])))

    def fill(self, storage: Storage, fh: BinaryIO, nbytes: int) -> None:
        if nbytes and fh.readinto(storage.value.view(self.torch.uint8).numpy()) != nbytes:
            raise Damaged("a storage cut short (the file ends inside it)")

    def tensor(self, storage: Storage, offset: int, size: tuple, stride: tuple, requires_grad: bool) -> Any:
        t = storage.value.as_strided(size, stride, storage.base + offset)
        if requires_grad:
            if not (t.is_floating_point() or t.is_complex()):
                raise Damaged("an integer tensor that asks for gradients")
            t.requires_grad_(True)
        return t

    def parameter(self, tensor: Any, requires_grad: bool) -> Any:
        if requires_grad and not (tensor.is_floating_point() or tensor.is_complex()):
            raise Damaged("an integer parameter that asks for gradients")
        return self.torch.nn.Parameter(tensor, requires_grad=requires_grad)

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name.split(".", 1)[1])

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, self.torch.Tensor)




def _check_zip(archive: _TorchArchive, build: pickleguard.Builder) -> Any:
    names = archive.names()
    present = set(names)
    if "constants.pkl" in present or any(n.startswith("code/") for n in names):
        # torch 1.13's torch.load hands such a file to torch.jit.load, even under weights_only=True
        raise Refused("a TorchScript archive, not a weights file")
    if "data.pkl" not in present:
        raise Refused("a zip without data.pkl")
    if "byteorder" in present and archive.read("byteorder").strip() not in (b"little", b""):
        raise Refused("weights written on a big-endian machine (re-save them on this one)")
    size = archive.size("data.pkl")
    if size > pickleguard.PICKLE_LIMIT:
        raise Refused(f"its pickle is {size:,} bytes, more than the {pickleguard.PICKLE_LIMIT:,} a weights file needs")
    data = archive.read("data.pkl")
    storages: dict[str, tuple[str, Storage]] = {}

    def persistent(pid: Any) -> Storage:
        stype, key, numel, _ = storage_pid(pid, 0)
        if key in storages:  # one record, one storage (tensors that share it share memory, as in torch)
            if (storages[key][0], storages[key][1].numel) != (stype.name, numel):
                raise Forged("one storage record read as two types or sizes")
            return storages[key][1]
        record = "data/" + key
        if record not in present:
            raise Damaged(f"a storage whose record {record} is not in the file")
        have = archive.size(record)
        if numel * stype.itemsize > have:
            raise Forged(f"a storage of {numel:,} elements in a record of {have:,} bytes")
        storages[key] = (stype.name, build.storage(stype, numel, lambda: archive.read(record)))
        return storages[key][1]

    return play(io.BytesIO(data), persistent, build=build)


class _Bounded:
    """The reads genops makes of a file, refused past `limit` bytes from where it starts: a length field
    in a pickle (BINUNICODE8, LONG4) cannot make it read gigabytes of a large file into memory."""

    def __init__(self, fh: BinaryIO, limit: int):
        self.fh, self.end = fh, fh.tell() + limit

    def _room(self, n: int) -> int:
        room = self.end - self.fh.tell()
        if n > room:
            raise Damaged(f"its pickles are more than the {pickleguard.PICKLE_LIMIT:,} bytes a weights file needs")
        return n

    def read(self, n: int = -1) -> bytes:
        return self.fh.read(self._room(n if n >= 0 else self.end - self.fh.tell()))

    def readline(self) -> bytes:
        room = self.end - self.fh.tell()
        line = self.fh.readline(room + 1)
        self._room(len(line))
        return line

    def tell(self) -> int:
        return self.fh.tell()


def _check_legacy(fh: BinaryIO, build: pickleguard.Builder) -> Any:
    """torch's format before 1.6: magic, protocol, sys_info, the object, the storage keys (five
    pickles), then each storage as an 8-byte element count and its bytes. Python's own reads of the file,
    as torch's legacy loader makes them: one reader."""
    start = fh.tell()
    try:  # torch tries the older tar format first: a file that opens as a tar goes down that path
        tarfile.open(fileobj=fh, mode="r:").close()
        is_tar = True
    except (tarfile.TarError, OSError, ValueError, EOFError):
        is_tar = False
    if is_tar:
        raise Refused("the pre-1.0 tar format of torch.save")
    fh.seek(start)
    end = fh.seek(0, io.SEEK_END)
    fh.seek(start)
    pickles = _Bounded(fh, pickleguard.PICKLE_LIMIT)
    budget = Budget()  # one for the file's five pickles
    if play(pickles, None, allow_globals=False, budget=budget) != _LEGACY_MAGIC:
        raise Refused("a pickle that is not a torch.save file")
    if play(pickles, None, allow_globals=False, budget=budget) != _LEGACY_PROTOCOL:
        raise Refused("a torch.save file of an unknown protocol")
    sys_info = play(pickles, None, allow_globals=False, budget=budget)
    if not isinstance(sys_info, dict):
        raise Refused("a torch.save file without its sys_info")
    if sys_info.get("little_endian", True) is not True:
        raise Refused("weights written on a big-endian machine (re-save them on this one)")
    storages: dict[str, tuple[StorageType, Storage]] = {}
    views: list[tuple[str, int, int]] = []
    claimed = [0]  # bytes of all storages so far: each is allocated before its bytes are read

    def persistent(pid: Any) -> Storage:
        stype, key, numel, view = storage_pid(pid, 1)
        if key in storages and (storages[key][0].name, storages[key][1].numel) != (stype.name, numel):
            raise Forged("one storage key with two types or sizes")
        if key not in storages:
            claimed[0] += numel * stype.itemsize
            if claimed[0] > end:  # before anything is allocated for it (all of them fit the file)
                raise Forged(f"storages of {claimed[0]:,} bytes in all (the last of {numel:,} elements) in a "
                             f"file of {end:,} bytes")
            storages[key] = (stype, build.storage(stype, numel, None))
        root = storages[key][1]
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and is_count(view[1]) and is_count(view[2])):
            raise Refused("a storage view of a malformed shape")
        if view[1] + view[2] > numel:
            raise Forged("a storage view past the end of its storage")
        views.append((key, view[1], view[2]))
        return build.view(root, view[1], view[2])

    obj = play(pickles, persistent, build=build, budget=budget)
    keys = play(pickles, None, allow_globals=False, budget=budget)
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)) or set(keys) != set(storages) \
            or len(keys) != len(set(keys)):
        raise Refused("storage keys that do not match its storages")
    # then each storage in key order: its element count (int64, little-endian) and its bytes
    pos = fh.tell()
    for key in keys:
        fh.seek(pos)
        head = fh.read(8)
        stype, storage = storages[key]
        if len(head) < 8 or int.from_bytes(head, "little", signed=True) != storage.numel:
            raise Damaged(f"storage {key[:16]} does not hold the {storage.numel:,} elements its tensors use")
        nbytes = storage.numel * stype.itemsize
        if pos + 8 + nbytes > end:
            raise Damaged(f"storage {key[:16]} reaches past the end of the file (cut short?)")
        build.fill(storage, fh, nbytes)
        pos += 8 + nbytes
    return obj


def read(fh: BinaryIO, build: pickleguard.Builder) -> Any:
    """Judge the .pth file open in `fh` (binary, seekable) from its start, and return what `build` makes of
    it; raises Refused (or Damaged, Forged) with the reason when it holds anything outside the allowlist
    (dlenv.files.pickleguard's module doc)."""
    fh.seek(0)
    head = fh.read(4)
    fh.seek(0)
    try:
        if head == b"PK\x03\x04":  # the same test torch.load makes to choose the zip reader
            return _check_zip(_TorchArchive(fh), build)
        if head[:1] == b"\x80":
            return _check_legacy(fh, build)
    except (RuntimeError, MemoryError) as e:  # torch refused to build a checked value (out of memory)
        raise Damaged(f"a value torch cannot build ({_first(e)})") from None
    raise Refused("not a file torch.save writes (neither its zip nor its older pickle format)")


def load(fh: BinaryIO) -> Any:
    """What the .pth file open in `fh` holds, built from the bytes the allowlist judged (module doc).
    Raises pickleguard.Refused (Damaged, Forged) with the reason for a file outside the allowlist."""
    return read(fh, _Tensors())


def check(fh: BinaryIO) -> None:
    """Judge the file open in `fh` as `load` would, through the same reader, building nothing."""
    read(fh, pickleguard.Builder())
