"""dlenv.results: the results.csv contract between the trainer, plots and reports."""

from __future__ import annotations

import pytest

from dlenv import results


def test_rows_append_under_one_header_in_column_order(tmp_path):
    p = tmp_path / "results.csv"
    results.append_row(p, {"epoch": 1, "train_loss": 2.5, "top1": 10.0})
    results.append_row(p, {"epoch": 2, "train_loss": 1.25, "top1": 55.5})
    lines = p.read_text().splitlines()
    assert lines[0].split(",") == list(results.COLUMNS)
    assert len(lines) == 3
    df = results.read_results(p)
    assert list(df["epoch"]) == [1, 2] and list(df["top1"]) == [10.0, 55.5]


def test_unknown_column_is_refused(tmp_path):
    with pytest.raises(KeyError, match="acc"):
        results.append_row(tmp_path / "r.csv", {"epoch": 1, "acc": 3})


def test_a_half_written_last_line_is_dropped(tmp_path):
    p = tmp_path / "results.csv"
    results.append_row(p, {"epoch": 1, "top1": 10.0})
    with p.open("a") as fh:
        fh.write("2,1.0,0.9,4")  # a row cut off mid-write, as a reader of a running trainer may see
    df = results.read_results(p)
    assert list(df["epoch"]) == [1]


def test_truncate_after_keeps_the_epochs_a_resume_does_not_repeat(tmp_path):
    p = tmp_path / "results.csv"
    for e in (1, 2, 3):
        results.append_row(p, {"epoch": e, "top1": float(e)})
    results.truncate_after(p, 2)
    assert list(results.read_results(p)["epoch"]) == [1, 2]
    assert [f.name for f in tmp_path.iterdir()] == ["results.csv"]
