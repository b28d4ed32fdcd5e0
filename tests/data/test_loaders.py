"""dlenv.data.loaders: transforms, bad files, loaders (how many workers: test_workers.py)."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from imagedata import make_image_folder
from PIL import Image

from dlenv.data import loaders
from dlenv.data.badimages import BadImageError
from dlenv.data.folder import find_layout
from dlenv.data.loaders import (
    ImageDataset,
    build_eval_loader,
    build_loaders,
    build_transforms,
)
from dlenv.data.plan import InputPlan
from dlenv.errors import UserError

# --------------------------------------------------------------------------------------------- transforms

def test_transforms_shapes_and_normalization(tmp_path):
    img = Image.fromarray(np.full((40, 50, 3), 124, np.uint8))
    train = build_transforms(32, train=True)(img)
    val = build_transforms(32, train=False)
    assert train.shape == (3, 32, 32) and val(img).shape == (3, 32, 32)
    want = (124 / 255 - torch.tensor(loaders.IMAGENET_MEAN)) / torch.tensor(loaders.IMAGENET_STD)
    assert torch.allclose(val(img)[:, 5, 5], want, atol=1e-5)  # ToTensor scale, then ImageNet stats
    assert torch.equal(val(img), val(img))  # eval is deterministic


# --------------------------------------------------------------------------------------------- dataset

@pytest.fixture
def with_bad(tmp_path):
    """Samples of two classes where the 3rd file is corrupt."""
    make_image_folder(tmp_path, classes=("a", "b"), per_class=4, size=(16, 16))
    lay = find_layout(tmp_path, val_split=0.0)
    samples = list(lay.train)
    Path(samples[2][0]).write_bytes(b"\xff\xd8\xff garbage")
    return samples


def test_dataset_skip_substitutes_next_sample_and_warns_once(with_bad, caplog):
    ds = ImageDataset(with_bad, build_transforms(16, False), "skip")
    caplog.set_level(logging.WARNING, "dlenv.data")
    x, y = ds[2]
    x3, y3 = ds[3]
    assert torch.equal(x, x3) and y == y3
    ds[2]
    msgs = [r.getMessage() for r in caplog.records if with_bad[2][0] in r.getMessage()]
    assert len(msgs) == 1


def test_dataset_error_names_the_file_in_one_line(with_bad):
    ds = ImageDataset(with_bad, build_transforms(16, False), "error")
    with pytest.raises(BadImageError) as e:
        ds[2]
    assert isinstance(e.value, UserError)
    assert with_bad[2][0] in str(e.value) and "\n" not in str(e.value)
    assert ds[1][1] == with_bad[1][1]


def test_dataset_rejects_unknown_mode(with_bad):
    with pytest.raises(UserError):
        ImageDataset(with_bad, None, "ignore")


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_skip_reports_once_per_path_across_workers_and_epochs(with_bad, workers, caplog, capfd):
    caplog.set_level(logging.WARNING, "dlenv.data")
    loader = build_eval_loader(with_bad, 16, batch_size=2, workers=workers)
    for _ in range(2):
        labels = torch.cat([y for _, y in loader]).tolist()
        assert len(labels) == len(with_bad)
    bad = with_bad[2][0]
    assert list(loader.bad_paths) == [bad]
    assert labels[2] == labels[3]  # the bad slot holds the next sample
    assert sum(bad in r.getMessage() for r in caplog.records) == 1
    assert "Traceback" not in capfd.readouterr().err


def test_bad_file_seen_by_two_workers_is_logged_once(with_bad, caplog):
    caplog.set_level(logging.WARNING, "dlenv.data")
    ds = ImageDataset(with_bad, build_transforms(16, False), "skip")
    # batch_size 1 and this order hand index 2 to both workers in turn
    loader = loaders.SafeLoader(ds, batch_size=1, num_workers=2, sampler=[2, 0, 2, 1, 2, 3])
    assert len(list(loader)) == 6
    assert sum(with_bad[2][0] in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_error_raises_clean_bad_image_error(with_bad, workers, capfd):
    loader = build_eval_loader(with_bad, 16, batch_size=2, workers=workers, bad_images="error")
    with pytest.raises(BadImageError) as e:
        for _ in loader:
            pass
    msg = str(e.value)
    assert with_bad[2][0] in msg and "\n" not in msg and "worker" not in msg
    assert "Traceback" not in capfd.readouterr().err


def test_a_failed_pass_stops_its_workers_at_once(with_bad):
    # not left to the garbage collector: `e` (its traceback) keeps the iterator in a reference cycle with
    # this frame, and collected there its workers never heard to stop: torch waited 5 s for each of them
    before = set(multiprocessing.active_children())
    loader = build_eval_loader(with_bad, 16, batch_size=2, workers=2, bad_images="error")
    with pytest.raises(BadImageError) as e:
        for _ in loader:
            pass
    assert not set(multiprocessing.active_children()) - before
    assert with_bad[2][0] in str(e.value)


def test_all_images_bad_is_a_user_error(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(b"")
    ds = ImageDataset([(str(tmp_path / f"{i}.png"), 0) for i in range(3)], None, "skip")
    with pytest.raises(BadImageError, match="no other image"):
        ds[0]


# --------------------------------------------------------------------------------------------- loaders

@pytest.fixture
def layout(tmp_path):
    make_image_folder(tmp_path / "train", classes=("a", "b", "c"), per_class=6, size=(16, 16))
    make_image_folder(tmp_path / "val", classes=("a", "b", "c"), per_class=2, size=(16, 16), seed=1)
    return find_layout(tmp_path)


def _labels(loader):
    return torch.cat([y for _, y in loader]).tolist()


def _plan(batch_size, workers, seed=0):
    """The CPU path's plan at 16 px (its workers a number: the plan sized them)."""
    return InputPlan(16, batch_size, False, "pil", "pil", workers, seed=seed)


def test_build_loaders_seeded_shuffle_and_ordered_val(layout):
    train, val = build_loaders(layout, _plan(4, 0, seed=1))
    assert train.pin_memory is torch.cuda.is_available()
    first = _labels(train)
    assert sorted(first) == sorted(y for _, y in layout.train)
    assert first != [y for _, y in layout.train]  # shuffled
    again, _ = build_loaders(layout, _plan(4, 0, seed=1))
    other, _ = build_loaders(layout, _plan(4, 0, seed=2))
    assert _labels(again) == first and _labels(other) != first
    assert _labels(val) == [y for _, y in layout.val]
    x, _ = next(iter(val))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32


def test_build_loaders_uses_given_sampler_and_workers(layout):
    order = list(range(len(layout.train)))[::-1]
    train, val = build_loaders(layout, _plan(5, 2), train_sampler=order, drop_last=True)
    assert train.persistent_workers and train.prefetch_factor == loaders.PREFETCH_FACTOR
    assert _labels(train) == [layout.train[i][1] for i in order][:15]
    assert len(train) == 3


def test_build_loaders_without_val(tmp_path):
    make_image_folder(tmp_path, per_class=3, size=(16, 16))
    train, val = build_loaders(find_layout(tmp_path, val_split=0.0), _plan(2, 0))
    assert val is None and len(train.dataset) == 6


def test_eval_loader_keeps_sample_order(layout):
    loader = build_eval_loader(layout.train, 16, batch_size=4, workers=0)
    assert _labels(loader) == [y for _, y in layout.train]


def test_close_stops_persistent_workers_and_a_later_pass_starts_new_ones(layout):
    # the trainer closes its loaders at the end of a run (train.fit), however it ends
    before = set(multiprocessing.active_children())
    train, _ = build_loaders(layout, _plan(4, 2, seed=1))
    first = _labels(train)
    assert len(set(multiprocessing.active_children()) - before) == 2  # persistent: alive between passes
    train.close()
    assert not set(multiprocessing.active_children()) - before
    assert sorted(_labels(train)) == sorted(first)
    train.close()
    assert not set(multiprocessing.active_children()) - before


@pytest.mark.parametrize("n_bad, workers", [(1, 0), (3, 0), (4, 0), (30, 0), (30, 2)])
def test_many_unreadable_files_are_a_few_lines_not_one_each(tmp_path, n_bad, workers, caplog):
    """30,000 empty files printed 30,000 lines: the first few are named, the rest counted in one line."""
    from dlenv.data.badimages import SKIPPED_SHOWN

    make_image_folder(tmp_path, classes=("a", "b"), per_class=2, size=(16, 16))
    for i in range(n_bad):
        (tmp_path / "a" / f"empty{i:03d}.jpg").write_bytes(b"")
    samples = list(find_layout(tmp_path, val_split=0.0).train)
    caplog.set_level(logging.WARNING, "dlenv.data")
    loader = build_eval_loader(samples, 16, batch_size=8, workers=workers)
    for _ in range(2):  # two passes: nothing is said twice
        assert sum(len(y) for _, y in loader) == len(samples)
    said = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(loader.bad_paths) == n_bad
    if n_bad <= SKIPPED_SHOWN:
        assert len(said) == n_bad, said
    else:
        assert len(said) == SKIPPED_SHOWN + 2, said  # the first few, "counted, not listed", the total
        assert said[-1].startswith(f"skipping {n_bad:,} unreadable images:") and f"{n_bad - SKIPPED_SHOWN:,} more" \
            in said[-1]
