"""dlenv.runfolder.plots: results.png per run and compare.png from results.csv alone; no torch imported."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dlenv.cli import main as cli_main
from dlenv.errors import UserError
from dlenv.runfolder import plots
from dlenv.runfolder.results import COLUMNS, append_row, read_results

ROOT = Path(__file__).resolve().parents[2]


def _row(epoch: int, scale: float = 1.0) -> dict:
    return {"epoch": epoch, "train_loss": 2.0 / epoch, "val_loss": 2.2 / epoch + 0.1,
            "top1": min(99.0, 30.0 * epoch * scale), "top5": min(100.0, 60.0 + 10 * epoch),
            "lr": 0.1 / epoch, "img_per_s": 1000.0 + 10 * epoch, "data_wait": 0.05 * epoch,
            "epoch_s": 12.5, "mem_alloc_gib": 3.0 * scale + 0.01 * epoch, "mem_reserved_gib": 4.0 * scale,
            "batch_size": 32, "accum_steps": 1, "oom_retries": 0}


def _make_run(folder: Path, epochs: int, scale: float = 1.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for e in range(1, epochs + 1):
        append_row(folder / "results.csv", _row(e, scale))
    return folder


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _axis(fig, title: str):
    found = [ax for ax in fig.axes if ax.get_title() == title]
    assert found, f"no panel titled {title!r}: {[a.get_title() for a in fig.axes]}"
    return found[0]


def _line(ax, label: str):
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert found, f"no line {label!r} in {ax.get_title()!r}"
    return found[0]


def test_results_png_plots_the_csv_values(tmp_path):
    run = _make_run(tmp_path / "runs" / "exp", epochs=4)
    df = read_results(run / "results.csv")
    fig = plots.plot_run(df, "exp")
    expected = {("Loss", "train"): "train_loss", ("Loss", "val"): "val_loss",
                ("Validation accuracy", "top-1"): "top1", ("Validation accuracy", "top-5"): "top5",
                ("Training throughput", "images/s (all GPUs)"): "img_per_s",
                ("Peak GPU memory", "allocated"): "mem_alloc_gib",
                ("Peak GPU memory", "reserved"): "mem_reserved_gib"}
    for (title, label), col in expected.items():
        line = _line(_axis(fig, title), label)
        assert list(line.get_xdata()) == [1, 2, 3, 4]
        assert list(line.get_ydata()) == pytest.approx(df[col].tolist(), rel=1e-5)
    # data wait is stored as a 0-1 share and shown in %
    wait = _line(_axis(fig, "Waiting for data"), "data wait")
    assert list(wait.get_ydata()) == pytest.approx([5.0, 10.0, 15.0, 20.0], rel=1e-5)
    # every panel has labelled axes with units where there are units
    for ax in fig.axes:
        if ax.get_title():
            assert ax.get_xlabel() == "epoch" and ax.get_ylabel()
    assert _axis(fig, "Peak GPU memory").get_ylabel() == "memory (GiB)"
    assert _axis(fig, "Validation accuracy").get_ylabel() == "accuracy (%)"


def test_plot_writes_results_and_compare_png(tmp_path, capsys):
    runs = tmp_path / "runs"
    _make_run(runs / "exp", epochs=5)
    _make_run(runs / "exp2", epochs=3, scale=0.5)
    assert cli_main(["plot", "--log-dir", str(runs)]) == 0
    for png, min_w in ((runs / "exp" / "results.png", 800), (runs / "exp2" / "results.png", 800),
                       (runs / "compare.png", 800)):
        w, h = _png_size(png)
        assert min_w <= w <= 4000 and 300 <= h <= 3000, (png, w, h)
        assert png.stat().st_size > 10_000
    # no temporary files left behind by the atomic writes
    assert not [p for p in runs.rglob("*.tmp")]


def test_compare_overlays_each_runs_top1_and_memory(tmp_path):
    a = read_results(_make_run(tmp_path / "a", epochs=3) / "results.csv")
    b = read_results(_make_run(tmp_path / "b", epochs=2, scale=0.5) / "results.csv")
    fig = plots.plot_compare({"a": a, "b": b})
    acc = _axis(fig, "Validation top-1")
    assert list(_line(acc, "a").get_ydata()) == pytest.approx(a["top1"].tolist())
    assert list(_line(acc, "b").get_ydata()) == pytest.approx(b["top1"].tolist())
    mem = [ax for ax in fig.axes if ax.get_title().startswith("Peak GPU memory")][0]
    assert list(_line(mem, "b").get_ydata()) == pytest.approx(b["mem_alloc_gib"].tolist())
    assert list(_line(mem, "_b").get_ydata()) == pytest.approx(b["mem_reserved_gib"].tolist())


def test_run_in_progress_one_row_and_partial_line(tmp_path):
    run = _make_run(tmp_path / "exp", epochs=1)
    with (run / "results.csv").open("a") as fh:
        fh.write("2,1.1,1.2")  # the trainer is mid-write of epoch 2
    assert cli_main(["plot", "--log-dir", str(run)]) == 0
    assert _png_size(run / "results.png")[0] >= 800
    assert not (run / "compare.png").exists()  # one run: nothing to compare
    df = read_results(run / "results.csv")
    line = _line(_axis(plots.plot_run(df, "exp"), "Loss"), "train")
    assert list(line.get_ydata())[0] == pytest.approx(2.0)


def test_header_only_run_is_skipped_and_alone_is_an_error(tmp_path):
    run = tmp_path / "runs" / "new"
    run.mkdir(parents=True)
    (run / "results.csv").write_text(",".join(COLUMNS) + "\n")
    with pytest.raises(UserError, match="no run has a complete epoch"):
        plots.plot_log_dir(tmp_path / "runs")
    _make_run(tmp_path / "runs" / "done", epochs=2)
    written = plots.plot_log_dir(tmp_path / "runs")
    assert written == [tmp_path / "runs" / "done" / "results.png"]


def test_folder_without_runs_is_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot", "--log-dir", str(tmp_path / "empty")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no results.csv" in err and "empty" in err
    assert cli_main(["plot", "--log-dir", str(tmp_path / "missing")]) != 0
    assert "no such folder" in capsys.readouterr().err


def test_find_runs_nested_and_itself(tmp_path):
    _make_run(tmp_path / "proj" / "exp", 1)
    _make_run(tmp_path / "proj" / "group" / "exp3", 1)
    _make_run(tmp_path / "proj" / ".hidden", 1)
    runs = plots.find_runs(tmp_path / "proj")
    assert runs == [tmp_path / "proj" / "exp", tmp_path / "proj" / "group" / "exp3"]
    assert plots.run_label(runs[1], tmp_path / "proj") == "group/exp3"
    assert plots.find_runs(tmp_path / "proj" / "exp") == [tmp_path / "proj" / "exp"]


def test_plots_never_imports_torch(tmp_path):
    _make_run(tmp_path / "exp", epochs=2)
    code = ("import sys\nfrom dlenv.runfolder import plots\nplots.plot_log_dir(sys.argv[1])\n"
            "print('TORCH' if 'torch' in sys.modules else 'CLEAN')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "exp")], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("CLEAN")


def test_workspace_script_runs_plot(tmp_path):
    _make_run(tmp_path / "runs" / "exp", epochs=2)
    r = subprocess.run([sys.executable, str(ROOT / "workspace" / "plot_results.py"), "--log-dir",
                        str(tmp_path / "runs")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "runs" / "exp" / "results.png").is_file()


#: results.csv's header before the gpu_busy column: the files below are an older version's, which plot as ever
OLD_HEADER = ("epoch,train_loss,val_loss,top1,top5,lr,img_per_s,data_wait,epoch_s,mem_alloc_gib,mem_reserved_gib,"
              "batch_size,accum_steps,oom_retries")


def _write_csv(folder: Path, body: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.csv").write_bytes(OLD_HEADER.encode() + b"\n" + body)
    return folder


def test_an_older_files_columns_are_a_prefix_of_todays():
    assert list(COLUMNS)[:14] == OLD_HEADER.split(",")  # new columns go at the end


@pytest.mark.parametrize("body", [
    b"1,inf,0.66,66,100,0.001,1.2,0.002,10,0,0,4,1,0\n",  # one row: its ylim came from inf
    b"1,0.5,0.66,66,100,0.001,1.2,inf,10,0,0,4,1,0\n2,0.5,0.66,66,100,0.001,1.2,0.1,10,-inf,nan,4,1,0\n",
    b"1,nan,nan,nan,nan,nan,nan,nan,nan,nan,nan,4,1,0\n",
], ids=["inf-loss-alone", "inf-data-wait-and-memory", "all-nan"])
def test_inf_and_nan_values_plot_without_crashing(tmp_path, body):
    run = _write_csv(tmp_path / "r", body)
    written = plots.plot_log_dir(tmp_path)
    assert written == [run / "results.png"] and _png_size(written[0])[0] > 500


def test_inf_is_left_out_of_the_axis_and_said_in_the_title(tmp_path):
    df = read_results(_write_csv(tmp_path / "r", b"1,inf,0.6,66,100,0.001,1.2,0.002,10,0,0,4,1,0\n"
                                                  b"2,0.5,0.5,70,100,0.001,1.2,0.002,10,0,0,4,1,0\n") / "results.csv")
    fig = plots.plot_run(df, "r")
    loss = fig.axes[0]
    assert "1 inf/nan value(s) not drawn" in loss.get_title()
    lo, hi = loss.get_xlim()
    assert lo < 1 and hi > 2  # both epochs on the axis


def test_one_good_row_and_a_broken_line_plots_the_good_row(tmp_path, capsys):
    run = _write_csv(tmp_path / "r", b"1,0.5,0.66,66,100,0.001,1.2,0.002,10,0,0,4,1,0\n2,0.4,\xff\xfe\x00garbage\n")
    assert plots.plot_log_dir(tmp_path) == [run / "results.png"]
    out = capsys.readouterr().out
    assert "1 line(s) could not be read and are not plotted (line 3)" in out and "1 epoch(s)" in out


def test_a_file_of_only_broken_lines_is_skipped_saying_so(tmp_path, capsys):
    _write_csv(tmp_path / "r", b"\x00\x01\x02\n\xff\xfe\n")
    with pytest.raises(UserError, match="no run has a complete epoch"):
        plots.plot_log_dir(tmp_path)
    assert "none of its 2 line(s) could be read" in capsys.readouterr().out


@pytest.mark.parametrize("gpu_runs,cpu_runs,note", [
    (["a"], ["cpu1"], "CPU run: cpu1 (no GPU memory to draw)"),          # mixed: the GPU line plus a note
])
def test_compare_notes_cpu_runs_instead_of_a_zero_line(tmp_path, gpu_runs, cpu_runs, note):
    frames = {}
    for name in gpu_runs + cpu_runs:
        df = read_results(_make_run(tmp_path / name, epochs=2) / "results.csv")
        if name in cpu_runs:
            df["mem_alloc_gib"], df["mem_reserved_gib"] = 0.0, 0.0  # what a CPU run records
        frames[name] = df
    mem = [ax for ax in plots.plot_compare(frames).axes if ax.get_title().startswith("Peak GPU memory")][0]
    assert {ln.get_label().lstrip("_") for ln in mem.get_lines()} == set(gpu_runs)
    assert [t.get_text() for t in mem.texts] == [note]


def test_compare_of_cpu_runs_only_has_no_empty_memory_panel(tmp_path):
    frames = {}
    for name in ("cpu1", "cpu2"):
        df = read_results(_make_run(tmp_path / name, epochs=2) / "results.csv")
        df["mem_alloc_gib"], df["mem_reserved_gib"] = 0.0, 0.0  # what a CPU run records
        frames[name] = df
    fig = plots.plot_compare(frames)
    assert [ax.get_title() for ax in fig.axes] == ["Validation top-1"]
    assert {ln.get_label() for ln in fig.axes[0].get_lines()} == {"cpu1", "cpu2"}
    assert "no GPU memory" in fig._suptitle.get_text()


# --------------------------------------------------------------------------------------------------
# compare.png: a colour per run however many, natural order, each run's data and model named.


def _frames(tmp_path: Path, names: list[str]) -> dict:
    return {n: read_results(_make_run(tmp_path / n, epochs=2, scale=1 + i / 100) / "results.csv")
            for i, n in enumerate(names)}


@pytest.mark.parametrize("n", [2, 10, 11, 25, 60])
def test_compare_gives_every_run_a_colour_of_its_own(tmp_path, n):
    from matplotlib.colors import to_rgba

    fig = plots.plot_compare(_frames(tmp_path, [f"exp{i}" for i in range(1, n + 1)]))
    acc = _axis(fig, "Validation top-1")
    colours = {ln.get_label(): to_rgba(ln.get_color()) for ln in acc.get_lines()}
    assert len(colours) == n and len(set(colours.values())) == n
    mem = [ax for ax in fig.axes if ax.get_title().startswith("Peak GPU memory")][0]
    for ln in mem.get_lines():  # a run's allocated and reserved lines share its colour
        assert to_rgba(ln.get_color()) == colours[ln.get_label().lstrip("_")]
    assert all(sum(c[:3]) > 0.3 for c in colours.values())  # none near-black


@pytest.mark.parametrize("names,expected", [
    (["exp10", "exp2", "exp", "exp3-2", "exp3"], ["exp", "exp2", "exp3", "exp3-2", "exp10"]),
    (["b2", "B10", "a100", "a9"], ["a9", "a100", "b2", "B10"]),
    (["run-1.10", "run-1.9", "run-1"], ["run-1", "run-1.9", "run-1.10"]),
])
def test_runs_are_in_natural_order_in_find_runs_and_the_legend(tmp_path, names, expected):
    for name in names:
        _make_run(tmp_path / "runs" / name, epochs=1)
    assert [p.name for p in plots.find_runs(tmp_path / "runs")] == expected
    fig = plots.plot_compare(_frames(tmp_path / "frames", names))
    legend = _axis(fig, "Validation top-1").get_legend()
    assert [t.get_text() for t in legend.get_texts()] == expected


def _config(run: Path, text: str) -> None:
    (run / "config.yaml").write_text("# dlenv train: the options of this run\n" + text, encoding="utf-8")


def test_compare_and_results_name_each_runs_data_and_model(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    _config(_make_run(runs / "exp", 2), "data: data/digits\nmodel: small_cnn\nsynthetic: false\n")
    _config(_make_run(runs / "exp2", 2), "data: data/digits/\nmodel: resnet18\npretrained: DEFAULT\n")
    _config(_make_run(runs / "exp10", 2), "data: null\nmodel: small_cnn\n")
    _make_run(runs / "old", 2)  # no config.yaml: plotted under its name alone
    figs = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figs.setdefault(Path(path).relative_to(runs), fig))
    plots.plot_log_dir(runs)
    legend = _axis(figs[Path("compare.png")], "Validation top-1").get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "exp: small_cnn on digits", "exp2: resnet18 (pretrained) on digits", "exp10: small_cnn on demo data", "old"]
    assert figs[Path("compare.png")]._suptitle.get_text() == "4 runs compared"
    assert figs[Path("exp2/results.png")]._suptitle.get_text().startswith("exp2 (resnet18 (pretrained) on digits): ")


def test_runs_that_share_data_and_model_say_it_in_the_title(tmp_path):
    frames = _frames(tmp_path, ["exp", "exp2"])
    fig = plots.plot_compare(frames, {"exp": "resnet18 on digits", "exp2": "resnet18 on digits"})
    assert fig._suptitle.get_text() == "2 runs compared: resnet18 on digits"


@pytest.mark.parametrize("text,expected", [
    ("data: data/flowers\nmodel: timm/convnext_atto\n", "timm/convnext_atto on flowers"),
    ("synthetic: true\nmodel: resnet50\n", "resnet50 on synthetic data"),
    ("data: ds\nmodel: [1, 2]\n", "a model on ds"),                       # not a string: not shown
    ("data: 7\nmodel: m\n", "m on its data"),
    ("data: ds\nmodel: '" + "x" * 500 + "'\n", "x" * 37 + "... on ds"),   # bounded
    ("data: ds\nmodel: \"evil\\e[2J\"\n", "evil\\x1b[2J on ds"),          # control characters escaped
    ("other: 1\n", "a model on demo data"),
], ids=["path", "synthetic", "list", "number", "long", "escape", "neither"])
def test_describe_run_shows_only_bounded_printable_strings(tmp_path, text, expected):
    run = tmp_path / "r"
    run.mkdir()
    _config(run, text)
    assert plots.describe_run(run) == expected


@pytest.mark.parametrize("content", [
    b"a: &x [1]\nb: *x\n",            # an alias: refused as in any config file
    b"\xff\xfe not utf-8\n",
    b"- a list\n- not a mapping\n",
    b"data: [unclosed\n",
], ids=["alias", "bytes", "list", "broken"])
def test_an_unreadable_config_yaml_is_one_note_and_the_run_is_still_plotted(tmp_path, capsys, monkeypatch,
                                                                           content):
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: Path(path))  # the figures, not their PNGs
    run = _make_run(tmp_path / "runs" / "exp", 1)
    _make_run(tmp_path / "runs" / "exp2", 1)
    (run / "config.yaml").write_bytes(content)
    assert plots.describe_run(run) is None
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "config.yaml" in notes[0] and "plotted without its data and model" in notes[0]
    assert len(plots.plot_log_dir(tmp_path / "runs")) == 3


@pytest.mark.parametrize("names", [
    ["c$\\frac$", "exp"],
    ["$$", "$LR $BS"],
    ["^_{x}", "\\frac{1}{2}", "\u202egnp.exe", "a" * 200],
], ids=["frac", "dollars", "math-rtl-long"])
def test_run_folders_with_math_in_their_names_plot_as_text(tmp_path, capsys, names):
    runs = tmp_path / "runs"
    for i, name in enumerate(names):
        _make_run(runs / name, epochs=2 + i)
    assert cli_main(["plot", "--log-dir", str(runs)]) == 0
    for name in names:
        _png_size(runs / name / "results.png")
    _png_size(runs / "compare.png")
    frames = {name: read_results(runs / name / "results.csv") for name in names}
    fig = plots.plot_compare(frames)
    texts = _axis(fig, "Validation top-1").get_legend().get_texts()
    assert sorted(t.get_text() for t in texts) == sorted(plots.cut(n) for n in names)
    assert not any(t.get_parse_math() or t.get_usetex() for t in texts)  # each name as its characters, not math


@pytest.mark.parametrize("head, labels", [
    ("# classes: 4\n", {"top-1"}),            # every class is in the top 5: top-5 means nothing
    ("# classes: 5\n", {"top-1"}),
    ("# classes: 10\n", {"top-1", "top-5"}),
    ("", {"top-1", "top-5"}),                 # a config.yaml that records no class count: drawn as before
    (None, {"top-1", "top-5"}),               # no config.yaml at all
])
def test_results_png_draws_top5_only_with_more_than_5_classes(tmp_path, head, labels):
    run = _make_run(tmp_path / "exp", epochs=2)
    if head is not None:
        (run / "config.yaml").write_text("# dlenv train: the options of this run\n" + head + "model: tiny\n")
    fig = plots.plot_run(read_results(run / "results.csv"), "exp", plots.run_classes(run))
    acc = _axis(fig, "Validation accuracy")
    assert {ln.get_label() for ln in acc.get_lines()} == labels
    assert {t.get_text() for t in acc.get_legend().get_texts()} == labels
