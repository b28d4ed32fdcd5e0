"""A pytest plugin for `dlenv test`: a progress line with the ETA of the whole run, by the clock.

pytest -q shows dots only; on a slow machine a run of minutes then looks stuck. `dlenv test` loads this
plugin (-p dlenv.testprogress): after collection it knows how many tests will run, and through
dlenv.progress it prints `tests N/M (P%)  elapsed M:SS, ETA M:SS` after the first test and then every
few seconds, as a line of its own between the dots. No torch here.
"""

from __future__ import annotations

from typing import Any

from dlenv import progress

#: seconds between progress lines
INTERVAL_S = 15.0


class _Lines:
    """A file-like object that hands each progress line to pytest's terminal writer (which starts a new
    line first, so the dots stay tidy)."""

    def __init__(self, reporter: Any):
        self.reporter = reporter

    def write(self, text: str) -> None:
        if text.strip():
            self.reporter.write("\n")  # after -q's dots, which end no line
            self.reporter.write_line(text.rstrip("\n"))

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _State:
    bar: progress.Progress | None = None
    done = 0


def pytest_collection_finish(session: Any) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.items:
        _State.bar = progress.Progress(len(session.items), "tests", interval=INTERVAL_S, file=_Lines(reporter),
                                       tty=False)
        _State.done = 0


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _State.bar is not None:
        _State.done += 1
        _State.bar.update(_State.done)
