"""dlenv.data.decode: any image to 8-bit RGB, the three CPU decoders agree, reduced decoding, the stored
form (which decoder a run uses: tests/data/test_plan.py)."""

from __future__ import annotations

import numpy as np
import pytest
from imagedata import photo
from PIL import Image

from dlenv.data import decode
from dlenv.data.decode import (
    decode_rgb,
    decode_stored,
    load_rgb,
    stored_size,
    to_square,
)


@pytest.mark.parametrize("decoder", ["cv2", "tvio"])
def test_decoders_give_pillows_image_within_jpeg_rounding(tmp_path, decoder):
    p = str(photo(tmp_path / "a.jpg"))
    ref = np.asarray(load_rgb(p), np.int16)
    got = np.asarray(decode_rgb(p, decoder), np.int16)
    assert got.shape == ref.shape == (90, 120, 3)
    assert np.abs(got - ref).mean() < 1.5 and np.abs(got - ref).max() <= 12
    s_ref, wh_ref = decode_stored(p, 48, "pil")
    s_got, wh_got = decode_stored(p, 48, decoder)
    assert s_got.shape == (48, 48, 3) and s_got.dtype == np.uint8 and wh_got == wh_ref == (120, 90)
    assert np.abs(s_got.astype(int) - s_ref).mean() < 1.5


def _jpeg(path, w, h, **save):
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(path, **save)
    return path.read_bytes()


def test_jpeg_size_reads_the_frame_header_as_pillow_does(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored size, not the turned one: Pillow's .size is the stored one too
    cases = {
        "baseline": _jpeg(tmp_path / "a.jpg", 500, 375),
        "progressive": _jpeg(tmp_path / "p.jpg", 37, 1000, progressive=True),
        "exif and icc in front": _jpeg(tmp_path / "e.jpg", 64, 48, exif=exif, icc_profile=b"x" * 5000),
        "4:2:0 odd sizes": _jpeg(tmp_path / "o.jpg", 333, 77, subsampling=2),
        "grayscale": Image.new("L", (70, 30)).save(tmp_path / "g.jpg") or (tmp_path / "g.jpg").read_bytes(),
    }
    for name, data in cases.items():
        with Image.open(__import__("io").BytesIO(data)) as im:
            assert decode.jpeg_size(data) == im.size, name
        assert decode.jpeg_size(np.frombuffer(data, np.uint8)) == decode.jpeg_size(data), name


@pytest.mark.parametrize("data", [b"", b"\xff\xd8", b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
                                  b"\xff\xd8\xff\xe0\x00\x10JFIF",  # cut inside the first segment
                                  b"\xff\xd8\xff\xda\x00\x08" + b"\0" * 20,  # scan before any frame
                                  b"\xff\xd8\x00\x00" + b"\0" * 20,  # no marker where one belongs
                                  b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x00\x03" + b"\0" * 9])  # 0 x 0
def test_jpeg_size_is_none_for_bytes_without_a_readable_frame(data):
    assert decode.jpeg_size(data) is None


def test_cv2_reads_each_file_once(tmp_path, monkeypatch):
    """The reduced-decode choice comes from the file's own header: no second open through Pillow."""
    p = str(photo(tmp_path / "big.jpg", 400, 300))
    import PIL.Image

    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: pytest.fail("Pillow opened the file"))
    assert decode._cv2_bgr(p, 70).shape == (75, 100, 3)
    stored, wh = decode_stored(p, 64, "cv2")
    assert stored.shape == (64, 64, 3) and wh == (100, 75)


def test_reduced_decoding_keeps_the_short_side(tmp_path):
    p = str(photo(tmp_path / "big.jpg", 400, 300))
    full = load_rgb(p)
    small = load_rgb(p, min_size=70)  # 300 // 70 = 4: decoded at 1/4 scale
    assert full.size == (400, 300) and small.size == (100, 75)
    assert load_rgb(p, min_size=160).size == (400, 300)  # half would be 150 < 160: full size
    rgb = decode._cv2_rgb(p, 70)
    assert rgb.shape == (75, 100, 3)
    # the reduced decode is the same picture
    ref = np.asarray(full.resize((100, 75), Image.BOX), np.int16)
    assert np.abs(np.asarray(small, np.int16) - ref).mean() < 3
    stored, wh = decode_stored(p, 64, "pil")
    assert stored.shape == (64, 64, 3) and wh[0] / wh[1] == pytest.approx(4 / 3)


@pytest.mark.parametrize("decoder", ["pil", "cv2", "tvio"])
def test_non_jpeg_and_exif_go_through_the_same_rules(tmp_path, decoder):
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0] = 200  # fully transparent red: shown as white, whichever decoder is chosen
    Image.fromarray(rgba).save(tmp_path / "t.png")
    assert (np.asarray(decode_rgb(tmp_path / "t.png", decoder)) == 255).all()
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :8] = 255  # white band on the left, rotated to the top by EXIF orientation 6
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(tmp_path / "r.jpg", exif=exif, quality=95)
    out = np.asarray(decode_rgb(tmp_path / "r.jpg", decoder))
    assert out.shape == (40, 20, 3) and out[:6].mean() > 200 and out[-6:].mean() < 50
    stored, wh = decode_stored(tmp_path / "r.jpg", 16, decoder)
    assert wh == (20, 40) and stored[:3].mean() > 200


def test_broken_file_raises_for_every_decoder(tmp_path):
    (tmp_path / "x.jpg").write_bytes(b"\xff\xd8\xff not really")
    for name in ("pil", "cv2", "tvio"):
        with pytest.raises(Exception):  # noqa: B017 - Pillow's own error, whichever decoder tried first
            decode_stored(tmp_path / "x.jpg", 16, name)


def test_the_stored_square_has_a_margin_over_the_training_size():
    assert stored_size(224) == 258 and stored_size(16) == 18


def test_to_square_keeps_the_whole_frame():
    arr = np.zeros((30, 90, 3), np.uint8)
    arr[:, 60:] = 255  # the right third white
    sq = to_square(arr, 30)
    assert sq.shape == (30, 30, 3)
    assert sq[:, :18].max() < 10 and sq[:, 22:].min() > 245


def _rotated_jpeg(path, orientation, w=50, h=30):
    """A JPEG stored w x h with EXIF `orientation` (random content, so every turn is distinguishable)."""
    arr = np.random.default_rng(orientation).integers(0, 255, (h, w, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(arr).save(path, quality=95, exif=exif)
    return path


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_and_upright_agree_with_pillow(tmp_path, orientation):
    import torch
    from PIL import ImageOps

    from dlenv.data.decode import exif_orientation, upright

    path = _rotated_jpeg(tmp_path / "r.jpg", orientation)
    assert exif_orientation(path.read_bytes()) == orientation
    with Image.open(path) as im:
        stored = np.asarray(im.convert("RGB"))
        ref = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    out = upright(torch.from_numpy(stored).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert out.shape == ref.shape and np.array_equal(out, ref)


def test_exif_orientation_reads_big_endian_and_survives_garbage(tmp_path):
    import struct

    from dlenv.data.decode import exif_orientation

    # a big-endian ("MM") TIFF block with one IFD entry: orientation 8 as a SHORT
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, 8, 0) + struct.pack(">I", 0)
    block = b"\xff\xd8\xff\xe1\x00\x00Exif\x00\x00" + b"MM\x00\x2a" + struct.pack(">I", 8) + ifd
    assert exif_orientation(block) == 8
    assert exif_orientation(block[:-14]) == 1  # cut inside the entry
    assert exif_orientation(b"\xff\xd8\xff\xe0 JFIF, no EXIF at all") == 1
    assert exif_orientation(b"Exif\x00\x00XX") == 1  # neither byte order
    assert exif_orientation(photo(tmp_path / "plain.jpg").read_bytes()) == 1


def test_nvjpeg_source_turns_rotated_photos_upright_on_the_cpu(tmp_path):
    """On the CPU device decode_jpeg applies EXIF itself where it can (torchvision 0.17+) and the
    source turns the image where it cannot (the 1.13 image's 0.14): upright either way."""
    import torch
    from PIL import ImageOps

    from dlenv.data.sources import NvjpegSource

    paths = [str(_rotated_jpeg(tmp_path / f"{o}.jpg", o)) for o in (1, 6, 3, 8)]
    src = NvjpegSource([(p, 0) for p in paths], None, 4, 40, "error")
    images, sizes, _ = src.upload(next(iter(src)), torch.device("cpu"))
    for k, p in enumerate(paths):
        with Image.open(p) as im:
            ref = ImageOps.exif_transpose(im).convert("RGB")
        assert tuple(sizes[k].tolist()) == ref.size  # (w, h): 30 x 50 for the quarter turns
        got = images[k].numpy().astype(int)
        want = np.asarray(ref.resize((40, 40), Image.BILINEAR)).astype(int)
        assert np.abs(got - want).mean() < 5  # about 0.2 upright; about 40 turned the wrong way


@pytest.mark.gpu
def test_nvjpeg_on_cuda_turns_rotated_photos_upright(tmp_path):
    import torch
    from PIL import ImageOps

    from dlenv import compat
    from dlenv.data.sources import NvjpegSource

    if compat.cuda_jpeg_unavailable("cuda"):
        pytest.skip(compat.cuda_jpeg_unavailable("cuda"))
    paths = [str(_rotated_jpeg(tmp_path / f"{o}.jpg", o)) for o in range(1, 9)]
    src = NvjpegSource([(p, 0) for p in paths], None, 8, 40, "error")
    images, sizes, _ = src.upload(next(iter(src)), torch.device("cuda"))
    for k, p in enumerate(paths):
        with Image.open(p) as im:
            ref = ImageOps.exif_transpose(im).convert("RGB")
        assert tuple(sizes[k].tolist()) == ref.size
        got = images[k].cpu().numpy().astype(int)
        want = np.asarray(ref.resize((40, 40), Image.BILINEAR)).astype(int)
        assert np.abs(got - want).mean() < 10  # nvJPEG's IDCT is not Pillow's; the wrong turn is ~36


# --------------------------------------------------------------------------------------------- any image to RGB


def _check_rgb(im: Image.Image, size) -> np.ndarray:
    assert im.mode == "RGB" and im.size == size
    return np.asarray(im)


def test_grayscale_and_bilevel(tmp_path):
    Image.new("L", (8, 6), 77).save(tmp_path / "g.png")
    Image.new("1", (8, 6), 1).save(tmp_path / "b.png")
    assert (_check_rgb(load_rgb(tmp_path / "g.png"), (8, 6)) == 77).all()
    assert (_check_rgb(load_rgb(tmp_path / "b.png"), (8, 6)) == 255).all()


def test_transparency_is_composited_on_white(tmp_path):
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 200           # red everywhere underneath
    rgba[:2, :, 3] = 255         # top half opaque, bottom half fully transparent
    Image.fromarray(rgba).save(tmp_path / "a.png")
    out = _check_rgb(load_rgb(tmp_path / "a.png"), (4, 4))
    assert (out[:2] == [200, 0, 0]).all() and (out[2:] == 255).all()

    la = Image.merge("LA", [Image.new("L", (4, 4), 10), Image.new("L", (4, 4), 0)])
    la.save(tmp_path / "la.png")
    assert (_check_rgb(load_rgb(tmp_path / "la.png"), (4, 4)) == 255).all()

    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    pal.save(tmp_path / "p.png", transparency=1)  # palette index 1 (blue) is the transparent one
    assert (_check_rgb(load_rgb(tmp_path / "p.png"), (4, 4)) == 255).all()
    pal.save(tmp_path / "opaque.png")
    assert (_check_rgb(load_rgb(tmp_path / "opaque.png"), (4, 4)) == [0, 0, 255]).all()


def test_cmyk_jpeg(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg")  # pure red in CMYK
    r, g, b = _check_rgb(load_rgb(tmp_path / "c.jpg"), (8, 8)).reshape(-1, 3).mean(0)
    assert r > 200 and g < 60 and b < 60


def test_16bit_png_is_scaled_not_clipped(tmp_path):
    arr = np.array([[0, 257 * 64, 257 * 128, 65535]], dtype=np.uint16)
    Image.fromarray(arr).save(tmp_path / "d.png")
    assert Image.open(tmp_path / "d.png").mode in ("I;16", "I")
    out = _check_rgb(load_rgb(tmp_path / "d.png"), (4, 1))
    assert out[0, :, 0].tolist() == [0, 64, 128, 255]
    assert (out[..., 0] == out[..., 2]).all()


def test_exif_orientation_applied(tmp_path):
    arr = np.zeros((10, 30, 3), np.uint8)  # 30 wide, 10 high
    arr[:, :5] = 255                         # a white band on the left edge
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    im.save(tmp_path / "r.jpg", exif=exif, quality=95)
    out = _check_rgb(load_rgb(tmp_path / "r.jpg"), (10, 30))
    assert out[:5].mean() > 200 and out[-5:].mean() < 50  # the left band is now at the top


def test_broken_file_raises(tmp_path):
    (tmp_path / "x.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(Exception):  # noqa: B017 - any PIL error; the dataset decides what to do
        load_rgb(tmp_path / "x.jpg")
