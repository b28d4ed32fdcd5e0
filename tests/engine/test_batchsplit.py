"""dlenv.engine.batchsplit: the micro-batch x accumulation x GPUs arithmetic (for the options, and for a resume on
another number of GPUs)."""

from __future__ import annotations

import logging

import pytest

from dlenv.engine import batchsplit
from dlenv.engine.batchsplit import plan_accumulation
from dlenv.errors import UserError


@pytest.mark.parametrize("effective,micro,world,expected", [
    (256, 64, 1, (64, 4)),       # divides: unchanged
    (256, 100, 1, (64, 4)),      # ceil gives 3, which does not divide 256 -> 4 x 64
    (256, 300, 1, (256, 1)),     # fits in one step
    (256, 64, 4, (64, 1)),       # four GPUs
    (256, 40, 4, (32, 2)),       # 64 per GPU: accum 2 of 32
    (240, 100, 2, (60, 2)),
    (12, 5, 1, (4, 3)),
    (9, 8, 1, (3, 3)),           # 3 x 3 exact beats 4 x 2 = 8
])
def test_plan_accumulation_exact(effective, micro, world, expected):
    m, a = plan_accumulation(effective, micro, world)
    assert (m, a) == expected
    assert m * a * world == effective
    assert m <= micro


def test_plan_accumulation_inexact_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="dlenv.engine.batchsplit"):
        m, a = plan_accumulation(254, 100, 1)  # 254 = 2 x 127: exact would need 127 steps of 2
    assert m <= 100 and a == 3
    assert abs(m * a - 254) <= a
    assert "cannot be split exactly" in caplog.text and str(m * a) in caplog.text


def test_plan_accumulation_more_gpus_than_images():
    with pytest.raises(UserError, match="--effective-batch 2.*4 GPUs"):
        plan_accumulation(2, 8, world_size=4)


def test_plan_for_world_keeps_the_effective_batch_where_it_divides():
    assert batchsplit.plan_for_world(256, 64, 2) == (64, 2, None)
    assert batchsplit.plan_for_world(256, 64, 4) == (64, 1, None)
    micro, accum, note = batchsplit.plan_for_world(96, 64, 8)  # 12 per GPU: 12 x 1
    assert (micro, accum, note) == (12, 1, None)


def test_plan_for_world_says_when_the_effective_batch_cannot_be_kept():
    micro, accum, note = batchsplit.plan_for_world(10, 5, 4)
    assert micro * accum * 4 != 10
    assert note is not None and "effective batch 10 cannot be split" in note
    assert f"= {micro * accum * 4} images per step" in note


def test_plan_for_world_refuses_fewer_images_than_gpus():
    with pytest.raises(UserError, match="smaller than the 8 GPUs"):
        batchsplit.plan_for_world(4, 4, 8)


def test_resume_split_on_another_gpu_count():
    assert batchsplit.resume_split(32, 2, 4, 4) == (32, 2, None)
    micro, accum, note = batchsplit.resume_split(32, 1, 4, 2)  # 128 images per step on 2 GPUs
    assert (micro, accum) == (32, 2) and "keeps the effective batch 128" in note
    micro, accum, note = batchsplit.resume_split(32, 2, 2, 8)
    assert micro * accum * 8 == 128 and "keeps" in note
    micro, accum, note = batchsplit.resume_split(5, 1, 2, 4)
    assert "cannot be split" in note and note.startswith("resuming a run of 2 GPU(s) on 4")


def test_resolve_batch_reads_the_options():
    assert batchsplit.resolve_batch(8, 3, None, 1, lambda: 99) == (8, 3)
    assert batchsplit.resolve_batch("auto", 1, None, 1, lambda: 40) == (40, 1)
    assert batchsplit.resolve_batch(4, 1, 32, 2, lambda: 99) == (4, 4)
    assert batchsplit.resolve_batch("auto", 1, 96, 1, lambda: 40) == (32, 3)  # measured, then split exactly
    with pytest.raises(UserError, match="--effective-batch 10 is not a multiple.*use --effective-batch 8"):
        batchsplit.resolve_batch(4, 1, 10, 1, lambda: 99)


    assert batchsplit.resolve_batch("max", 1, None, 1, lambda: 48) == (48, 1)
