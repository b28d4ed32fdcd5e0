"""tests/gpushare.py on a CPU: the GPU suite's places of 24 GiB, and what waits for what."""

from __future__ import annotations

import tempfile
import threading
import time

import gpushare
import pytest


@pytest.mark.parametrize("total,n", [(79.6, 2), (139.8, 5), (24.0, 1), (40.0, 1), (64.0, 2)])
def test_places_leave_room_for_the_small_tests(total, n):
    assert gpushare.places(total) == n
    assert n == 1 or n * gpushare.AS_ON + gpushare.SMALL <= total


def test_a_test_waits_for_a_place_while_every_place_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "cpu-check")
    monkeypatch.setenv("DLENV_GPU_TIMELINE", str(tmp_path / "timeline.tsv"))
    events, first_in = [], threading.Event()

    def hold(name, seconds):
        with gpushare.place(total_gib=64.0):  # two places
            events.append(("in", name, time.monotonic()))
            first_in.set()
            time.sleep(seconds)
            events.append(("out", name, time.monotonic()))

    threads = [threading.Thread(target=hold, args=(name, 0.6)) for name in ("a", "b")]
    for t in threads:
        t.start()
    first_in.wait(5)
    time.sleep(0.1)
    hold("c", 0.0)  # a third: waits until a or b lets go
    for t in threads:
        t.join()
    at = {(kind, name): t for kind, name, t in events}
    assert abs(at[("in", "a")] - at[("in", "b")]) < 0.4  # two places: both at once
    assert at[("in", "c")] >= min(at[("out", "a")], at[("out", "b")])
    rows = [line.split("\t") for line in (tmp_path / "timeline.tsv").read_text().splitlines()]
    assert sorted(r[1] for r in rows) == ["place0", "place0", "place1"] or \
        sorted(r[1] for r in rows) == ["place0", "place1", "place1"]


def test_outside_xdist_nothing_is_taken(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with gpushare.place(total_gib=24.0), gpushare.place(total_gib=24.0):  # one place, taken twice: no wait
        pass
    assert not list(tmp_path.iterdir())
