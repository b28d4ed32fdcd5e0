"""The unreadable images of a dataset: the one rule every source of batches follows for them, the error that
stops a run on one, and how the skipped ones are said (once each for the first few, then counted).

The rule (`first_readable`): a sample whose file cannot be decoded is replaced, image and label, by the next
readable sample in dataset order, wrapping round, so a run is the same every time whichever source decodes
(DataLoader workers, the decoded-image cache, the GPU decoders). `--bad-images error` stops at the first one
instead, with `BadImageError`: one line naming the file.

A class folder of 30,000 empty files used to print 30,000 warning lines. Now the first SKIPPED_SHOWN are
named with their reasons as they are met, the rest are counted, and a pass that skipped more ends with one
line for all of them (`skipped_line`). Every source records its skipped files through `note_skipped`.

A stop signal is never a bad image: it is a BaseException (dlenv.errors.Stopped) that the skippers'
`except Exception` do not take, and one a decoder turned into an error of its own is raised again by
`bad_image_reason`, which every skipper asks. Nor is the host out of memory: `bad_image_reason` raises it
again, so a full RAM ends the command as out of memory, never as a dataset of which no image decodes.

No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dlenv.errors import UserError, check_stop, host_memory_short, printable

log = logging.getLogger("dlenv.data")

#: unreadable files named in the one line that says they are skipped
SKIPPED_SHOWN = 3
#: what BadImageError adds when a skipped file has no readable sample to stand in for it
NONE_READABLE = "and no other image in the dataset decodes either"


class BadImageError(UserError):
    """An image failed to decode with bad_images='error' (or none decodes). str() is one line naming the file."""

    def __init__(self, path: str, reason: str, hint: str = "fix or delete it, or train with --bad-images skip"):
        self.path, self.reason, self.hint = path, reason, hint
        super().__init__(f"image {path} could not be decoded ({reason}); {hint}")


def bad_image_reason(e: BaseException) -> str:
    """Why an image could not be read: its whole message on one line (the type's name if empty), for the
    one log line and the BadImageError each bad file gets, on every path alike. Pillow's "cannot identify
    image file <_io.BufferedReader name=...>" names a Python object, not the file's problem: said plainly.
    Raises errors.Stopped instead after a stop signal: `e` may be the stop, which a decoder turned into an
    error of its own, and the file is then not known to be bad. Raises `e` itself when it is the host out of
    memory (a MemoryError, PyTorch's CPU allocator refusing): the machine failed, not the file, and the CLI
    says so (exit 3) instead of "could not be decoded"."""
    check_stop()
    if host_memory_short(e):
        raise e
    if type(e).__name__ == "UnidentifiedImageError":
        return "not an image format Pillow can read (another kind of file, or its start is damaged)"
    return " ".join(str(e).split()) or type(e).__name__


class KnownBad(dict):
    """{index: reason} of a dataset's files found unreadable, and `after` ({bad index: the index to try next},
    every index between known bad): where a run of bad files ends, so `first_readable` jumps over it instead
    of walking it again for each index in it. One per source of samples (and per worker process)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.after: dict[int, int] = {}


def first_readable(index: int, samples: Sequence[tuple[str, int]], load: Callable[[int], Any],
                   known_bad: dict[int, str], bad_images: str) -> tuple[int, Any, list[int]]:
    """(j, load(j), bad) for the first sample j of `index`, index + 1, ... (dataset order, wrapping round) that
    `load` reads: the one rule for an unreadable image. `bad`: `index` when it is unreadable, and the other
    bad indices found in this call (not those known before, which were said when they were found).

    `known_bad` ({index: reason}) is read and extended, so a file is tried once. A `KnownBad` also remembers
    where each run of known bad files ends, so a pass over n samples, however many are bad, costs O(n) tries
    and steps (20,000 empty files before one good one took 2 x 10^8 steps, half an hour, when each index
    walked its run again). Raises BadImageError for the first bad file met with bad_images 'error', and
    when no sample of the dataset is readable.
    """
    n = len(samples)
    after = getattr(known_bad, "after", {})
    found: list[int] = []
    passed: list[int] = []  # the bad indices this call went by: each will lead straight to what it finds
    i, covered = index % n, 0
    while covered < n:
        if i not in known_bad:
            try:
                item = load(i)
            except Exception as e:  # any decoder error: the file is what's wrong, not the code
                known_bad[i] = bad_image_reason(e)
                found.append(i)
            else:
                for b in passed:
                    after[b] = i
                if passed and passed[0] not in found:  # the index itself, known bad before
                    found.insert(0, passed[0])
                return i, item, found
        if bad_images == "error":
            raise BadImageError(samples[i][0], known_bad[i])
        passed.append(i)
        nxt = after.get(i, (i + 1) % n)
        covered += (nxt - i) % n or n
        i = nxt
    raise BadImageError(samples[passed[0]][0], known_bad[passed[0]], NONE_READABLE)


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
