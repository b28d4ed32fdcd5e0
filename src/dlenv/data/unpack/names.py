"""What an archive is and what its members are called: the format from the first bytes, the name of
the destination, member names made safe (no `..`, no absolute paths, backslashes as folders, junk
dropped), which members are code (left out unless --keep-code) and zip names decoded from the code page
they were stored in."""

from __future__ import annotations

import contextlib
import os
import pkgutil
import re
import struct
import sys
import zipfile
import zlib
from importlib import machinery
from pathlib import Path

from dlenv.archives import ARCHIVE_SUFFIXES, FORMATS, names_said
from dlenv.errors import UserError

_JUNK_FILES = {".ds_store", "thumbs.db", "desktop.ini"}
#: what a dataset never needs and Python or a shell would run: sources and bytecode (`python -m` in the
#: unpacked folder imports a `dlenv/` or `argparse.py` from it before the installed one), extension
#: modules and shared libraries, scripts and Windows executables. By name, case-folded: that is how an
#: importer or a shell picks them. Permissions are never copied from an archive, so nothing is executable.
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyx", ".pxd", ".pyd", ".pyz", ".pyi", ".so", ".dll", ".dylib",
                 ".sh", ".bash", ".zsh", ".bat", ".cmd", ".ps1", ".exe")
#: versioned shared objects (libfoo.so.1.2), which the dynamic loader opens as readily as libfoo.so
_VERSIONED_SO = re.compile(r"\.so(\.\d+)+$")
_LEGACY_CODECS = ("gb18030", "cp932", "big5", "cp949")
_ZIP_UTF8_FLAG = 0x800
_ZIP_UNICODE_PATH = 0x7075


def detect_format(path: Path) -> str:
    """The archive format from the file's content: the name of its row in dlenv.archives.FORMATS (zip, tar,
    tar.gz, tar.bz2, tar.xz or 7z), by the rows' magic bytes, then by a mark further in (tar's header).

    Raises UserError for an empty file, a format we do not unpack, or a file that is no archive.
    """
    with open(path, "rb") as fh:
        head = fh.read(512)
    if not head:
        raise UserError(f"{path} is empty (0 bytes); download it again")
    for fmt in FORMATS:
        if head.startswith(fmt.magic):
            return fmt.name
    for fmt in FORMATS:
        if fmt.sniff is not None and fmt.sniff(head):
            return fmt.name
    if head[:7] in (b"Rar!\x1a\x07\x00", b"Rar!\x1a\x07\x01"):
        raise UserError(f"{path} is a RAR archive, which dlenv does not unpack; unpack it with unrar, or "
                        "re-pack it as .zip or .tar.gz")
    if head[:4] == b"\x28\xb5\x2f\xfd":
        raise UserError(f"{path} is zstd-compressed; run `zstd -d {path}` and unpack the .tar it gives")
    if zipfile.is_zipfile(path):  # a self-extracting zip: code first, the zip at the end
        return "zip"
    raise UserError(f"{path} is not an archive dlenv can unpack (its content is no {names_said()}); check the "
                    "file or download it again")


def archive_stem(path: Path) -> str:
    """'pets.tar.gz' -> 'pets'; the default destination is data/<stem>/."""
    name = path.name
    for suffix in ARCHIVE_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return path.stem or name


def clean_name(raw: str, where: str, backslashes: bool) -> str | None:
    """A member's name as a safe relative path ('a/b.jpg'), '' for the root entry, None for junk.

    `backslashes` turns Windows separators into folders (zip and 7z). Raises UserError for an
    absolute name, a `..` component or a NUL byte.
    """
    name = raw.replace("\\", "/") if backslashes else raw
    if "\x00" in name:
        raise UserError(f"{where}: member {raw!r} has a NUL byte in its name; refusing to unpack")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise UserError(f"{where}: member {raw!r} is an absolute path; refusing to unpack anything")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UserError(f"{where}: member {raw!r} points outside the destination (..); refusing to "
                        "unpack anything")
    if not parts:
        return ""
    last = parts[-1]
    if "__MACOSX" in parts or last.startswith("._") or last.lower() in _JUNK_FILES:
        return None
    return "/".join(parts)


def is_code(name: str) -> bool:
    """Whether member `name` (a cleaned relative path) is code by its name: CODE_SUFFIXES or a versioned .so."""
    last = name.rpartition("/")[2].lower()
    return last.endswith(CODE_SUFFIXES) or bool(_VERSIONED_SO.search(last))


def _zip_unicode_extra(info: zipfile.ZipInfo, raw: bytes) -> str | None:
    """The UTF-8 name in an Info-ZIP Unicode Path extra field (7-Zip, WinRAR write it), if it matches."""
    extra, i = info.extra, 0
    while i + 4 <= len(extra):
        kind, size = struct.unpack_from("<HH", extra, i)
        body = extra[i + 4: i + 4 + size]
        # version 1, then the CRC of the stored name: a stale field (name changed later) is ignored
        if (kind == _ZIP_UNICODE_PATH and len(body) > 5 and body[0] == 1
                and struct.unpack_from("<I", body, 1)[0] == zlib.crc32(raw)):
            try:
                return body[5:].decode("utf-8")
            except UnicodeDecodeError:
                return None
        i += 4 + size
    return None


def _plausible(codec: str, ch: str) -> bool:
    """Whether a non-ASCII character is a common one in the language of `codec`.

    Bytes in one East Asian code page usually decode in the others too, but into rare characters;
    counting the common ones tells them apart (GBK is preferred on a tie: our users are mostly Chinese).
    """
    o = ord(ch)
    try:
        if codec == "gb18030":
            ch.encode("gb2312")  # GB2312 holds the common simplified characters and punctuation
            return True
        if codec == "cp932":  # kana, or a JIS level-1 kanji
            return 0x3040 <= o <= 0x30FF or (0x4E00 <= o <= 0x9FFF and 0x88 <= ch.encode("cp932")[0] <= 0x9F)
        if codec == "big5":  # the frequent-character block of Big5
            return 0x4E00 <= o <= 0x9FFF and 0xA4 <= ch.encode("big5")[0] <= 0xC6
        if codec == "cp949":
            return 0xAC00 <= o <= 0xD7A3
    except UnicodeEncodeError:
        return False
    return False


def guess_name_codec(raw_names: list[bytes]) -> str:
    """The code page of zip names stored without the UTF-8 flag: utf-8, a legacy East Asian one, or cp437."""
    names = [r for r in raw_names if not r.isascii()]
    if not names:
        return "utf-8"
    best, best_key = "cp437", (0, -1.0)
    for codec in ("utf-8", *_LEGACY_CODECS):
        decoded = []
        for r in names:
            with contextlib.suppress(UnicodeDecodeError):
                decoded.append(r.decode(codec))
        if codec == "utf-8":
            if len(decoded) == len(names):
                return "utf-8"  # random bytes are almost never valid UTF-8
            continue
        chars = [c for d in decoded for c in d if ord(c) > 127]
        score = sum(_plausible(codec, c) for c in chars) / max(len(chars), 1)
        key = (len(decoded), score)
        if key > best_key:
            best, best_key = codec, key
    return best


def _zip_names(infos: list[zipfile.ZipInfo], encoding: str, where: str) -> tuple[list[str], str | None]:
    """Each member's real name, and the code page used for the unflagged ones (None: all UTF-8/ASCII)."""
    raws: list[bytes | None] = []
    for info in infos:
        if info.flag_bits & _ZIP_UTF8_FLAG:
            raws.append(None)
        else:
            # zipfile decoded the stored bytes as cp437, which maps every byte: encoding gives them back
            raws.append(info.orig_filename.encode("cp437"))
    if encoding == "auto":
        codec = guess_name_codec([r for r, i in zip(raws, infos, strict=True) if r is not None
                                  and _zip_unicode_extra(i, r) is None])
    else:
        codec = encoding
    names, used = [], None
    for info, raw in zip(infos, raws, strict=True):
        if raw is None:
            names.append(info.filename)
            continue
        unicode_name = _zip_unicode_extra(info, raw)
        if unicode_name is not None:
            names.append(unicode_name)
            continue
        try:
            names.append(raw.decode(codec))
        except UnicodeDecodeError:
            if encoding != "auto":
                raise UserError(f"{where}: member name {raw!r} is not valid {encoding}; try "
                                "--name-encoding auto or another code page") from None
            names.append(raw.decode("cp437"))
        if not raw.isascii():
            used = codec
    return names, used


def importable_names() -> frozenset[str]:
    """Every top-level module name this Python can import without the working folder: its own (built in and
    the standard library's list), and each module and package on sys.path (pkgutil lists what the import
    system would find there), dlenv included. Derived, not a list: whatever dlenv or a library it loads
    imports is one of them, whichever profile this is."""
    paths = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(os.getcwd())]
    found = {m.name for m in pkgutil.iter_modules(paths)}
    return frozenset(found | set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ())) | {"dlenv"})


def module_of(name: str, is_dir: bool) -> str | None:
    """The top-level module an entry of a folder would be imported as from it: a folder (a package, or a
    namespace part) by its name, a module file by its stem; None for anything else."""
    if is_dir:
        return name if name.isidentifier() else None
    for suffix in machinery.all_suffixes():
        if name.endswith(suffix) and name[: -len(suffix)].isidentifier():
            return name[: -len(suffix)]
    # an extension module built for another Python (numpy.cpython-310-x86_64-linux-gnu.so read by 3.11, a
    # .pyd): the image's Python would import it, so it counts by the module name before its first dot
    if name.endswith(_ANY_PYTHONS_MODULE) and name.split(".", 1)[0].isidentifier():
        return name.split(".", 1)[0]
    return None


#: module-file endings of any CPython, whatever its version or platform (this one's are machinery's)
_ANY_PYTHONS_MODULE = (".py", ".pyc", ".pyw", ".so", ".pyd")
