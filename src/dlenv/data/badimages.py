"""The unreadable images a run skips (`--bad-images skip`): said once each for the first few, then counted.

A class folder of 30,000 empty files used to print 30,000 warning lines. Now the first SKIPPED_SHOWN
are named with their reasons as they are met, the rest are counted, and a pass that skipped more ends
with one line for all of them (`skipped_line`). Every source of batches (DataLoader workers, the
decoded-image cache, the GPU decoders) records its skipped files through `note_skipped`.

No torch here.
"""

from __future__ import annotations

import logging

from dlenv.errors import printable

log = logging.getLogger("dlenv.data")

#: unreadable files named in the one line that says they are skipped
SKIPPED_SHOWN = 3


def skipped_line(bad: dict[str, str]) -> str:
    """One line for the unreadable images a run skips ({path: reason}, not empty): the first
    SKIPPED_SHOWN with their reasons, then a count of the rest, however many there are."""
    shown = list(bad.items())[:SKIPPED_SHOWN]
    more = len(bad) - len(shown)
    return (f"skipping {len(bad):,} unreadable image{'s' if len(bad) != 1 else ''}: "
            + ", ".join(f"{printable(p)} ({printable(r)})" for p, r in shown)
            + (f" and {more:,} more; dlenv data-report DIR lists them all" if more else ""))


def note_skipped(seen: dict[str, str], path: str, reason: str) -> None:
    """Record in `seen` ({path: reason}) an image the run skips, and say so: each of the first SKIPPED_SHOWN
    in a line of its own, then once that the rest are counted (the pass's `skipped_line` sums them up)."""
    if path in seen:
        return
    seen[path] = reason
    if len(seen) <= SKIPPED_SHOWN:
        log.warning("skipping unreadable image %s (%s)", printable(path), printable(reason))
    elif len(seen) == SKIPPED_SHOWN + 1:
        log.warning("more unreadable images: counted, not listed (the count at the end of this pass; dlenv "
                    "data-report DIR lists them all)")
