"""The archive formats `dlenv unpack` reads, one row each in FORMATS: the format's name, the file names it goes
by, the bytes that tell it, and the function of dlenv.data.unpack.formats that reads its members. Detection
(data/unpack/names.detect_format), the dispatch (data/unpack), the destination's name (names.archive_stem), the
path checks' hint (pathcheck.FIXES) and the line for an archive passed where a folder belongs
(errors.need_folder) all read this table, so a new format is one row here and its reader.

It sits below errors.py so that errors.py can read it: bytes and names only, no dlenv, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchiveFormat:
    """One format `dlenv unpack` reads."""

    name: str  #: what detect_format returns and UnpackResult.format holds
    suffixes: tuple[str, ...]  #: the file names it goes by, lower case (no one ends with another's)
    magic: tuple[bytes, ...] = ()  #: its first bytes, any one of these
    #: a mark elsewhere in the first 512 bytes (tar's), tried only after every row's magic
    sniff: Callable[[bytes], bool] | None = None
    reader: str = "unpack_tar"  #: the function of dlenv.data.unpack.formats that reads its members
    compression: str | None = None  #: a tar's outer stream: "gzip", "bz2" or "lzma", the module that opens it
    #: its members' sizes are listed up front (zip, 7z): the bar counts unpacked bytes; otherwise it follows the
    #: raw file's position, read front to back
    listed: bool = False


def is_tar(head: bytes) -> bool:
    """Whether the first 512 bytes are a tar header: the POSIX mark, an old (pre-POSIX) header's valid checksum
    (the only mark it has), or a block of zeros (an empty tar)."""
    return head[257:262] == b"ustar" or _is_v7_tar(head) or (len(head) == 512 and not any(head))


def _is_v7_tar(head: bytes) -> bool:
    if len(head) < 512:
        return False
    try:
        stored = int(head[148:156].replace(b"\x00", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(head[:148]) + 8 * 32 + sum(head[156:512])


#: every format, in the order messages name them
FORMATS: tuple[ArchiveFormat, ...] = (
    ArchiveFormat("zip", (".zip",), magic=(b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08"), reader="unpack_zip",
                  listed=True),
    ArchiveFormat("tar", (".tar",), sniff=is_tar),
    ArchiveFormat("tar.gz", (".tar.gz", ".tgz"), magic=(b"\x1f\x8b",), compression="gzip"),
    ArchiveFormat("tar.bz2", (".tar.bz2", ".tbz2", ".tbz"), magic=(b"BZh",), compression="bz2"),
    ArchiveFormat("tar.xz", (".tar.xz", ".txz"), magic=(b"\xfd7zXZ\x00",), compression="lzma"),
    ArchiveFormat("7z", (".7z",), magic=(b"7z\xbc\xaf\x27\x1c",), reader="unpack_7z", listed=True),
)
BY_NAME = {f.name: f for f in FORMATS}
#: the archive names `dlenv unpack` takes (errors.need_folder names a file of these as an archive)
ARCHIVE_SUFFIXES = tuple(s for f in FORMATS for s in f.suffixes)


def said(names: list[str]) -> str:
    """'a, b or c'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def names_said() -> str:
    """'zip, tar, tar.gz, tar.bz2, tar.xz or 7z'."""
    return said([f.name for f in FORMATS])


def suffixes_said() -> str:
    """'.zip, .tar(.gz/.bz2/.xz) or .7z': each format's first suffix, a compressed one ('tar.gz', named after
    what it holds) folded into the plain one's."""
    said_as = []
    for f in FORMATS:
        if "." not in f.name:
            inner = [g.suffixes[0].removeprefix(f.suffixes[0]) for g in FORMATS if g.name.startswith(f.name + ".")]
            said_as.append(f.suffixes[0] + (f"({'/'.join(inner)})" if inner else ""))
    return said(said_as)
