"""dlenv.data.hwdecode on a CPU: what happens without the library, its start-up noise kept off the console,
the test image, versions of the library (the nvImageCodec source with a stand-in for it:
tests/data/test_sources.py; the real library on a GPU: tests/data/test_fastpath_gpu.py)."""

from __future__ import annotations

import io
import logging
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from dlenv.data import hwdecode


@pytest.fixture
def no_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import fails
    monkeypatch.setattr(hwdecode, "_module_cache", [])


def test_without_the_library_one_line_names_the_wheel(no_library):
    mod, why = hwdecode.module()
    assert mod is None and f"pip install {hwdecode.wheel_name()}" in why and "\n" not in why
    assert hwdecode.unavailable("cpu") == "the device is not a CUDA GPU"
    assert not hwdecode.has_engines("cpu")
    with pytest.raises(RuntimeError, match="nvImageCodec is not installed"):
        hwdecode.HwJpegDecoder("cpu")


@pytest.mark.parametrize("cuda,wheel", [("11.7", "'nvidia-nvimgcodec-cu11[nvjpeg]'"),
                                        ("12.4", "'nvidia-nvimgcodec-cu12[nvjpeg]'"),
                                        ("13.0", "'nvidia-nvimgcodec-cu13[nvjpeg]'"),
                                        (None, "'nvidia-nvimgcodec-cu12[nvjpeg]'")])
def test_wheel_follows_torchs_cuda(monkeypatch, cuda, wheel):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert hwdecode.wheel_name() == wheel


def test_start_up_noise_goes_to_the_debug_log_not_the_console(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="dlenv.data.hwdecode")
    print("before", flush=True)
    with hwdecode._quiet():
        os.write(1, b"[ERROR] [nvjpeg2k_ext] Failed to load\n")
        os.write(2, b"Failed to load nvtiff library!\n")
    print("after", flush=True)
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and err == ""
    assert "nvjpeg2k_ext" in caplog.text and "nvtiff" in caplog.text


def test_without_a_temporary_folder_the_library_still_loads(monkeypatch, capfd):
    def no_tmp(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hwdecode.tempfile, "TemporaryFile", no_tmp)
    with hwdecode._quiet():
        os.write(1, b"still said\n")
    assert capfd.readouterr().out == "still said\n"


def test_probe_image_is_a_baseline_420_jpeg():
    from PIL import JpegImagePlugin

    im = Image.open(io.BytesIO(hwdecode.probe_jpeg().tobytes()))
    assert im.format == "JPEG" and im.size == (256, 256) and not im.info.get("progressive")
    assert JpegImagePlugin.get_sampling(im) == 2  # 4:2:0, what every JPEG engine decodes


class _Library:
    """nvImageCodec's Decoder as HwJpegDecoder calls it: `images=` refused (before 0.7) or paths refused."""

    def __init__(self, takes_images: bool, takes_paths: bool = True):
        self.takes_images, self.takes_paths, self.calls = takes_images, takes_paths, []

    def read(self, srcs, images=None, cuda_stream=0):
        self.calls.append(("images" if images is not None else "plain", type(srcs[0]).__name__))
        if images is not None and not self.takes_images:
            raise TypeError("read() got an unexpected keyword argument 'images'")
        if isinstance(srcs[0], str) and not self.takes_paths:
            raise TypeError("incompatible function arguments")
        return [np.zeros((2, 3, 3), np.uint8) for _ in srcs]


@pytest.mark.parametrize("takes_images,takes_paths,reuse_after", [(True, True, True), (False, True, False),
                                                                  (True, False, True)])
def test_output_reuse_is_given_up_only_when_images_is_refused(monkeypatch, takes_images, takes_paths,
                                                               reuse_after):
    lib = _Library(takes_images, takes_paths)
    dec = object.__new__(hwdecode.HwJpegDecoder)
    dec.mod = type("mod", (), {"CodeStream": type("CodeStream", (), {"__init__": lambda self, p: None})})
    dec.device, dec.decoder, dec._pool, dec._reuse = torch.device("cpu"), lib, [], True
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(torch, "as_tensor", lambda img, device=None: torch.from_numpy(img))
    for _ in range(3):
        out = dec.read(["a.jpg", "b.jpg"])
        assert [tuple(t.shape) for t in out] == [(2, 3, 3), (2, 3, 3)]
    assert dec._reuse is reuse_after, lib.calls
