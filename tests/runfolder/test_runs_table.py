"""`dlenv runs` (dlenv.runfolder.runs, compare, runstatus): the table of every run, --sort, --compare, the CSV
and JSON behind it, and run folders from elsewhere read as untrusted. Run folders are built by hand."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlenv.cli import main
from dlenv.errors import UserError
from dlenv.options import config
from dlenv.runfolder import runs, runstatus, runsview
from dlenv.runfolder.results import COLUMNS

SRC = str(Path(__file__).resolve().parents[2] / "src")


def make_run(root: Path, name: str, epochs: int = 3, planned: int = 3, top1=(50.0, 60.0, 70.0),
             status: tuple[str, str] | None = ("finished", ""), extra: str = "", last: bool = True) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"# started: 1718000000 (2024)\n# precision: fp32\n# compile_rule: off here\n"
                                     f"model: resnet18\ndata: data/pets\nepochs: {planned}\nlr: 0.1\n{extra}")
    lines = [",".join(COLUMNS)]
    for e in range(1, epochs + 1):
        row = {c: "" for c in COLUMNS}
        row.update(epoch=e, top1=top1[e - 1], img_per_s=100 * e, epoch_s=10, data_wait=0.25, val_loss=1.0,
                   mem_alloc_gib=1.5, mem_reserved_gib=2.0)
        lines.append(",".join(str(row[c]) for c in COLUMNS))
    (run / "results.csv").write_text("\n".join(lines) + "\n")
    if last:
        (run / "last.pth").write_bytes(b"x")
    if status:
        runstatus.write_status(run, *status)
    return run


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["runs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def row_of(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize(("status", "shown"), [
    (("finished", ""), "finished"),
    (("stopped", "stopped by SIGTERM; saved runs/a/last.pth. Resume with: dlenv train --resume runs/a/last.pth"),
     "stopped: stopped by SIGTERM; saved runs/a/last.pth. Resume with: dlenv train --resume runs/a/last.pth"),
    (("failed", "training stopped: loss is nan at step 12"), "failed: training stopped: loss is nan at step 12"),
    (("running", ""), "failed: ended without a word"),     # no live lock: killed
    (None, "stopped: resume with dlenv train --resume"),    # an older run, 1 of 3 epochs, last.pth
], ids=["finished", "stopped", "failed", "killed", "no-status"])
def test_each_status_is_one_row(tmp_path, capsys, status, shown):
    make_run(tmp_path, "a", epochs=1 if status is None else 3, status=status)
    code, out, err = run_cli(capsys, "--log-dir", str(tmp_path))
    assert code == 0 and not err
    line = row_of(out, "a")
    assert shown in line
    assert "resnet18" in line and "pets" in line and ("3/3" in line or "1/3" in line)


def test_a_live_lock_is_running(tmp_path, capsys):
    from dlenv import runfolder

    run = make_run(tmp_path, "a", status=("running", ""))
    with runfolder.lock_run_dir(run):
        assert runstatus.lock_held(run)
        assert row_of(run_cli(capsys, "--log-dir", str(tmp_path))[1], "a").endswith("running")
    assert not runstatus.lock_held(run)


def test_the_columns(tmp_path, capsys):
    make_run(tmp_path, "a")
    out = run_cli(capsys, "--log-dir", str(tmp_path))[1]
    assert out.splitlines()[0].split() == ["name", "model", "data", "epochs", "best", "top-1", "img/s", "peak", "GiB",
                                           "wall", "status"]
    assert row_of(out, "a").split() == ["a", "resnet18", "pets", "3/3", "70.00", "300", "2.00", "0:30", "finished"]


@pytest.mark.parametrize(("sort", "order"), [
    ("top1", ["b", "a", "c"]), ("top-1", ["b", "a", "c"]), ("name", ["a", "b", "c"]), ("epochs", ["a", "b", "c"]),
    ("wall", ["a", "b", "c"]),
])
def test_sort(tmp_path, capsys, sort, order):
    make_run(tmp_path, "a", top1=(1, 2, 3))
    make_run(tmp_path, "b", epochs=2, top1=(50, 90))
    make_run(tmp_path, "c", epochs=1, top1=(0.5,))
    out = run_cli(capsys, "--log-dir", str(tmp_path), "--sort", sort)[1]
    assert [line.split()[0] for line in out.splitlines()[1:]] == order


@pytest.mark.parametrize(("typo", "near"), [("tpo1", "top1"), ("stauts", "status"), ("zzz", None)])
def test_a_sort_typo_is_one_line_with_the_closest(tmp_path, capsys, typo, near):
    make_run(tmp_path, "a")
    code, out, err = run_cli(capsys, "--log-dir", str(tmp_path), "--sort", typo)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"did you mean {near}?" in err) if near else "did you mean" not in err


def test_compare(tmp_path, capsys):
    make_run(tmp_path, "a", top1=(1, 2, 3))
    make_run(tmp_path, "b", extra="amp: true\n")
    (tmp_path / "b" / "config.yaml").write_text((tmp_path / "b" / "config.yaml").read_text()
                                                .replace("lr: 0.1", "lr: 0.01").replace("fp32", "bf16"))
    code, out, _ = run_cli(capsys, "--log-dir", str(tmp_path), "--compare", "a", "b")
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == "options that differ:"
    assert [ln.split() for ln in lines[2:4]] == [["amp", "-", "True"], ["lr", "0.1", "0.01"]]
    assert lines[4] == "decisions that differ (config.yaml's notes):" and lines[5].split() == ["precision", "fp32",
                                                                                                "bf16"]
    assert any(ln.split() == ["best", "top-1", "3.00", "70.00"] for ln in lines)
    assert any(ln.split()[:5] == ["waiting", "for", "data", "0:08", "(25%)"] for ln in lines)
    assert "model" not in out.split("final metrics")[0]  # the same in both: not listed


@pytest.mark.parametrize(("names", "said"), [(("a", "aa"), "did you mean a?"), (("a", "bad"), "cannot be read")])
def test_compare_a_missing_or_unreadable_run(tmp_path, capsys, names, said):
    make_run(tmp_path, "a")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.yaml").write_bytes(b"\xff\xfe not utf-8")
    code, _, err = run_cli(capsys, "--log-dir", str(tmp_path), "--compare", *names)
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_csv_and_json_are_the_data_behind_the_table(tmp_path, capsys, fmt):
    make_run(tmp_path, "a")
    make_run(tmp_path, "b", epochs=2, status=("failed", "boom"))
    out = run_cli(capsys, "--log-dir", str(tmp_path), "--format", fmt)[1]
    got = json.loads(out) if fmt == "json" else list(csv.DictReader(io.StringIO(out)))
    assert [r["name"] for r in got] == ["a", "b"]
    assert float(got[0]["top1"]) == 70.0 and int(got[1]["epochs"]) == 2 and int(got[1]["planned"]) == 3
    assert got[1]["status"] == "failed: boom" and float(got[0]["wall_s"]) == 30.0


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_compare_as_csv_and_json(tmp_path, capsys, fmt):
    make_run(tmp_path, "a")
    make_run(tmp_path, "b")
    out = run_cli(capsys, "--log-dir", str(tmp_path), "--compare", "a", "b", "--format", fmt)[1]
    got = json.loads(out) if fmt == "json" else list(csv.DictReader(io.StringIO(out)))
    assert {r["part"] for r in got} == {"final", "time"}


def _bomb(run: Path) -> None:
    lol = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]"
                                                  for p, c in zip("abcdefgh", "bcdefghi", strict=False)]
    (run / "config.yaml").write_text("\n".join(lol) + "\nmodel: *i\n")


def _huge(run: Path) -> None:
    with open(run / "config.yaml", "wb") as fh:
        fh.truncate(3 << 20)  # sparse: 3 MiB of nothing, over the bound


def _fifo_config(run: Path) -> None:
    os.mkfifo(run / "config.yaml")


def _fifo_results(run: Path) -> None:
    (run / "config.yaml").write_text("model: resnet18\n")
    os.mkfifo(run / "results.csv")


def _link_out(run: Path) -> None:
    outside = run.parent.parent / "secret.yaml"
    outside.write_text("model: stolen\n")
    os.symlink(outside, run / "config.yaml")


def _not_utf8(run: Path) -> None:
    (run / "config.yaml").write_bytes(b"model: \xff\xfe\n")


def _absurd(run: Path) -> None:
    (run / "config.yaml").write_text("model: resnet18\nepochs: 100000000000\n")
    (run / "results.csv").write_text(",".join(COLUMNS) + "\n" + "1,nan,nan,nan,1e308,,,inf,-5,1e300,1e300,,,,\n"
                                     + "2,1,1,500,1,,,1e9,,,,,,,\n")


@pytest.mark.parametrize(("make", "said"), [
    (_bomb, "unreadable: config.yaml: config file"),
    (_huge, "unreadable: config.yaml: config file"),
    (_fifo_config, "named pipe"),
    (_fifo_results, "named pipe"),
    (_link_out, "link out of its folder"),
    (_not_utf8, "not UTF-8"),
    (_absurd, "2/?"),
], ids=["alias-bomb", "oversized", "fifo-config", "fifo-results", "link-out", "not-utf8", "absurd-numbers"])
def test_hostile_folders_are_rows_not_crashes(tmp_path, capsys, make, said):
    root = tmp_path / "runs"
    make_run(root, "good")
    (root / "bad").mkdir()
    make(root / "bad")
    t0 = time.monotonic()
    code, out, err = run_cli(capsys, "--log-dir", str(root))
    assert time.monotonic() - t0 < 5  # a FIFO never blocks
    assert code == 0 and not err and "Traceback" not in out
    assert said in row_of(out, "bad") and "finished" in row_of(out, "good")
    assert "stolen" not in out
    if make is _absurd:  # NaN, inf and 1e308 are missing values, not numbers
        assert row_of(out, "bad").split()[3:8] == ["2/?", "-", "-", "-", "-"]


def test_a_name_with_escapes_is_printed_escaped(tmp_path, capsys):
    make_run(tmp_path, "evil\x1b[31m\x07")
    out = run_cli(capsys, "--log-dir", str(tmp_path))[1] + run_cli(capsys, "--log-dir", str(tmp_path), "--format",
                                                                   "csv")[1]
    assert "\x1b" not in out and "\x07" not in out and "evil\\x1b[31m\\x07" in out


def test_a_folder_linked_from_outside_is_not_followed(tmp_path, capsys):
    root = tmp_path / "runs"
    make_run(root, "a")
    make_run(tmp_path / "elsewhere", "b")
    os.symlink(tmp_path / "elsewhere" / "b", root / "b")
    os.symlink(root / "a", root / "alias")  # a link inside: found under its own name only
    out = run_cli(capsys, "--log-dir", str(root))[1]
    assert "not followed" in row_of(out, "b") and "alias" not in out


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: None, "no such folder"), (lambda p: p.mkdir(), "no run folder"),
])
def test_no_runs_is_one_line(tmp_path, capsys, make, said):
    make(tmp_path / "runs")
    code, out, err = run_cli(capsys, "--log-dir", str(tmp_path / "runs"))
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("end", "status", "line"), [
    (None, "finished", ""),
    ("stop", "stopped", "stopped by SIGTERM"),
    (UserError("training stopped: loss is nan"), "failed", "training stopped: loss is nan"),
    (ValueError("x"), "failed", "ValueError: x"),
    (KeyboardInterrupt(), "stopped", "KeyboardInterrupt. Resume with: R"),
])
def test_recording_writes_how_the_run_ended(tmp_path, end, status, line):
    raised = pytest.raises(type(end)) if isinstance(end, BaseException) else contextlib.nullcontext()
    with raised, runstatus.recording(tmp_path, lambda: "Resume with: R") as record:
        assert (tmp_path / runstatus.STATUS).read_text().startswith("status: running")
        if isinstance(end, BaseException):
            raise end
        record["summary"] = ({"status": "interrupted", "line": "stopped by SIGTERM; saved x"} if end == "stop"
                             else {"status": "done"})
    got = runs.load_yaml(tmp_path / runstatus.STATUS)
    assert got["status"] == status and got["line"].startswith(line)


def test_compare_picks_by_last_part(tmp_path):
    make_run(tmp_path / "p", "x")
    rows = runs.collect(tmp_path)
    assert runsview.pick(rows, "x")["name"] == "p/x"


def test_the_verb_is_declared_and_reads_two_words():
    assert config.COMMANDS["runs"].target == "dlenv.runfolder.runsview:main"
    assert config.build(config.COMMANDS["runs"].config, compare="a,b").compare == ("a", "b")
    with pytest.raises(UserError, match="two run names"):
        config.build(config.COMMANDS["runs"].config, compare="a")


def test_runs_imports_no_torch(tmp_path):
    make_run(tmp_path, "a")
    code = ("import sys; from dlenv.cli import main; main(['runs', '--log-dir', sys.argv[1]]); "
            "print('TORCH' if 'torch' in sys.modules else 'CLEAN', 'PANDAS' if 'pandas' in sys.modules else '')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "CLEAN"
