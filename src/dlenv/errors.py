"""The one exception type for bad user input.

A `UserError` carries a single line that names the bad value and the way out; the CLI and the invoke
tasks print it as is and exit non-zero, with no traceback. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix. `str(err)` is the one line to print; `exit_code` the status."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
