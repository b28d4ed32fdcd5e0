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


# ---------------------------------------------------------------------------------------------------
# Each sample's augmentation seed (issue 47).


def test_draws_carry_the_seed_of_their_sample_and_epoch_and_pickle_with_it():
    import pickle

    from dlenv.data.sampler import Draw, SeededDraws, draw_seed

    s = ResumableSampler(10, seed=3)
    s.set_epoch(2, start=4)
    draws = list(SeededDraws(s))
    assert draws == list(s) and len(SeededDraws(s)) == len(s)
    assert all(isinstance(d, Draw) and d.seed == draw_seed(3, 2, d) for d in draws)
    back = pickle.loads(pickle.dumps(draws))  # as the DataLoader hands them to its workers
    assert [(int(d), d.seed) for d in back] == [(int(d), d.seed) for d in draws]
    # another epoch, another seed, or another sample: another draw
    assert len({draw_seed(3, 2, 5), draw_seed(3, 1, 5), draw_seed(4, 2, 5), draw_seed(3, 2, 6)}) == 4


def test_a_sample_is_augmented_alike_whatever_was_drawn_before_and_the_process_stream_is_kept():
    import torch

    from dlenv.data.loaders import ImageDataset, build_transforms
    from dlenv.data.sampler import Draw

    ds = ImageDataset([("x.png", 0)], build_transforms(16, True), load=lambda path: _image())
    torch.manual_seed(0)
    first = ds[Draw(0, 1234)][0]
    before = torch.get_rng_state()
    torch.rand(100)  # a worker that drew other samples first
    again = ds[Draw(0, 1234)][0]
    other = ds[Draw(0, 99)][0]
    assert torch.equal(first, again) and not torch.equal(first, other)
    after = torch.rand(1)
    torch.set_rng_state(before)
    torch.rand(100)
    assert torch.equal(after, torch.rand(1)), "the augmentation must not draw from the process's own stream"


def _image():
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.arange(48 * 40 * 3) % 251).astype(np.uint8).reshape(40, 48, 3))
