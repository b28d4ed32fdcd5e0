"""The one reader of a .pth file: judged and loaded from the same bytes, never by torch.load.

A zip can be read two ways. Python's `zipfile` and torch's reader (miniz, behind torch.load) find the
central directory differently (Python corrects for data before the archive and ignores the zip64
locator's offset; torch follows it), and torch looks records up without regard to letter case. So a
file can show Python a plain state dict and torch a TorchScript archive, which torch 1.13's
`torch.load(weights_only=True)` hands to `torch.jit.load`, running its code. A guard that reads the file
with one reader and then lets another load it guards nothing.

Here one reader does both: torch's own (`torch._C.PyTorchFileReader`, the one torch.load uses) lists the
records and gives their bytes; dlenv.pickleguard plays data.pkl against its allowlist and, through the
builder below, makes each checked storage and tensor from those very bytes (`torch.frombuffer`,
`as_strided`). torch.load is never called on a file that has not been consented to (--trust-pickle), on
any PyTorch. As a second line, Python's view of the zip must list the same members in the same order;
a file the two readers see differently is forged (torch.save never writes one) and refused even with
--trust-pickle. The older non-zip format is read with Python's own reads, as torch's legacy loader does.

Tensors are built on the CPU, each storage once (tensors that shared memory when saved share it again).
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from typing import Any, BinaryIO

from dlenv import pickleguard
from dlenv.pickleguard import Damaged, Forged, _Storage, _StorageType

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
            python = [i.filename for i in zipfile.ZipFile(fh).infolist()]
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as e:
            raise Damaged(f"a damaged zip ({_first(e)})") from None
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
        self._last: tuple[str, bytes] | None = None

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> bytes:
        if self._last and self._last[0] == name:  # size() just read it (torch 1.13 has no record sizes)
            data, self._last = self._last[1], None
            return data
        try:
            return self._reader.get_record(name)
        except (RuntimeError, ValueError, OSError, MemoryError) as e:
            raise Damaged(f"a damaged zip member {name[:40]} ({_first(e)})") from None

    def size(self, name: str) -> int:
        data = self.read(name)
        self._last = (name, data)
        return len(data)


class _Tensors(pickleguard.Builder):
    """Real CPU tensors for the values pickleguard has checked."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def storage(self, stype: _StorageType, numel: int, data: Callable[[], bytes] | None) -> _Storage:
        torch = self.torch
        nbytes = numel * stype.itemsize
        if data is None or not nbytes:
            flat = torch.empty(nbytes, dtype=torch.uint8)
        else:  # one copy of the record, writable (the optimizer state loaded from it is updated in place)
            flat = torch.frombuffer(bytearray(memoryview(data())[:nbytes]), dtype=torch.uint8)
        name = stype.name.rsplit(".", 1)[1].removesuffix("Storage")
        return _Storage(numel, flat.view(getattr(torch, _DTYPE[name])))

    def fill(self, storage: _Storage, fh: BinaryIO, nbytes: int) -> None:
        if nbytes and fh.readinto(storage.value.view(self.torch.uint8).numpy()) != nbytes:
            raise Damaged("a storage cut short (the file ends inside it)")

    def tensor(self, storage: _Storage, offset: int, size: tuple, stride: tuple, requires_grad: bool) -> Any:
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


def load(fh: BinaryIO) -> Any:
    """What the .pth file open in `fh` holds, built from the bytes the allowlist judged (module doc).
    Raises pickleguard.Refused (Damaged, Forged) with the reason for a file outside the allowlist."""
    return pickleguard.read(fh, _TorchArchive, _Tensors())


def check(fh: BinaryIO) -> None:
    """Judge the file open in `fh` as `load` would, through the same reader, building nothing."""
    pickleguard.read(fh, _TorchArchive)
