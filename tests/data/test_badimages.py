"""dlenv.data.badimages: the one rule for an unreadable image (the next readable sample in dataset order, wrapping
round) costs a pass O(n) tries and steps however many files are bad (issue 43: one good image and 20,000 empty
.jpg files took 2 x 10^8 steps, 23-45 minutes of predict, as each index walked its run of bad files again).
Counted, not timed: file loads and the steps over known bad files, on every user of the rule."""

from __future__ import annotations

import pytest

from dlenv.data import badimages, cache
from dlenv.data.badimages import BadImageError, KnownBad, first_readable

N_BAD = 5_000  # quadratic would be 10^7 steps here; the 20,000 is the same class
LAYOUTS = {  # name -> which samples decode, in dataset order
    "one good image last": [False] * N_BAD + [True],
    "one good image first": [True] + [False] * N_BAD,
    "one good image in the middle": [False] * (N_BAD // 2) + [True] + [False] * (N_BAD // 2),
    "runs of 50 bad between good ones": ([False] * 50 + [True]) * (N_BAD // 50),
    "every other one bad": [False, True] * (N_BAD // 2),
    "none bad": [True] * N_BAD,
}


class Counted(KnownBad):
    """A KnownBad that counts the steps a search takes over it (each index it looks at)."""

    steps = 0

    def __contains__(self, key: object) -> bool:
        Counted.steps += 1
        return super().__contains__(key)


def _expected(good: list[bool]) -> list[int]:
    """The stand-in of each index by the rule, found from the end in one pass."""
    n, out = len(good), [0] * len(good)
    nxt = next(i for i in range(n) if good[i])  # wrapping round: the first good one
    for i in range(n - 1, -1, -1):
        nxt = i if good[i] else nxt
        out[i] = nxt
    return out


@pytest.fixture
def counted(monkeypatch):
    Counted.steps = 0
    monkeypatch.setattr(cache, "KnownBad", Counted)
    return Counted


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("user", ["first_readable", "ImageDataset", "cache"])
def test_a_pass_over_any_number_of_bad_files_is_linear(counted, layout, user):
    good = LAYOUTS[layout]
    n, n_bad = len(good), good.count(False)
    samples = [(f"{'ok' if g else 'empty'}{i}.jpg", i) for i, g in enumerate(good)]
    loads = 0

    def load(i: int) -> int:
        nonlocal loads
        loads += 1
        if not good[i]:
            raise OSError("empty file")
        return i

    reported: list[int] = []
    if user == "first_readable":
        known = Counted()
        got = []
        for i in range(n):
            j, item, bad = first_readable(i, samples, load, known, "skip")
            assert item == j
            got.append(j)
            reported += bad
    elif user == "ImageDataset":
        from dlenv.data.loaders import ImageDataset

        index_of = {path: i for i, (path, _) in enumerate(samples)}
        ds = ImageDataset(samples, load=lambda path: load(index_of[path]))
        ds._known_bad = Counted()
        got = [ds[i][1] for i in range(n)]  # (image, label): the label is the stand-in's index
        reported = list(ds._logged)
    else:
        bad = {i: "empty file" for i, g in enumerate(good) if not g}
        got = cache._substitutes(bad, samples, "skip").tolist()
        loads = n  # the cache decoded every file once before (cache.build_cache); no load here
        reported = list(bad)
    assert got == _expected(good)
    assert loads == n + (n_bad if user != "cache" else 0)  # each bad file tried once, one load per sample
    assert len(set(reported)) == n_bad and len(reported) <= 2 * n_bad  # each said, none again and again
    assert counted.steps <= 4 * n, f"{counted.steps:,} steps for {n:,} samples"


@pytest.mark.parametrize("bad_images, why", [("skip", badimages.NONE_READABLE), ("error", "could not be decoded")])
def test_no_readable_image_or_error_mode_is_one_line(bad_images, why):
    samples = [(f"empty{i}.jpg", 0) for i in range(5)]

    def load(i: int) -> None:
        raise OSError("empty file")

    with pytest.raises(BadImageError) as e:
        first_readable(2, samples, load, KnownBad(), bad_images)
    assert why in str(e.value) and "empty2.jpg" in str(e.value) and "\n" not in str(e.value)
