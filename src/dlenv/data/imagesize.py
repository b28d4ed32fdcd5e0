"""The typical size of a dataset's images, read from file headers only: the one rule that --img-size auto
(dlenv.data.pipeline) and the CPU recipe's "small images" (dlenv.data.demo) both read, in a module of its
own so that neither has to import the other.
"""

from __future__ import annotations

#: image headers read to find the typical size
SIZE_SAMPLE = 200


def typical_side(paths: list[str]) -> tuple[int, int] | None:
    """(the median shorter side of up to SIZE_SAMPLE of `paths`, spread evenly over them; how many headers
    were read), or None when no header could be read."""
    import statistics

    step = max(1, len(paths) // SIZE_SAMPLE)
    sides = [min(wh) for wh in map(_header_size, paths[::step][:SIZE_SAMPLE]) if wh]
    return (int(statistics.median(sides)), len(sides)) if sides else None


def _header_size(path: str) -> tuple[int, int] | None:
    """(width, height) from an image file's header, or None when it cannot be read (reported elsewhere)."""
    import warnings

    from PIL import Image

    from dlenv.files.safeio import IMAGE_FILE, open_regular

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with open_regular(path, "image", IMAGE_FILE) as f, Image.open(f) as im:
                return im.size
    except Exception:  # a broken file is the loaders' and the report's to name; a size is a summary
        return None
