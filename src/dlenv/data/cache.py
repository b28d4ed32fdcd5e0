"""`--cache`: decode a dataset once into fixed-size uint8 images, in memory or in a file on disk.

Decoding JPEGs is what usually starves a fast GPU. With a cache every image is decoded once, to the
stored form of `decode` (the whole frame as a size x size uint8 square, plus its width and height),
and each batch afterwards is a copy out of one big array; cropping and flipping happen on the GPU
(`gpu_aug`). A cache takes `nbytes`: 4 GB for 20,000 images at 224 px, 255 GB for ImageNet's 1.28 million.

- ram: a NumPy array in this process, decoded at every start.
- disk: a memory-mapped file under --cache-dir, written to a temporary name and renamed into place
  when complete, then reused by later runs while the files (paths, sizes, modification times) and the
  image size are the same; the operating system keeps the hot part in its page cache. The cache's own
  files are data from disk too: their sizes, the .npy header's shape and dtype and the numbers in it
  are checked against the dataset before anything is mapped or loaded, and a mismatch is decoded
  again, in one line.
Which of the two is the input plan's decision (dlenv.data.plan.decide_cache_mode); `on_disk` tells it
whether a disk cache of the same data is already there.

Decoding runs in threads: Pillow, OpenCV and torchvision release the GIL while decoding and resizing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from tokenize import TokenError

import numpy as np

from dlenv.data.badimages import KnownBad, bad_image_reason, first_readable, skipped_line
from dlenv.data.decode import decode_stored
from dlenv.errors import UserError
from dlenv.files.atomic import write_atomic, write_bytes, write_file
from dlenv.files.safeio import SMALL_FILE, open_regular, read_regular

log = logging.getLogger("dlenv.data")

#: bump when the stored form changes, so older cache files are not mistaken for current ones
VERSION = 1
_CHUNK = 32  # images per task handed to a decoding thread


@dataclass
class DecodedCache:
    """A decoded dataset. `source[i]` is the row that stands for sample i, pixels and label: i itself, or
    for a file that failed to decode (bad_images='skip') the one `badimages.first_readable` names."""

    images: np.ndarray          # (N, S, S, 3) uint8; an np.memmap for disk caches
    sizes: np.ndarray           # (N, 2) int32: decoded width, height
    labels: np.ndarray          # (N,) int64
    source: np.ndarray          # (N,) int64
    where: str                  # "ram", or the cache file
    bad: dict[str, str] = field(default_factory=dict)   # path -> reason, for files that failed
    reused: bool = False

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def size(self) -> int:
        return int(self.images.shape[1])


def nbytes(n: int, size: int) -> int:
    """Bytes a cache of n images at `size` takes."""
    return n * size * size * 3


def cache_key(samples: Sequence[tuple[str, int]], size: int) -> str:
    """Hex digest of (format version, size, every path with its byte size and modification time).

    Raises UserError if a file disappeared since the dataset was listed.
    """
    h = hashlib.sha1(f"dlenv-cache {VERSION} {size} {len(samples)}\n".encode())
    for path, _ in samples:
        try:
            st = os.stat(path)
        except OSError as e:
            raise UserError(f"--cache: cannot read {path} ({e.strerror}); was the dataset changed "
                            "while it was being listed?") from None
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def available_memory() -> int:
    """Bytes of memory this process can still take: MemAvailable, capped by a cgroup limit if set."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 1 << 62
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    return max(int(avail), 0)


def _paths(cache_dir: Path, key: str) -> tuple[Path, Path, Path]:
    stem = cache_dir / key[:24]
    return stem.with_suffix(".u8"), stem.with_suffix(".sizes.npy"), stem.with_suffix(".json")


#: the widest or tallest decoded image a sizes file may name: Pillow refuses an image of over ~179 million
#: pixels, so no decode gives a side this long; a bigger (or non-positive) number is a damaged file
MAX_SIDE = 1 << 28


class _Stale(Exception):
    """A disk cache marked complete whose files do not match the dataset; str() says how."""


def _read_sizes(path: Path, n: int) -> np.ndarray:
    """The (n, 2) int32 sizes file, loaded only after its .npy header says exactly that shape and dtype
    and its byte size matches: np.load alone would unpickle an object array, allocate whatever a header
    asks for (7 TiB), or hand back any shape. Raises _Stale saying what is wrong."""
    want = n * 2 * 4
    try:  # a regular file of at most the array and a header: a FIFO, /dev/zero or a huge file is refused
        with open_regular(path, "cache sizes file", want + 64 * 1024) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise _Stale(f"{path.name} is .npy format {version[0]}.{version[1]}, not the 1.0 dlenv writes")
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            if dtype != np.dtype("<i4") or fortran or shape != (n, 2):
                raise _Stale(f"{path.name} holds a {'x'.join(map(str, shape)) or 'scalar'} {dtype} array"
                             f"{' (Fortran order)' if fortran else ''}, not the {n}x2 int32 of this dataset")
            if os.fstat(f.fileno()).st_size != f.tell() + want:
                raise _Stale(f"{path.name} is {os.fstat(f.fileno()).st_size:,} bytes, not the "
                             f"{f.tell() + want:,} its header and this dataset make")
            f.seek(0)
            return np.load(f, allow_pickle=False)
    except (UserError, OSError, ValueError, EOFError, SyntaxError, TokenError, RecursionError) as e:
        # ...what numpy's header parser (ast, then tokenize for old headers) raises on a header it cannot read
        raise _Stale(f"{path.name} is not a sizes file ({' '.join(str(e).split())[:200]})") from None


def _complete(cache_dir: Path, key: str, n: int, size: int) -> tuple[dict | None, np.ndarray | None, str | None]:
    """(meta, sizes, None) of a complete disk cache for `key`; (None, None, None) when there is none (no
    meta file: never built, or cut short before its meta was written); (None, None, why) when one is
    marked complete but its files do not match this dataset (edited, damaged, or cut by a full disk)."""
    data, sizes_path, meta = _paths(cache_dir, key)
    if not os.path.lexists(meta):
        return None, None, None
    try:  # only a small regular file: a FIFO or /dev/zero put there must not hang or fill memory
        m = json.loads(read_regular(meta, SMALL_FILE, "cache meta"))
        if not isinstance(m, dict):
            raise _Stale(f"{meta.name} is not a cache's meta file")
        if m.get("key") != key or m.get("n") != n or m.get("size") != size:
            raise _Stale(f"{meta.name} describes other data")
        have = os.stat(data).st_size if os.path.isfile(data) else None
        if have != nbytes(n, size):
            raise _Stale(f"{data.name} is {'missing' if have is None else f'{have:,} bytes'}, not the "
                         f"{nbytes(n, size):,} of {n:,} images at {size} px")
        sizes = _read_sizes(sizes_path, n)
        bad = _bad_rows(m, n)
        good = np.ones(n, bool)
        good[list(bad)] = False
        if good.any() and not ((sizes[good] >= 1) & (sizes[good] <= MAX_SIDE)).all():
            raise _Stale(f"{sizes_path.name} holds image sizes that no decoded image has")
    except (OSError, ValueError, UserError) as e:  # unreadable, not JSON, not a regular file
        return None, None, f"{meta.name} cannot be read ({' '.join(str(e).split())[:200]})"
    except _Stale as e:
        return None, None, str(e)
    return m, sizes, None


def _bad_rows(meta: dict, n: int) -> dict[int, str]:
    """{index: reason} of the files that failed to decode, as the meta file lists them: only indices of
    this dataset (a bad one would index past the arrays)."""
    listed = meta.get("bad")
    listed = listed if isinstance(listed, dict) else {}
    return {int(k): str(v) for k, v in listed.items() if str(k).isdigit() and int(k) < n}


def on_disk(samples: Sequence[tuple[str, int]], size: int, cache_dir: str | os.PathLike) -> bool:
    """Whether `cache_dir` holds a disk cache of `samples` at `size` marked complete, matching or not (a
    damaged one is rebuilt where it was, not left beside a ram cache). Reads only the small meta file."""
    cache_dir = Path(cache_dir)
    n = len(samples)
    meta, _, stale = _complete(cache_dir, cache_key(samples, size), n, size)
    return meta is not None or stale is not None


def _fill(images: np.ndarray, sizes: np.ndarray, samples: Sequence[tuple[str, int]], size: int,
          decoder: str, workers: int) -> dict[int, str]:
    """Decode every sample into images/sizes in `workers` threads; returns {index: reason} of failures."""
    bad: dict[int, str] = {}

    def work(start: int) -> None:
        for i in range(start, min(start + _CHUNK, len(samples))):
            try:
                images[i], sizes[i] = decode_stored(samples[i][0], size, decoder)
            except Exception as e:  # any decoder error: the file is what's wrong
                bad[i] = bad_image_reason(e)

    starts = range(0, len(samples), _CHUNK)
    from tqdm import tqdm

    bar = tqdm(total=len(samples), desc="decoding", unit="img", disable=not sys.stderr.isatty(),
               leave=False, dynamic_ncols=True)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for start, _ in zip(starts, pool.map(work, starts), strict=True):
            bar.update(min(_CHUNK, len(samples) - start))
    bar.close()
    return bad


def _substitutes(bad: dict[int, str], samples: Sequence[tuple[str, int]], bad_images: str) -> np.ndarray:
    """`source` rows: each bad index points at the sample `badimages.first_readable` names. Raises
    BadImageError as asked."""
    source = np.arange(len(samples), dtype=np.int64)
    known = KnownBad(bad)
    for i in sorted(bad):
        source[i] = first_readable(i, samples, lambda j: j, known, bad_images)[0]
    return source


def build_cache(samples: Sequence[tuple[str, int]], size: int, decoder: str = "pil", mode: str = "ram",
                cache_dir: str | os.PathLike = ".dlenv-cache", workers: int = 1, bad_images: str = "skip",
                say: Callable[[str], None] = print) -> DecodedCache:
    """Decode `samples` once to size x size uint8 squares in `mode` 'ram' or 'disk' (the input plan's; a
    matching disk cache is reused).

    Files that fail to decode are logged in one line and replaced by the sample `badimages.first_readable`
    names (bad_images='skip'), or stop with BadImageError (bad_images='error'). Raises UserError when the
    cache does not fit in memory (ram) or on disk (disk); nothing half-written is ever reused.
    """
    n = len(samples)
    if n == 0:
        raise UserError("--cache: the dataset has no images")
    if mode not in ("ram", "disk"):
        raise UserError(f"--cache-mode {mode!r} is not one of: ram, disk")
    cache_dir = Path(cache_dir)
    labels = np.asarray([int(y) for _, y in samples], dtype=np.int64)
    key = cache_key(samples, size)
    need = nbytes(n, size)
    gib = need / 2**30
    t0 = time.perf_counter()
    if mode == "ram":
        free = available_memory()
        if need > 0.9 * free:
            raise UserError(f"--cache ram: {n:,} images at {size} px take {gib:.1f} GiB but only "
                            f"{free / 2**30:.1f} GiB of memory is available; use --cache-mode disk")
        say(f"--cache: decoding {n:,} images once to {size}x{size} uint8 in memory ({gib:.1f} GiB)")
        images = np.empty((n, size, size, 3), np.uint8)
        sizes = np.zeros((n, 2), np.int32)
        bad = _fill(images, sizes, samples, size, decoder, workers)
        where, reused = "ram", False
    else:
        images, sizes, bad, where, reused = _disk_cache(samples, size, decoder, cache_dir, key, workers,
                                                        bad_images, say)
    source = _substitutes(bad, samples, bad_images)
    if not reused:
        say(f"--cache: {n:,} images decoded in {time.perf_counter() - t0:.1f} s ({where})")
    cache = DecodedCache(images, sizes, labels, source, where,
                         bad={samples[i][0]: r for i, r in sorted(bad.items())}, reused=reused)
    if cache.bad:  # one line, however many: a folder of 30,000 empty files is not 30,000 lines
        log.warning("%s", skipped_line(cache.bad))
    return cache


def _disk_cache(samples: Sequence[tuple[str, int]], size: int, decoder: str, cache_dir: Path, key: str,
                workers: int, bad_images: str, say: Callable[[str], None],
                ) -> tuple[np.ndarray, np.ndarray, dict[int, str], str, bool]:
    """(images memmap, sizes, {index: reason} of bad files, file, reused) for a disk cache."""
    n = len(samples)
    data, sizes_path, meta_path = _paths(cache_dir, key)
    meta, sizes, stale = _complete(cache_dir, key, n, size)
    if meta is not None:
        say(f"--cache: reusing {data} ({n:,} images at {size} px)")
        images = np.memmap(data, np.uint8, "c", shape=(n, size, size, 3))  # "c": writable view, file untouched
        return images, sizes, _bad_rows(meta, n), str(data), True
    if stale is not None:
        say(f"--cache: {data.parent} holds a cache of this dataset that does not match it ({stale}); "
            "decoding again")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--cache-dir {cache_dir}: cannot create it ({e.strerror}); pass a writable "
                        "folder") from None
    need = nbytes(n, size)
    free = shutil.disk_usage(cache_dir).free
    if need + (64 << 20) > free:
        raise UserError(f"--cache disk: {n:,} images at {size} px take {need / 2**30:.1f} GiB but "
                        f"{cache_dir} has {free / 2**30:.1f} GiB free; free some space, pass another "
                        "--cache-dir, or use --cache-mode ram")
    say(f"--cache: decoding {n:,} images once to {size}x{size} uint8 in {data} ({need / 2**30:.1f} GiB)")
    sizes = np.zeros((n, 2), np.int32)
    bad: dict[int, str] = {}

    def fill(tmp: Path) -> None:
        images = np.memmap(tmp, np.uint8, "w+", shape=(n, size, size, 3))
        bad.update(_fill(images, sizes, samples, size, decoder, workers))
        _substitutes(bad, samples, bad_images)  # raises for bad_images='error' before anything is kept
        images.flush()
        del images

    for path in (data, sizes_path, meta_path):  # os.replace puts a file over anything but a folder
        if path.is_dir() and not path.is_symlink():
            raise UserError(f"--cache-dir {cache_dir}: {path.name} is a folder, and dlenv keeps a cache file "
                            "under that name; remove it or pass another --cache-dir")
    # a stale meta goes first: until the new one is written, nothing marks these files complete
    with contextlib.suppress(FileNotFoundError):
        os.unlink(meta_path)
    write_atomic(data, fill)
    write_file(sizes_path, lambda f: np.save(f, sizes), durable=True)
    # the meta file goes last: its presence is what marks the cache complete
    meta = {"key": key, "n": n, "size": size, "version": VERSION, "decoder": decoder,
            "bad": {str(i): r for i, r in bad.items()}}
    write_bytes(meta_path, json.dumps(meta).encode(), durable=True)
    images = np.memmap(data, np.uint8, "c", shape=(n, size, size, 3))
    return images, sizes, bad, str(data), False
