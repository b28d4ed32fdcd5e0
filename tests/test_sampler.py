"""The resumable sampler: order from (seed, epoch) only, mid-epoch start, rank shares."""

from __future__ import annotations

import pytest

from dlenv.data.sampler import ResumableSampler


def test_order_depends_on_seed_and_epoch_only():
    a, b = ResumableSampler(50, seed=3), ResumableSampler(50, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    order2 = list(a)
    a.set_epoch(3)
    assert list(a) != order2
    c = ResumableSampler(50, seed=4)
    c.set_epoch(2)
    assert list(c) != order2


def test_start_offset_continues_mid_epoch():
    s = ResumableSampler(20, seed=1)
    s.set_epoch(5)
    full = list(s)
    s.set_epoch(5, start=7)
    assert list(s) == full[7:] and len(s) == 13
    resumed = ResumableSampler(20)
    resumed.load_state_dict(s.state_dict(position=7))
    assert list(resumed) == full[7:] and resumed.seed == 1 and resumed.epoch == 5
    with pytest.raises(ValueError):
        s.set_epoch(0, start=21)


def test_ranks_split_an_epoch_without_overlap():
    ranks = [ResumableSampler(10, seed=0, rank=r, world_size=3) for r in range(3)]
    for s in ranks:
        s.set_epoch(1)
    parts = [list(s) for s in ranks]
    assert [len(p) for p in parts] == [4, 4, 4]  # padded to 12
    assert set().union(*map(set, parts)) == set(range(10))
    dropped = [ResumableSampler(10, rank=r, world_size=3, drop_last=True) for r in range(3)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == 9 and len(set(flat)) == 9
    with pytest.raises(ValueError):
        ResumableSampler(10, rank=3, world_size=3)


def test_a_different_world_size_restarts_the_epoch():
    s = ResumableSampler(10, world_size=2)
    s.load_state_dict({"seed": 0, "epoch": 1, "position": 3, "world_size": 1})
    assert s.start == 0 and s.epoch == 1


def test_unshuffled_keeps_order():
    s = ResumableSampler(6, shuffle=False)
    assert list(s) == list(range(6))
