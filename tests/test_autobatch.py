"""dlenv.engine.autobatch: batch search against a fake memory limit, and the micro-batch x accumulation x GPUs
arithmetic (for the options, and for a resume on another number of GPUs)."""

from __future__ import annotations

import logging

import pytest

from dlenv.engine import autobatch
from dlenv.engine.autobatch import find_max_batch, plan_accumulation, search_max_batch
from dlenv.errors import UserError


class FakeGPU:
    """A try_step whose steps fit up to `limit` images; above it raises what CUDA raises."""

    def __init__(self, limit: int, signal: str = "raise"):
        self.limit, self.signal, self.calls = limit, signal, []

    def __call__(self, batch: int):
        self.calls.append(batch)
        if batch <= self.limit:
            return True
        if self.signal == "false":
            return False
        raise RuntimeError(f"CUDA out of memory. Tried to allocate {batch} MiB (fake)")


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 64, 100, 1000, 1023, 4097])
def test_search_finds_exact_limit(limit):
    fake = FakeGPU(limit)
    res = search_max_batch(fake, start=1)
    assert res.largest_fit == limit
    assert res.smallest_fail == limit + 1
    # doubling then bisection: logarithmic number of tries, never a try twice
    assert len(fake.calls) == len(set(fake.calls))
    assert len(fake.calls) <= 2 * limit.bit_length() + 2


def test_search_accepts_false_as_out_of_memory():
    assert search_max_batch(FakeGPU(37, signal="false")).largest_fit == 37


def test_search_start_above_limit_walks_down():
    fake = FakeGPU(5)
    assert search_max_batch(fake, start=64).largest_fit == 5
    assert fake.calls[0] == 64


def test_search_upper_caps_and_is_returned_when_it_fits():
    fake = FakeGPU(10_000)
    res = search_max_batch(fake, start=4, upper=100)
    assert res.largest_fit == 100 and res.smallest_fail is None
    assert max(fake.calls) == 100


def test_search_tolerance_stops_early_within_bound():
    fake_exact, fake_tol = FakeGPU(3000), FakeGPU(3000)
    exact = search_max_batch(fake_exact, tolerance=0.0)
    approx = search_max_batch(fake_tol, tolerance=0.05)
    assert exact.largest_fit == 3000
    assert 3000 * 0.95 <= approx.largest_fit <= 3000
    assert len(fake_tol.calls) < len(fake_exact.calls)


def test_find_max_batch_applies_safety_margin():
    assert find_max_batch(FakeGPU(100), safety=0.9, tolerance=0.0) == 90
    assert find_max_batch(FakeGPU(100), safety=1.0, tolerance=0.0) == 100
    # never below 1, even when the margin rounds a fitting batch of 1 down
    assert find_max_batch(FakeGPU(1), safety=0.5) == 1


def test_find_max_batch_batch_one_failing_is_user_error():
    with pytest.raises(UserError, match="batch of 1 does not fit.*resnet50.*--amp"):
        find_max_batch(FakeGPU(0), what="resnet50 at 224 px")


def test_other_errors_propagate():
    def broken(batch):
        raise RuntimeError("shape mismatch in layer4")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        search_max_batch(broken)


@pytest.mark.parametrize("bad", [dict(safety=0.0), dict(safety=1.5), dict(start=0)])
def test_find_max_batch_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        find_max_batch(FakeGPU(10), **bad)


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
    with caplog.at_level(logging.WARNING, logger="dlenv.engine.autobatch"):
        m, a = plan_accumulation(254, 100, 1)  # 254 = 2 x 127: exact would need 127 steps of 2
    assert m <= 100 and a == 3
    assert abs(m * a - 254) <= a
    assert "cannot be split exactly" in caplog.text and str(m * a) in caplog.text


def test_plan_accumulation_more_gpus_than_images():
    with pytest.raises(UserError, match="--effective-batch 2.*4 GPUs"):
        plan_accumulation(2, 8, world_size=4)


def test_plan_for_world_keeps_the_effective_batch_where_it_divides():
    assert autobatch.plan_for_world(256, 64, 2) == (64, 2, None)
    assert autobatch.plan_for_world(256, 64, 4) == (64, 1, None)
    micro, accum, note = autobatch.plan_for_world(96, 64, 8)  # 12 per GPU: 12 x 1
    assert (micro, accum, note) == (12, 1, None)


def test_plan_for_world_says_when_the_effective_batch_cannot_be_kept():
    micro, accum, note = autobatch.plan_for_world(10, 5, 4)
    assert micro * accum * 4 != 10
    assert note is not None and "effective batch 10 cannot be split" in note
    assert f"= {micro * accum * 4} images per step" in note


def test_plan_for_world_refuses_fewer_images_than_gpus():
    with pytest.raises(UserError, match="smaller than the 8 GPUs"):
        autobatch.plan_for_world(4, 4, 8)


def test_resume_split_on_another_gpu_count():
    assert autobatch.resume_split(32, 2, 4, 4) == (32, 2, None)
    micro, accum, note = autobatch.resume_split(32, 1, 4, 2)  # 128 images per step on 2 GPUs
    assert (micro, accum) == (32, 2) and "keeps the effective batch 128" in note
    micro, accum, note = autobatch.resume_split(32, 2, 2, 8)
    assert micro * accum * 8 == 128 and "keeps" in note
    micro, accum, note = autobatch.resume_split(5, 1, 2, 4)
    assert "cannot be split" in note and note.startswith("resuming a run of 2 GPU(s) on 4")


def test_resolve_batch_reads_the_options():
    assert autobatch.resolve_batch(8, 3, None, 1, lambda: 99) == (8, 3)
    assert autobatch.resolve_batch("auto", 1, None, 1, lambda: 40) == (40, 1)
    assert autobatch.resolve_batch(4, 1, 32, 2, lambda: 99) == (4, 4)
    assert autobatch.resolve_batch("auto", 1, 96, 1, lambda: 40) == (32, 3)  # measured, then split exactly
    with pytest.raises(UserError, match="--effective-batch 10 is not a multiple.*use --effective-batch 8"):
        autobatch.resolve_batch(4, 1, 10, 1, lambda: 99)


# ---------------------------------------------------------------------------------------------------
# The fewest checkpointed blocks that fit (--checkpoint-ratio auto).


class FakeBlocks:
    """A fits(k) whose memory is base + per_block x (n - k) unchecked blocks, against `limit`."""

    def __init__(self, n: int, limit: int, base: int = 10, per_block: int = 3, signal: str = "raise"):
        self.n, self.limit, self.base, self.per_block, self.signal = n, limit, base, per_block, signal
        self.calls: list[int] = []

    def memory(self, k: int) -> int:
        return self.base + self.per_block * (self.n - k)

    def __call__(self, k: int):
        self.calls.append(k)
        if self.memory(k) <= self.limit:
            return True
        if self.signal == "false":
            return False
        raise RuntimeError(f"CUDA out of memory. Tried to allocate {self.memory(k)} MiB (fake)")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 50])
@pytest.mark.parametrize("signal", ["raise", "false"])
def test_checkpoint_search_finds_the_fewest_blocks_that_fit(n, signal):
    # every limit from "nothing fits" to "fits without checkpointing", and one either side
    for limit in range(8, 10 + 3 * n + 2):
        fake = FakeBlocks(n, limit, signal=signal)
        res = autobatch.search_checkpoint_blocks(fake, n)
        fitting = [k for k in range(n + 1) if fake.memory(k) <= limit]
        assert res.blocks == (fitting[0] if fitting else n), (n, limit)
        assert res.fits_all == bool(fitting) and res.n_blocks == n
        assert fake.calls[0] == 0  # no checkpointing is tried first
        assert res.tries == [(k, fake.memory(k) <= limit) for k in fake.calls]
        assert len(fake.calls) == len(set(fake.calls)) <= 2 + n.bit_length()
        if fitting and fitting[0] > 0:  # the answer was seen to fit, and one block fewer not to
            assert (res.blocks, True) in res.tries and (res.blocks - 1, False) in res.tries


def test_checkpoint_search_one_try_when_nothing_needs_checkpointing():
    fake = FakeBlocks(16, limit=10_000)
    res = autobatch.search_checkpoint_blocks(fake, 16)
    assert (res.blocks, res.fits_all, res.ratio, fake.calls) == (0, True, 0.0, [0])


def test_checkpoint_search_when_even_all_blocks_do_not_fit():
    fake = FakeBlocks(16, limit=5)
    res = autobatch.search_checkpoint_blocks(fake, 16)
    assert (res.blocks, res.fits_all, res.ratio) == (16, False, 1.0)
    assert fake.calls == [0, 16]


def test_checkpoint_search_without_blocks_tries_nothing():
    fake = FakeBlocks(0, limit=0)
    res = autobatch.search_checkpoint_blocks(fake, 0)
    assert (res.blocks, res.n_blocks, res.fits_all, res.ratio, res.tries) == (0, 0, True, 0.0, [])
    assert fake.calls == []


def test_checkpoint_search_ratio_and_bad_arguments():
    assert autobatch.search_checkpoint_blocks(FakeBlocks(8, limit=10 + 3 * 2), 8).ratio == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="n_blocks"):
        autobatch.search_checkpoint_blocks(FakeBlocks(1, 0), -1)


def test_checkpoint_search_lets_other_errors_through():
    def broken(k):
        if k:
            raise RuntimeError("shape mismatch in layer4")
        raise RuntimeError("CUDA out of memory (fake)")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        autobatch.search_checkpoint_blocks(broken, 4)


def _fake_oom_below(monkeypatch, need: int) -> tuple[list, list]:
    """Make TrainStepProbe's step raise a fake OOM while fewer than `need` blocks are checkpointed
    (and run the real step on the CPU otherwise). Returns (tries as (batch, wrapped flags), probes)."""
    from dlenv.model.checkpointing import find_blocks, is_checkpointed

    real, tries, probes = autobatch.TrainStepProbe._train, [], []

    def train(self, batch):
        wrapped = [is_checkpointed(b) for b in find_blocks(self.parts.model)]
        tries.append((batch, wrapped))
        probes.append(self)
        if sum(wrapped) < need:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        real(self, batch)

    monkeypatch.setattr(autobatch.TrainStepProbe, "_train", train)
    return tries, probes


def tiny_resnet(n_blocks: int = 8):
    """A residual CNN of `n_blocks` blocks of its own class (what find_blocks finds in a user's model),
    small enough for real CPU training steps in milliseconds."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

        def forward(self, x):
            return x + torch.relu(self.bn(self.conv(x)))

    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), *[Block() for _ in range(n_blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


@pytest.mark.parametrize("need", [0, 1, 3, 5, 8, 9])
def test_fewest_checkpoint_blocks_on_a_cpu_model(monkeypatch, need):
    tries, probes = _fake_oom_below(monkeypatch, need)
    res = autobatch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=2)
    n = 8
    assert (res.n_blocks, res.blocks, res.fits_all) == (n, min(need, n), need <= n)
    assert all(batch == 3 for batch, _ in tries)  # ceil(2 / 0.92): headroom above the batch
    # each try checkpoints exactly the first k blocks, and the fitting tries are those with k >= need
    for (_, wrapped), (k, ok) in zip(tries, res.tries, strict=True):
        assert wrapped == [True] * k + [False] * (n - k)
        assert ok == (k >= need)
    if need <= n:
        assert [True] * need + [False] * (n - need) in [w for _, w in tries]
    assert probes and all(p.parts is None for p in probes)  # closed: its memory goes back


def test_fewest_checkpoint_blocks_tries_the_batch_plus_the_margin(monkeypatch):
    tries, _ = _fake_oom_below(monkeypatch, 2)
    res = autobatch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=4, safety=0.5)
    assert res.blocks == 2 and {batch for batch, _ in tries} == {8}
    with pytest.raises(ValueError, match="safety"):
        autobatch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=4, safety=1.5)


def test_fewest_checkpoint_blocks_of_a_model_without_blocks_tries_nothing(monkeypatch):
    from torch import nn

    tries, _ = _fake_oom_below(monkeypatch, 0)

    def model():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))

    res = autobatch.fewest_checkpoint_blocks(model, "fp32", 16, 10, "cpu", batch=4)
    assert (res.blocks, res.n_blocks, res.fits_all, res.ratio, tries) == (0, 0, True, 0.0, [])


# ---------------------------------------------------------------------------------------------------
# The real probe on a GPU (a capped allocator stands in for a small card).


@pytest.mark.gpu
@pytest.mark.whole_gpu  # it runs the card out of memory
def test_gpu_probe_fits_then_ooms_and_frees_its_memory():
    import torch

    from dlenv.compat import is_oom
    from dlenv.engine.autobatch import make_train_step_probe
    from dlenv.model.models import build_model

    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 1024 ** 3 / total, dev)
    try:
        probe = make_train_step_probe(lambda: build_model("resnet18", 10), "fp32", False, 64, 10, dev)
        assert probe(4) is True
        base = torch.cuda.memory_allocated(dev)  # weights, momentum, cuBLAS workspaces
        assert probe(100_000) is False  # far beyond 2 GiB: an OOM, caught
        assert torch.cuda.memory_allocated(dev) == base  # nothing of the failed try is left
        assert probe(4) is True
        res = search_max_batch(probe, start=8, tolerance=0.0)
        assert probe(res.largest_fit) and not probe(res.largest_fit + 1)
        probe.close()
        with pytest.raises(Exception) as info:
            torch.empty(10 ** 13, dtype=torch.uint8, device=dev)
        assert is_oom(info.value)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# --batch-size auto: the fastest per image among the batches that fit, against fake cards.


def _card(limit: int, rate_of):
    """A fake GPU: batches above `limit` run out of memory; the others train at `rate_of(batch)` img/s."""
    calls = []

    def rate(b):
        calls.append(b)
        if b > limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return rate_of(b)

    return rate, calls


def test_fastest_batch_stops_doubling_where_speed_stops_rising():
    # an H200 and ResNet-50 (scripts/bench_batch_sweep.py): img/s flattens long before memory runs out
    measured = {8: 400, 16: 800, 32: 1500, 64: 2501, 128: 4185, 256: 4594, 512: 4865, 1024: 5019, 2048: 5068}
    rate, calls = _card(3000, lambda b: measured[b])
    chosen = autobatch.fastest_batch(rate, start=8)
    assert chosen.batch == 512 and max(calls) == 1024  # 512 -> 1024 gained 3%: 512, and no try near the limit
    assert "+3%" in chosen.why and "512" in chosen.why
    assert measured[chosen.batch] >= 0.95 * max(measured.values())


def test_fastest_batch_takes_the_largest_that_fits_where_memory_binds_first():
    rate, _ = _card(100, lambda b: 30.0 * b)  # a small card: img/s still doubles when memory runs out
    chosen = autobatch.fastest_batch(rate, start=8)
    assert chosen.batch == autobatch.find_max_batch(lambda b: b <= 100, start=8)
    assert 0.9 * 100 <= chosen.batch <= 100 and "memory binds first" in chosen.why


def test_fastest_batch_respects_the_upper_bound_and_other_errors():
    rate, calls = _card(10**6, lambda b: float(b))
    assert autobatch.fastest_batch(rate, start=8, upper=40).batch == 40 and max(calls) == 40

    def broken(b):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):
        autobatch.fastest_batch(broken)
    with pytest.raises(autobatch.UserError):
        autobatch.fastest_batch(_card(0, float)[0])


def test_batch_size_option_takes_auto_max_and_numbers():
    from dlenv.options import config

    cfg = config.build(config.TrainConfig, batch_size="max")
    assert cfg.batch_size == "max"
    assert config.build(config.TrainConfig, batch_size="auto").batch_size == "auto"
    assert config.build(config.TrainConfig, batch_size="64").batch_size == 64
    with pytest.raises(autobatch.UserError, match="'auto' or 'max'"):
        config.build(config.TrainConfig, batch_size="biggest")
    assert autobatch.resolve_batch("max", 1, None, 1, lambda: 48) == (48, 1)
