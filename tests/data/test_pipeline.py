"""dlenv.data.pipeline: where the data is (locate, --img-size auto), and the loaders and data it builds from
an input plan, on the CPU (the decisions themselves: tests/data/test_plan.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from imagedata import make_image_folder, make_photo_layout

from dlenv.cluster.distributed import DistInfo
from dlenv.data import pipeline
from dlenv.data.fastpath import DeviceLoader
from dlenv.data.loaders import SafeLoader
from dlenv.data.plan import InputOptions
from dlenv.errors import UserError


@pytest.fixture
def photos(tmp_path):
    return pipeline.locate(str(make_photo_layout(tmp_path / "ds", 10, 4, 2, lambda i: (30 + 2 * i, 24))))


def test_locate_a_folder_synthetic_data_or_refuse(tmp_path):
    located = pipeline.locate(str(make_image_folder(tmp_path / "photos")))
    assert located.classes == ["cat", "dog"] and not located.demo and located.img_size == 20  # 24x20 images
    synthetic = pipeline.locate(None, synthetic=True)
    assert synthetic.layout is None and len(synthetic.classes) == 1000 and synthetic.source == "synthetic"
    with pytest.raises(UserError, match="--data /no/such: no such folder"):
        pipeline.locate("/no/such")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images found under"):
        pipeline.locate(str(tmp_path / "empty"))


def test_make_loaders_follows_the_plan(photos):
    plan = InputOptions(workers=0, gpu_augment="off").decide(photos, "cpu", 4, 16)
    train, val = pipeline.make_loaders(photos.layout, plan, "cpu")
    assert isinstance(train, SafeLoader) and isinstance(val, SafeLoader)
    assert "augmentation on the workers" in plan.describe("cpu")
    on_device = dataclasses.replace(plan, on_device=True)
    train, val = pipeline.make_loaders(photos.layout, on_device, "cpu", dtype=torch.bfloat16)
    x, y = next(iter(train))
    assert isinstance(train, DeviceLoader) and x.shape == (4, 3, 16, 16) and x.dtype == torch.bfloat16
    assert "augmentation on cpu" in on_device.describe("cpu")


@pytest.mark.parametrize("gpu_augment", ["off", "on"])
def test_build_gives_each_rank_its_shard(photos, gpu_augment):
    """Two ranks: each trains on half the training set, and their val shards cover every image once."""
    plan = InputOptions(workers=0, gpu_augment=gpu_augment, seed=1).decide(photos, "cpu", 2, 16)
    ranks = [pipeline.build(photos, plan, "cpu", DistInfo(rank=r, world_size=2)) for r in (0, 1)]
    # 5 each in batches of 2 would end in a batch of one: that index is left out on every rank
    assert [d.sampler.per_rank for d in ranks] == [4, 4] and [len(d.train) for d in ranks] == [2, 2]
    val = [int(y) for d in ranks for _, ys in d.val for y in ys]
    assert sorted(val) == sorted(y for _, y in photos.layout.val)


def test_build_for_synthetic_data():
    located = pipeline.locate(None, synthetic=True)
    plan = InputOptions().decide(located, "cpu", 2, 16)
    data = pipeline.build(located, plan, "cpu", DistInfo(), max_steps=3)
    assert data.sampler is None and len(data.train) == 3 and next(iter(data.train))[0].shape == (2, 3, 16, 16)


def test_no_hflip_reaches_both_augmentation_paths():
    from dlenv.data.gpu_aug import Crops, GpuAugment
    from dlenv.data.loaders import build_transforms

    names = [type(t).__name__ for t in build_transforms(16, True, hflip=False).transforms]
    assert "RandomHorizontalFlip" not in names and "RandomResizedCrop" in names
    assert "RandomHorizontalFlip" in [type(t).__name__ for t in build_transforms(16, True).transforms]
    sizes = torch.tensor([[20, 20]] * 64)
    assert GpuAugment(16, True, crops=Crops(hflip=False)).boxes(sizes, seed=1)[:, 4].sum() == 0
    assert GpuAugment(16, True).boxes(sizes, seed=1)[:, 4].sum() > 0


@pytest.mark.parametrize("size,expected,capped", [((32, 32), 32, False), ((40, 30), 30, False),
                                                   ((400, 300), 224, True)])
def test_img_size_auto_is_the_typical_size_capped_for_speed(tmp_path, size, expected, capped):
    located = pipeline.locate(str(make_image_folder(tmp_path / "ds", size=size)))
    value, why = pipeline.auto_img_size(located)
    assert value == expected and located.img_size == expected
    assert f"typical shorter side is {min(size)} px" in why and ("capped at 224" in why) == capped
