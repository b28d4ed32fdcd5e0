"""JPEG decoding on the GPU's hardware JPEG engines, through NVIDIA's nvImageCodec.

A100, H100, H200 and several other data-centre GPUs carry JPEG decoder engines beside the SMs. A batch
decoded there costs neither CPU cores nor the SMs the model trains on, which is what a box with 4-8
cores per GPU lacks (docs/input-pipeline.md has the numbers). nvImageCodec (PyPI:
`nvidia-nvimgcodec-cu11`, `-cu12`, `-cu13`, matching torch's CUDA) drives the engines; on a GPU without
them it falls back to nvJPEG's CUDA decoder on the SMs and then to the CPU, so 'auto' picks it only
where `has_engines` finds the hardware backend decoding (`plan.resolve_decoder`), and the plan allows only
the engines and the CPU there (`plan.engine_backends`).

Three things here are not obvious:
- The library prints errors about its optional JPEG 2000 and TIFF plug-ins at import when their
  wheels are absent. They say nothing about JPEGs, so the import runs with stdout/stderr sent to a
  file whose text goes to the debug log (`_quiet`).
- Decoding runs on the caller's CUDA stream (fastpath's side stream), never the legacy default stream
  that training runs on: work on stream 0 would serialise with every training kernel.
- Output buffers are reused batch after batch (the `images=` argument, where this version has it): a
  fresh cudaMalloc/cudaFree per image synchronises the whole device, stalling training each batch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

#: the probe image's side: small, but above the engines' minimum size
_PROBE_SIDE = 256
_lock = threading.Lock()
_module_cache: list[Any] = []        # [module or None, why-not]
_engines_cache: dict[int, bool] = {}


@contextlib.contextmanager
def _quiet() -> Any:
    """File descriptors 1 and 2 into a temporary file for the block; its text goes to the debug log.
    For start-up only (plug-in loading), before the loader's threads run. Where that cannot be set up
    (no writable temporary folder, a closed descriptor) the block runs as it is: noise over failure."""
    saved: list[int] = []
    try:
        sink = tempfile.TemporaryFile()  # noqa: SIM115 (closed at the end, and below if a dup fails)
    except OSError:
        yield
        return
    try:
        for fd in (1, 2):
            saved.append(os.dup(fd))
    except OSError:
        for old in saved:
            os.close(old)
        sink.close()
        yield
        return
    try:
        for stream in (sys.stdout, sys.stderr):  # what Python holds back goes out first
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        for fd in (1, 2):
            os.dup2(sink.fileno(), fd)
        yield
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        with contextlib.suppress(OSError):
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.debug("nvImageCodec at start-up: %s", " | ".join(text.splitlines()))
        sink.close()


def module() -> tuple[Any, str | None]:
    """(nvidia.nvimgcodec, None), or (None, why it cannot be used: one line with the fix)."""
    with _lock:
        if not _module_cache:
            try:
                with _quiet():
                    from nvidia import nvimgcodec
                _module_cache[:] = [nvimgcodec, None]
            except Exception as e:  # ImportError, or a broken wheel's OSError: either way not usable
                _module_cache[:] = [None, f"nvImageCodec is not installed ({type(e).__name__}); "
                                          f"pip install {wheel_name()}"]
        return _module_cache[0], _module_cache[1]


def wheel_name() -> str:
    """What to pip install for this torch's CUDA: nvidia-nvimgcodec-cu11, -cu12 or -cu13, with the nvJPEG
    library its JPEG decoders load (the [nvjpeg] extra), quoted for a shell."""
    import torch

    major = (torch.version.cuda or "12").split(".")[0]
    return f"'nvidia-nvimgcodec-cu{major}[nvjpeg]'"


def unavailable(device: Any) -> str | None:
    """Why nvImageCodec cannot decode on `device` (one line), or None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "the device is not a CUDA GPU"
    mod, why = module()
    if mod is None:
        return why
    try:
        out = HwJpegDecoder(device).decode([probe_jpeg()])
    except Exception as e:  # the library's CUDA or plug-in failure, in its words
        return f"nvImageCodec failed on {device} ({' '.join(str(e).split())[:120]})"
    if out[0] is None or tuple(out[0].shape) != (_PROBE_SIDE, _PROBE_SIDE, 3):
        return f"nvImageCodec could not decode a test JPEG on {device}"
    return None


def has_engines(device: Any) -> bool:
    """Whether `device` decodes JPEGs on hardware engines: nvImageCodec's hardware-only backend decodes a
    baseline 4:2:0 test image there. Cached per device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _engines_cache:
        _engines_cache[index] = _probe_engines(torch.device("cuda", index))
    return _engines_cache[index]


def _probe_engines(device: Any) -> bool:
    mod, _ = module()
    if mod is None:
        return False
    try:
        dec = HwJpegDecoder(device, backends=("HW_GPU_ONLY",))
        out = dec.decode([probe_jpeg()])
    except Exception as e:  # no engines: the backend refuses to start on some versions
        log.debug("nvImageCodec hardware backend on %s: %s", device, e)
        return False
    return out[0] is not None


def probe_jpeg() -> Any:
    """A baseline 4:2:0 JPEG of _PROBE_SIDE square (a gradient), as a numpy uint8 array."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, _PROBE_SIDE, dtype=np.uint8)
    rgb = np.stack([np.tile(ramp, (_PROBE_SIDE, 1)), np.tile(ramp[:, None], (1, _PROBE_SIDE)),
                    np.full((_PROBE_SIDE, _PROBE_SIDE), 128, np.uint8)], axis=2)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90, subsampling=2)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


class HwJpegDecoder:
    """Batches of JPEGs -> (H, W, 3) uint8 RGB tensors on one CUDA device, EXIF orientation applied.

    `backends`: names of nvImageCodec BackendKinds to allow (default: all, hardware first). `threads`:
    the library's CPU threads (parsing, and its CPU fallback). A position nvImageCodec cannot decode
    comes back as None (the caller decodes it another way or reports the file).
    """

    def __init__(self, device: Any, threads: int = 2, backends: Sequence[str] = ()):
        import torch

        mod, why = module()
        if mod is None:
            raise RuntimeError(why)
        self.mod, self.device = mod, torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        kinds = [mod.Backend(getattr(mod.BackendKind, b)) for b in backends] or None
        with _quiet():
            self.decoder = mod.Decoder(device_id=index, max_num_cpu_threads=threads, backends=kinds)
        self._pool: list[Any] = []     # Images whose buffers the next batch reuses
        self._reuse = True             # False once this version refuses `images=`

    def decode(self, data: Sequence[Any]) -> list[Any]:
        """Decode `data` (numpy uint8 arrays of file bytes) on the current CUDA stream of the device:
        (H, W, 3) uint8 tensors sharing the library's buffers (valid until the next call), or None."""
        return self._run(self.decoder.decode, list(data))

    def read(self, paths: Sequence[str]) -> list[Any]:
        """`decode` of the files at `paths`, read by the library's own threads (no Python per file)."""
        try:
            return self._run(self.decoder.read, list(paths))
        except TypeError:  # a version that takes CodeStreams only
            return self._run(self.decoder.read, [self.mod.CodeStream(p) for p in paths])

    def _run(self, call: Any, srcs: list[Any]) -> list[Any]:
        import torch

        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self._reuse and len(self._pool) >= len(srcs):
            try:
                out = call(srcs, images=self._pool[:len(srcs)], cuda_stream=stream)
            except TypeError:
                out = call(srcs, cuda_stream=stream)  # a TypeError here is about srcs: reuse untouched
                self._reuse = False  # it was `images=`: nvImageCodec before 0.7 reuses no output
        else:
            out = call(srcs, cuda_stream=stream)
            if self._reuse and all(img is not None for img in out) and len(out) > len(self._pool):
                self._pool = list(out)
        # torch.as_tensor reads __cuda_array_interface__ and releases no GIL: no per-image op here
        return [None if img is None else torch.as_tensor(img, device=self.device) for img in out]
