"""dlenv.runfolder.drawing: every figure goes through it, reads dlenv's settings alone, and draws names as text.

The rc files that are not dlenv's (the working folder's `matplotlibrc`, $MATPLOTLIBRC, the user's) are
tried in a fresh process with a timeout, since the worst of them hangs matplotlib's import for good.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlenv.runfolder import drawing

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "dlenv"
DRAWING = PACKAGE / "runfolder" / "drawing.py"

#: an rc file that breaks drawing if read (no LaTeX here), and hangs the import if read (300 million colours)
HOSTILE_RC = ("text.usetex: True\n"
              "text.parse_math: True\n"
              "axes.prop_cycle: cycler('color', ['r'] * 300000000)\n"
              "backend: module://no_such_backend_here\n")

#: names a run, class or command can carry, each to be drawn as the very characters
HOSTILE_NAMES = ["c$\\frac$", "$", "$$", "$LR $BS", "\\frac{1}{2}", "^_", "a^b_c $x^2$", "x" * 300,
                 "two\nlines", "\u202eevil.png", "\u05e9\u05dc\u05d5\u05dd $a$", "{}%s\\\\", "_starts_low"]


def _matplotlib_imports(source: str) -> list[int]:
    """Lines of `source` that import matplotlib (or pylab), anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] in ("matplotlib", "pylab", "mpl_toolkits") for n in names):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("source, caught", [
    ("import matplotlib\n", True),
    ("def f():\n    import matplotlib.pyplot as plt\n", True),
    ("from matplotlib.figure import Figure\n", True),
    ("from matplotlib import colormaps\n", True),
    ("import os, pylab\n", True),
    ("from dlenv.runfolder import drawing\nfig = drawing.new_figure()\n", False),
    ("x = 'import matplotlib'\n", False),
])
def test_the_scan_finds_an_import_of_matplotlib(source, caught):
    assert bool(_matplotlib_imports(source)) is caught


def test_no_module_imports_matplotlib_but_drawing():
    offenders = [f"{p.relative_to(PACKAGE)}:{line}" for p in sorted(PACKAGE.rglob("*.py")) if p != DRAWING
                 for line in _matplotlib_imports(p.read_text(encoding="utf-8"))]
    assert offenders == [], "draw through dlenv.runfolder.drawing (dlenv's settings alone), not matplotlib itself"
    assert _matplotlib_imports(DRAWING.read_text(encoding="utf-8"))  # the one place does


@pytest.mark.parametrize("module, function", [
    ("runfolder/plots.py", "plot_run"), ("runfolder/plots.py", "plot_compare"), ("runfolder/plots.py", "save_figure"),
    ("evaluate.py", "plot_confusion"), ("watch/record.py", "plot"), ("bench/memory.py", "bar_chart"),
])
def test_every_figure_is_built_and_saved_under_dlenvs_settings(module, function):
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    assert [ast.unparse(d) for d in fn.decorator_list] == ["drawing.settings()"]


def _all_text(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text)]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_a_hostile_name_is_drawn_as_its_characters(tmp_path, name):
    from dlenv.evaluate import plot_confusion
    from dlenv.runfolder.plots import save_figure

    fig = plot_confusion([[3, 1], [0, 2]], [name, "ok"], title=name)
    assert save_figure(fig, tmp_path / "cm.png").read_bytes()[:4] == b"\x89PNG"
    texts = _all_text(fig)
    assert fig._suptitle.get_text() == name
    assert all(t.get_usetex() is False and t.get_parse_math() is False for t in texts)


def test_a_process_that_changed_the_rc_still_gets_dlenvs_settings_and_keeps_its_own(tmp_path):
    mpl = drawing.matplotlib()
    from dlenv.watch.probes import Sample
    from dlenv.watch.record import plot

    before = dict(mpl.rcParams)
    with mpl.rc_context({"text.usetex": True, "text.parse_math": True, "lines.linewidth": 9.0}):
        path = plot([Sample(t=0.0, host_cpu=1.0), Sample(t=1.0, host_cpu=2.0)], [], tmp_path / "w.png", "$LR $BS")
        assert path.read_bytes()[:4] == b"\x89PNG"
        assert mpl.rcParams["text.usetex"] is True and mpl.rcParams["lines.linewidth"] == 9.0  # put back
    assert dict(mpl.rcParams) == before


# ---------------------------------------------------------------------------------------------------
# rc files that are not dlenv's, in a fresh process each


DRAW = textwrap.dedent("""
    import os, sys
    from dlenv.runfolder import drawing
    before = (os.getcwd(), os.environ.get("MATPLOTLIBRC"))
    with drawing.settings() as mpl:
        fig = drawing.new_figure()
        ax = fig.subplots()
        ax.plot([0, 1], [1, 2], label="c$\\\\frac$")
        ax.legend()
        fig.suptitle("$LR $BS")
        fig.savefig("out.png")
        usetex, colours = mpl.rcParams["text.usetex"], len(mpl.rcParams["axes.prop_cycle"])
    print(usetex, colours, (os.getcwd(), os.environ.get("MATPLOTLIBRC")) == before, mpl.rcParams["backend"])
""")


def _hostile_env(tmp_path: Path, where: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MATPLOTLIBRC", "MPLCONFIGDIR", "MPLBACKEND")}
    rc_dir = tmp_path / "rc"
    rc_dir.mkdir()
    if where == "working folder":
        (tmp_path / "matplotlibrc").write_text(HOSTILE_RC)
    elif where == "MATPLOTLIBRC file":
        (rc_dir / "evil.rc").write_text(HOSTILE_RC)
        env["MATPLOTLIBRC"] = str(rc_dir / "evil.rc")
    elif where == "MATPLOTLIBRC folder":
        (rc_dir / "matplotlibrc").write_text(HOSTILE_RC)
        env["MATPLOTLIBRC"] = str(rc_dir)
    elif where == "the user's":
        (rc_dir / "matplotlib").mkdir()
        (rc_dir / "matplotlib" / "matplotlibrc").write_text(HOSTILE_RC)
        env["XDG_CONFIG_HOME"] = str(rc_dir)
    elif where == "MPLCONFIGDIR":
        (rc_dir / "matplotlibrc").write_text(HOSTILE_RC)
        env["MPLCONFIGDIR"] = str(rc_dir)
    return env


PLACES = ["working folder", "MATPLOTLIBRC file", "MATPLOTLIBRC folder", "the user's", "MPLCONFIGDIR"]


@pytest.mark.parametrize("where", PLACES)
def test_an_rc_file_that_is_not_dlenvs_plays_no_part(tmp_path, where):
    env = _hostile_env(tmp_path, where)
    done = subprocess.run([sys.executable, "-c", DRAW], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # read, the 300-million-colour cycle would hang past this
    assert done.returncode == 0, done.stderr
    usetex, colours, same, _backend = done.stdout.split()
    assert (usetex, colours, same) == ("False", "10", "True")  # matplotlib's ten colours; folder and env back
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def _results_csv(run: Path) -> None:
    run.mkdir(parents=True)
    (run / "results.csv").write_text("epoch,train_loss,val_loss,top1,top5,lr\n1,2.0,1.9,40.0,90.0,0.1\n"
                                     "2,1.5,1.4,55.0,95.0,0.05\n")


VERBS = {
    "watch": (["watch", "--interval", "0.1", "--", sys.executable, "-c", "import time; time.sleep(0.6)  # $LR $BS"],
              "runs/watch/exp/watch.png"),
    "plot": (["plot", "--log-dir", "runs"], "runs/c$\\frac$/results.png"),
}


@pytest.mark.slow
@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("where", ["working folder", "MATPLOTLIBRC file"])
def test_watch_and_plot_draw_beside_a_hostile_rc(tmp_path, verb, where):
    env = _hostile_env(tmp_path, where)
    _results_csv(tmp_path / "runs" / "c$\\frac$")
    _results_csv(tmp_path / "runs" / "$$")
    argv, png = VERBS[verb]
    done = subprocess.run([sys.executable, "-m", "dlenv", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


VAL = textwrap.dedent("""
    from pathlib import Path
    from dlenv.evaluate import write_reports
    names = ["c$\\\\frac$", "$$"]
    metrics = {"class_names": names, "top1": 50.0, "confusion_matrix": [[1, 1], [0, 2]],
               "per_class": [{"class": n, "precision": 1.0, "recall": 0.5, "f1": 0.6, "support": 2} for n in names],
               "macro_avg": {"precision": 1.0, "recall": 0.5, "f1": 0.6, "support": 4},
               "weighted_avg": {"precision": 1.0, "recall": 0.5, "f1": 0.6, "support": 4}}
    errors = [{"path": "a.png", "true_class": names[0], "predicted_class": names[1], "confidence": 0.9}]
    write_reports(Path("val"), metrics, errors)
""")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["working folder", "MATPLOTLIBRC folder"])
def test_vals_reports_are_written_beside_a_hostile_rc(tmp_path, where):
    env = _hostile_env(tmp_path, where)
    done = subprocess.run([sys.executable, "-c", VAL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "val" / "errors.csv").read_text().count("frac") == 1
    assert (tmp_path / "val" / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"
