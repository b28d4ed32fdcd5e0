"""unpack's verdict is its exit code: data it cannot train on exits 2 with one line (the files stay), and a
dataset nested folders down says so and names the --data that works (dlenv.data.unpack.main)."""

from __future__ import annotations

import zipfile

import pytest
from imagedata import encoded_image

from dlenv import cli

PNG = encoded_image("png")

# (archive members, exit code, words of the one line on stderr, a file that stays)
CASES = {
    "good": (["cat/a.png", "dog/a.png"], 0, None, "cat/a.png"),
    "good-split": (["ds/train/cat/1.png", "ds/train/dog/1.png", "ds/val/cat/1.png", "ds/val/dog/1.png"], 0, None,
                   "train/cat/1.png"),
    "flat": (["a.png", "b.png", "c.png"], 2, "holds images directly (a.png, ...) but no class folders", "a.png"),
    "one-class": (["cat/a.png", "cat/b.png", "dog/notes.txt"], 2, "one class (cat)", "cat/a.png"),
    "mismatch": (["train/cat/a.png", "train/dog/a.png", "val/cat/a.png", "val/bird/a.png"], 2,
                 "val/ and train/ have different classes (only in val/: bird; only in train/: dog)",
                 "val/bird/a.png"),
    "deep": (["a/b/c/ds/train/cat/1.png", "a/b/c/ds/train/dog/1.png", "a/b/c/ds/val/cat/1.png",
              "a/b/c/ds/val/dog/1.png"], 2,
             "the dataset sits 3 folders down in data/deep/ (b/c/ds/); train on it with --data data/deep/b/c/ds",
             "b/c/ds/train/cat/1.png"),
    "deep-classes": (["x/y/z/cat/1.png", "x/y/z/dog/1.png", "notes.txt"], 2,
                     "the dataset sits 3 folders down in data/deep-classes/ (x/y/z/); train on it with --data "
                     "data/deep-classes/x/y/z", "x/y/z/cat/1.png"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_is_the_exit_code(tmp_path, monkeypatch, capsys, name):
    members, code, words, stays = CASES[name]
    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(tmp_path / f"{name}.zip", "w") as zf:
        for m in members:
            zf.writestr(m, b"notes\n" if m.endswith(".txt") else PNG)
    assert cli.main(["unpack", f"{name}.zip"]) == code
    out, err = capsys.readouterr()
    assert f"into data/{name}/" in out  # unpacked, whatever the verdict
    assert (tmp_path / "data" / name / stays).is_file()  # and nothing taken back
    if words is None:
        assert err == "" and "classes   2" in out
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], err
        assert lines[0].endswith(f"the files stay in data/{name}/"), lines[0]


def test_no_report_no_verdict(tmp_path, monkeypatch, capsys):
    """--no-report judges nothing: the unpack itself succeeded."""
    monkeypatch.chdir(tmp_path)
    with zipfile.ZipFile(tmp_path / "flat.zip", "w") as zf:
        zf.writestr("a.png", PNG)
    assert cli.main(["unpack", "flat.zip", "--no-report"]) == 0
