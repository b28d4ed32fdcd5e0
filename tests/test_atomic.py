"""dlenv.atomic: a file is replaced whole or left as it was."""

from __future__ import annotations

import pytest

from dlenv.atomic import write_atomic, write_bytes, write_text


def test_writes_and_replaces(tmp_path):
    p = tmp_path / "sub" / "r.txt"
    write_text(p, "one")
    write_bytes(p, b"two")
    assert p.read_bytes() == b"two"
    assert [f.name for f in p.parent.iterdir()] == ["r.txt"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(p, half_then_fail)
    assert p.read_text() == "old"
    assert [f.name for f in tmp_path.iterdir()] == ["r.csv"]
