"""dlenv.engine.autobatch: the searches of --batch-size max and auto against a fake memory limit (the real probe
on a GPU: test_stepprobe.py)."""

from __future__ import annotations

import pytest

from dlenv.engine.autobatch import fastest_batch, find_max_batch, search_max_batch
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
    chosen = fastest_batch(rate, start=8)
    assert chosen.batch == 512 and max(calls) == 1024  # 512 -> 1024 gained 3%: 512, and no try near the limit
    assert "+3%" in chosen.why and "512" in chosen.why
    assert measured[chosen.batch] >= 0.95 * max(measured.values())


def test_fastest_batch_takes_the_largest_that_fits_where_memory_binds_first():
    rate, _ = _card(100, lambda b: 30.0 * b)  # a small card: img/s still doubles when memory runs out
    chosen = fastest_batch(rate, start=8)
    assert chosen.batch == find_max_batch(lambda b: b <= 100, start=8)
    assert 0.9 * 100 <= chosen.batch <= 100 and "memory binds first" in chosen.why


def test_fastest_batch_respects_the_upper_bound_and_other_errors():
    rate, calls = _card(10**6, lambda b: float(b))
    assert fastest_batch(rate, start=8, upper=40).batch == 40 and max(calls) == 40

    def broken(b):
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):
        fastest_batch(broken)
    with pytest.raises(UserError):
        fastest_batch(_card(0, float)[0])


def test_batch_size_option_takes_auto_max_and_numbers():
    from dlenv.options import config

    cfg = config.build(config.TrainConfig, batch_size="max")
    assert cfg.batch_size == "max"
    assert config.build(config.TrainConfig, batch_size="auto").batch_size == "auto"
    assert config.build(config.TrainConfig, batch_size="64").batch_size == 64
    with pytest.raises(UserError, match="'auto' or 'max'"):
        config.build(config.TrainConfig, batch_size="biggest")
