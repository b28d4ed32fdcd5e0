"""dlenv.runfolder.results: the results.csv contract between the trainer, plots and reports."""

from __future__ import annotations

import pytest

from dlenv.runfolder import results


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


HEADER = ",".join(results.COLUMNS) + "\n"
#: the columns after the first 14 (gpu_busy, ...), left empty in the rows below
PAD = "," * (len(results.COLUMNS) - 14)


def _good(epoch):
    return f"{epoch},0.5,0.6,50,100,0.001,10,0.01,1.5,0,0,4,1,0{PAD}\n"


CORRUPT = {  # a line of results.csv gone wrong -> how
    "text-epoch": f"x,0.5,0.6,50,100,0.001,10,0.01,1.5,0,0,4,1,0{PAD}\n".encode(),
    "invalid-utf8": b"2,0.5,\xff\xfe,50,100,0.001,10,0.01,1.5,0,0,4,1,0" + PAD.encode() + b"\n",
    "binary": b"\x00\x00\x00\x00\x13\x37\x00\n",
    "too-few-fields": b"2,0.5,0.6\n",
    "too-many-fields": b"2," + b"1," * 20 + b"1\n",
    "inf-epoch": f"inf,0.5,0.6,50,100,0.001,10,0.01,1.5,0,0,4,1,0{PAD}\n".encode(),
    "unclosed-quote": b'2,"0.5,0.6,50\n',
    "huge-epoch": f"1e20,0.5,0.6,50,100,0.001,10,0.01,1.5,0,0,4,1,0{PAD}\n".encode(),
    "epoch-0": f"0,0.5,0.6,50,100,0.001,10,0.01,1.5,0,0,4,1,0{PAD}\n".encode(),
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_a_corrupt_line_is_left_out_and_counted(tmp_path, kind):
    p = tmp_path / "results.csv"
    p.write_bytes(HEADER.encode() + _good(1).encode() + CORRUPT[kind] + _good(3).encode())
    df = results.read_results(p)
    assert list(df["epoch"]) == [1, 3]
    assert df.attrs["dropped"] == [3]


def test_a_header_with_a_spreadsheets_bom_still_reads(tmp_path):
    p = tmp_path / "results.csv"
    p.write_bytes(b"\xef\xbb\xbf" + HEADER.encode() + _good(1).encode())
    assert list(results.read_results(p)["epoch"]) == [1]


def test_resume_over_corrupt_lines_keeps_the_good_rows_and_the_old_file(tmp_path, caplog):
    p = tmp_path / "results.csv"
    original = HEADER.encode() + _good(1).encode() + CORRUPT["invalid-utf8"] + _good(2).encode() + \
        CORRUPT["binary"] + _good(3).encode()
    p.write_bytes(original)
    with caplog.at_level("WARNING"):
        results.truncate_after(p, 2)
    assert list(results.read_results(p)["epoch"]) == [1, 2]
    kept = [f for f in tmp_path.iterdir() if f.name.startswith("results.csv.before-resume-")]
    assert len(kept) == 1 and kept[0].read_bytes() == original  # nothing lost
    assert "2 line(s) could not be read (line 3, 5)" in caplog.text and kept[0].name in caplog.text


def test_resume_over_clean_rows_keeps_no_copy(tmp_path):
    p = tmp_path / "results.csv"
    p.write_text(HEADER + _good(1) + _good(2))
    results.truncate_after(p, 1)
    assert [f.name for f in tmp_path.iterdir()] == ["results.csv"]


def test_a_row_appended_after_a_cut_off_line_stays_whole(tmp_path):
    p = tmp_path / "results.csv"
    results.append_row(p, {"epoch": 1, "top1": 10.0})
    with p.open("a") as fh:
        fh.write("2,0.9,0.8")  # killed mid-row
    results.append_row(p, {"epoch": 2, "top1": 20.0})
    df = results.read_results(p)
    assert list(df["epoch"]) == [1, 2] and list(df["top1"]) == [10.0, 20.0]
    assert df.attrs["dropped"] == [3]


OLD = ("epoch,train_loss,val_loss,top1,top5,lr,img_per_s,data_wait,epoch_s,mem_alloc_gib,mem_reserved_gib,batch_size,"
       "accum_steps,oom_retries\n1,0.5,0.6,66,100,0.001,120,0.25,10,0,0,4,1,0\n")


def test_a_row_appended_to_an_older_file_lines_up_with_a_new_header(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text(OLD)  # an older version's run, resumed by this one
    results.append_row(path, {"epoch": 2, "train_loss": 0.4, "gpu_busy": 0.875})
    df = results.read_results(path)
    assert list(df["epoch"]) == [1, 2] and df.attrs["dropped"] == []
    assert df["data_wait"][0] == 0.25 and df["gpu_busy"].isna()[0] and df["gpu_busy"][1] == 0.875
    assert path.read_text().splitlines()[0] == ",".join(results.COLUMNS)


def test_an_older_file_reads_without_the_new_column(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text(OLD)
    df = results.read_results(path)
    assert "gpu_busy" not in df.columns and df["img_per_s"][0] == 120
