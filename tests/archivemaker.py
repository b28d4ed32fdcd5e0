"""Archives and folders for the unpack tests (tests/data/unpack/): zip and tar files built member by member
(links, devices, folders as TarInfo or ZipInfo), a small dataset's members, and a snapshot of a folder to
compare before and after."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (hidden ones too) -> what it is and holds."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def make_zip(path: Path, members: list, compression=zipfile.ZIP_DEFLATED) -> Path:
    """members: (name or ZipInfo, bytes); a name ending in '/' is a folder."""
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members:
            z.writestr(name, data)
    return path


def zip_link(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


def make_tar(path: Path, members: list, mode: str = "w") -> Path:
    """members: (name, bytes) files, or TarInfo objects (links, folders, devices)."""
    with tarfile.open(path, mode) as t:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                t.addfile(m)
            else:
                ti = tarfile.TarInfo(m[0])
                ti.size = len(m[1])
                t.addfile(ti, io.BytesIO(m[1]))
    return path


def tar_entry(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    return ti


def dataset_members(top: str = "ds/") -> list:
    return [(f"{top}train/cat/{i}.jpg", os.urandom(300)) for i in range(2)] + \
           [(f"{top}val/dog/{i}.jpg", os.urandom(300)) for i in range(2)]
