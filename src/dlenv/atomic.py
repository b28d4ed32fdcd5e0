"""Write a file whole or not at all: a temporary file beside it, renamed into place when complete.

Reports, plots, config.yaml and exports all go through here, so an interrupted run leaves the old file
or the new one, never half of one. (Checkpoints and the image cache also fsync: dlenv.checkpoint and
dlenv.data.cache.) No torch here: plots import this module.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp_path)` for a temporary file beside `path`, then os.replace it into place.

    A failure (or Ctrl-C) removes the temporary file and leaves whatever was at `path` untouched.
    Returns `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | Path, data: bytes) -> Path:
    """`data` to `path`, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | Path, text: str) -> Path:
    """`text` (UTF-8) to `path`, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
