"""The one way to matplotlib: every figure dlenv draws uses dlenv's settings alone, and its text is text.

matplotlib reads one rc file when it is imported, the first it finds of: `matplotlibrc` in the working
folder, $MATPLOTLIBRC, the user's ~/.config/matplotlib/matplotlibrc, then its own defaults. The first
three are not dlenv's: an archive unpacked into the working folder can carry a `matplotlibrc` with
`text.usetex: True` (a traceback without LaTeX) or an `axes.prop_cycle` of 300 million colours (an
import that never ends). So `matplotlib()` imports it from inside matplotlib's own data folder, where the
first place it looks holds its own defaults file, with $MATPLOTLIBRC pointing at /dev/null for an install
laid out otherwise; the working folder and the environment are put back at once. No other module of dlenv
imports matplotlib (tests/runfolder/test_drawing.py reads the source to hold this).

Every figure is built and saved inside `settings()`: matplotlib's defaults, put back whatever changed
them since (a user's model or loop imported in the same process may have), plus `SETTINGS`: no LaTeX
and no math parsing, so a class, run or command named `c$\\frac$` or `--lr $LR --bs $BS` is drawn as
those characters. Figures are `matplotlib.figure.Figure`s rendered by Agg when saved; pyplot (and with
it a GUI backend, MPLBACKEND and style files) is never imported.

No torch here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

#: dlenv's settings over matplotlib's defaults, for every figure
SETTINGS = {
    "text.usetex": False,          # LaTeX is never run on a name
    "text.parse_math": False,      # `$...$` in a name is two dollar signs, not math (matplotlib >= 3.5)
    "axes.formatter.use_mathtext": False,
    "axes.unicode_minus": True,
    "savefig.format": "png",
}
#: rc keys that are the process's, not a figure's: never reset
_PROCESS_KEYS = {"backend", "backend_fallback", "interactive", "toolbar", "timezone", "webagg.port",
                 "webagg.address", "webagg.port_retries", "webagg.open_in_browser", "figure.max_open_warning",
                 "figure.raise_window", "savefig.directory", "tk.window_focus", "docstring.hardcopy",
                 "date.epoch"}

_LOCK = threading.Lock()


def matplotlib() -> ModuleType:
    """The matplotlib package with `figure`, `ticker` and `colors` loaded, imported (on the first call in
    this process) so that it read no rc file but its own defaults. Raises ImportError without matplotlib."""
    with _LOCK:
        if "matplotlib" not in sys.modules:
            _import_with_own_defaults()
        # the package is in sys.modules now: these read no rc file, and load what the callers use
        import matplotlib.colors
        import matplotlib.figure
        import matplotlib.ticker
    return matplotlib


def _import_with_own_defaults() -> None:
    spec = importlib.util.find_spec("matplotlib")
    if spec is None:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    folders = [Path(p) / "mpl-data" for p in (spec.submodule_search_locations or ())]
    # its data folder holds nothing importable, so a '' on sys.path finds no module there meanwhile
    # (/dev, which holds no matplotlibrc either, where an install keeps its data elsewhere)
    inside = next((f for f in folders if f.is_dir()), Path(os.path.dirname(os.devnull)))
    saved_rc = os.environ.get("MATPLOTLIBRC")
    os.environ["MATPLOTLIBRC"] = os.devnull  # read next if the data folder has no matplotlibrc of its own
    back = _here()
    try:
        os.chdir(inside)
        import matplotlib  # noqa: F401 - the one import that reads an rc file
    finally:
        try:
            _return(back)
        finally:
            if saved_rc is None:
                os.environ.pop("MATPLOTLIBRC", None)
            else:
                os.environ["MATPLOTLIBRC"] = saved_rc


def _here() -> int | str | None:
    """The working folder to come back to: a descriptor (right even if the folder is renamed meanwhile),
    else its path, else None (it was removed: nothing there can be read, so nothing to come back to)."""
    with contextlib.suppress(OSError):
        return os.open(".", getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0))
    with contextlib.suppress(OSError):
        return os.getcwd()
    return None


def _return(back: int | str | None) -> None:
    if isinstance(back, int):
        try:
            os.fchdir(back)
        finally:
            os.close(back)
    elif back is not None:
        os.chdir(back)


@contextlib.contextmanager
def settings() -> Iterator[ModuleType]:
    """Within it, matplotlib's rc is its own defaults plus SETTINGS; the rc as it was comes back after.
    Yields the matplotlib package (as `matplotlib()`). Build and save each figure inside it: a Text takes
    its settings when made, a save reads its own and makes the tick labels."""
    mpl = matplotlib()
    own = {k: v for k, v in mpl.rcParamsDefault.items() if k not in _PROCESS_KEYS}
    own.update({k: v for k, v in SETTINGS.items() if k in mpl.rcParams})
    with mpl.rc_context():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # defaults of keys that are deprecated in this version
            mpl.rcParams.update(own)
        yield mpl


def new_figure(**kw):
    """A `matplotlib.figure.Figure(**kw)`: no pyplot, nothing global. Call inside `settings()`."""
    return matplotlib().figure.Figure(**kw)
