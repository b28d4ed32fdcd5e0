"""The files of the weights caches checked against their sha256, and whether a hub answers at all.

A Hugging Face cache stores each file as a link (snapshots/<commit>/<file>) to a blob named by its ETag,
which for LFS files is the sha256: the file is checked against that name before each use. Where the
cache has no links (filesystems without symlinks: huggingface_hub then moves the blob into the
snapshot; a cache copied with cp -r), the sha256 is taken from a small record dlenv writes when it
downloads such a file, or the file must equal a blob of the cache by content; otherwise it cannot be
checked, and is refused in one line rather than trained on silently.

No torch import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import urllib.parse
from pathlib import Path

from dlenv.errors import UserError

log = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    """The file's sha256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reason(e: BaseException) -> str:
    """The short cause of a network or file error, for a one-line message."""
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
    return str(reason).strip().splitlines()[0][:120] if str(reason).strip() else type(e).__name__


def unreachable(endpoint: str) -> str | None:
    """Why `endpoint` cannot be reached (no TCP connection within 3 s), or None. huggingface_hub retries a
    refused connection five times over ~23 s with a warning each; this asks once. Behind a proxy it is the
    library's to decide (None)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    url = urllib.parse.urlsplit(endpoint)
    if not url.hostname:
        return f"{endpoint} is not a URL"
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as e:
        return reason(e)
    return None


#: sha256 of each hub file dlenv downloaded that is a plain file, not a link to a blob named by its hash
#: (filesystems without symlinks: huggingface_hub then moves the blob into the snapshot)
_RECORD = ".dlenv-sha256.json"
_RECORD_LIMIT = 4 * 2**20  # bytes: a record of ~20,000 files; a larger one is not ours


def _records(cache: Path) -> dict[str, str]:
    try:
        with open(cache / _RECORD, "rb") as fh:
            data = json.loads(fh.read(_RECORD_LIMIT + 1)[:_RECORD_LIMIT].decode("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _key(path: Path, cache: Path) -> str:
    try:
        return str(path.absolute().relative_to(cache.absolute()))
    except ValueError:
        return str(path.absolute())


def record(path: Path, cache: Path) -> None:
    """Note the sha256 of a just-downloaded hub file that is not a link to its blob (best effort)."""
    if path.is_symlink():
        return
    from dlenv.files.atomic import write_atomic

    records = _records(cache)
    records[_key(path, cache)] = sha256_of(path)
    try:
        write_atomic((cache / _RECORD), lambda tmp: tmp.write_text(json.dumps(records, indent=1), encoding="utf-8"))
    except OSError as e:
        log.warning("--pretrained: cannot note the checksum of %s (%s); it will not be checked next time",
                    path.name, reason(e))


def check_blob(path: Path, cache: Path, label: str) -> None:
    """A hub file is a link to a blob named by its ETag, which for LFS files is the sha256; a plain file
    (no symlinks where the cache lives, or a cache copied with cp -r) must match the sha256 noted when
    dlenv downloaded it, or name a blob of the cache by its content."""
    blob = path.resolve()
    if re.fullmatch(r"[a-f0-9]{64}", blob.name):
        expected = blob.name
    else:
        expected = _records(cache).get(_key(path, cache))
        if expected is None:
            blobs = path.parents[2] / "blobs" if len(path.parents) > 2 else None
            digest = sha256_of(path)
            if blobs is not None and (blobs / digest).is_file():
                return  # a copied cache: its blobs hold a file of exactly this content
            raise UserError(f"{label} is a plain file whose checksum nothing in the cache records, so it cannot "
                            f"be checked; delete {path.parent} and run again to download it (or copy the cache "
                            "with its links: cp -a)")
    if sha256_of(blob) != expected:
        raise UserError(f"{label} does not match its checksum (sha256 {expected[:12]}...): it is corrupt or "
                        f"was changed; delete {blob} and run again")
