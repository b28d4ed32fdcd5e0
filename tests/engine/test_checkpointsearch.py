"""dlenv.engine.checkpointsearch: the fewest checkpointed blocks that fit (--checkpoint-ratio auto), against a fake
memory limit and on a CPU model whose probe runs out of memory on cue."""

from __future__ import annotations

import pytest

from dlenv.engine import checkpointsearch, stepprobe


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
        res = checkpointsearch.search_checkpoint_blocks(fake, n)
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
    res = checkpointsearch.search_checkpoint_blocks(fake, 16)
    assert (res.blocks, res.fits_all, res.ratio, fake.calls) == (0, True, 0.0, [0])


def test_checkpoint_search_when_even_all_blocks_do_not_fit():
    fake = FakeBlocks(16, limit=5)
    res = checkpointsearch.search_checkpoint_blocks(fake, 16)
    assert (res.blocks, res.fits_all, res.ratio) == (16, False, 1.0)
    assert fake.calls == [0, 16]


def test_checkpoint_search_without_blocks_tries_nothing():
    fake = FakeBlocks(0, limit=0)
    res = checkpointsearch.search_checkpoint_blocks(fake, 0)
    assert (res.blocks, res.n_blocks, res.fits_all, res.ratio, res.tries) == (0, 0, True, 0.0, [])
    assert fake.calls == []


def test_checkpoint_search_ratio_and_bad_arguments():
    assert checkpointsearch.search_checkpoint_blocks(FakeBlocks(8, limit=10 + 3 * 2), 8).ratio == pytest.approx(6 / 8)
    with pytest.raises(ValueError, match="n_blocks"):
        checkpointsearch.search_checkpoint_blocks(FakeBlocks(1, 0), -1)


def test_checkpoint_search_lets_other_errors_through():
    def broken(k):
        if k:
            raise RuntimeError("shape mismatch in layer4")
        raise RuntimeError("CUDA out of memory (fake)")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        checkpointsearch.search_checkpoint_blocks(broken, 4)


def _fake_oom_below(monkeypatch, need: int) -> tuple[list, list]:
    """Make TrainStepProbe's step raise a fake OOM while fewer than `need` blocks are checkpointed
    (and run the real step on the CPU otherwise). Returns (tries as (batch, wrapped flags), probes)."""
    from dlenv.model.checkpointing import find_blocks, is_checkpointed

    real, tries, probes = stepprobe.TrainStepProbe._train, [], []

    def train(self, batch):
        wrapped = [is_checkpointed(b) for b in find_blocks(self.parts.model)]
        tries.append((batch, wrapped))
        probes.append(self)
        if sum(wrapped) < need:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        real(self, batch)

    monkeypatch.setattr(stepprobe.TrainStepProbe, "_train", train)
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
    res = checkpointsearch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=2)
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
    res = checkpointsearch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=4, safety=0.5)
    assert res.blocks == 2 and {batch for batch, _ in tries} == {8}
    with pytest.raises(ValueError, match="safety"):
        checkpointsearch.fewest_checkpoint_blocks(tiny_resnet, "fp32", 16, 10, "cpu", batch=4, safety=1.5)


def test_fewest_checkpoint_blocks_of_a_model_without_blocks_tries_nothing(monkeypatch):
    from torch import nn

    tries, _ = _fake_oom_below(monkeypatch, 0)

    def model():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 14 * 14, 10))

    res = checkpointsearch.fewest_checkpoint_blocks(model, "fp32", 16, 10, "cpu", batch=4)
    assert (res.blocks, res.n_blocks, res.fits_all, res.ratio, tries) == (0, 0, True, 0.0, [])
