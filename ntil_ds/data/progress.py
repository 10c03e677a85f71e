"""Progress bars that suit a terminal and a log file alike.

On a terminal a tqdm bar redraws in place as usual. Written to a file (a SLURM ``.out``, a pipe), every
redraw would be one more line of the log, so there the bar prints one plain line at most every
``LOG_INTERVAL_S`` seconds, and its last state when it closes: a job that encodes a million lines or
trains 100,000 steps leaves a readable log, with rate and time left in each line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import IO, Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


def progress(
    iterable: Iterable | None = None,
    *,
    file: IO[str] | None = None,
    interval: float = LOG_INTERVAL_S,
    **kwargs: Any,
) -> tqdm:
    """A tqdm bar on `file` (default: stderr); where `file` is not a terminal, at most one line per
    `interval` seconds (plus the first and the last)."""
    file = sys.stderr if file is None else file
    if _is_terminal(file):
        return tqdm(iterable, file=file, **kwargs)
    # mininterval/maxinterval: tqdm formats no redraw in between (its monitor thread forces one only after
    # maxinterval); the wrapper holds the line count to its bound whatever tqdm redraws (a close, a write).
    kwargs.update(mininterval=interval, maxinterval=interval)
    return tqdm(iterable, file=_LogLines(file, interval), **kwargs)


def _is_terminal(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class _LogLines:
    """A file for tqdm that turns its carriage-return redraws into whole lines, at most one per `interval`
    seconds; the bar's last state is written when it closes (tqdm then writes a newline)."""

    def __init__(self, file: IO[str], interval: float) -> None:
        self.file, self.interval = file, interval
        self.pending = ""  # the latest redraw not written yet
        self.last_written: float | None = None

    def write(self, text: str) -> None:
        closing = text.endswith("\n")
        shown = text.replace("\r", "").strip()
        if shown:
            self.pending = shown
        now = time.monotonic()
        due = self.last_written is None or now - self.last_written >= self.interval
        if self.pending and (due or closing):
            self.file.write(self.pending + "\n")
            self.file.flush()
            self.pending, self.last_written = "", now

    def flush(self) -> None:
        self.file.flush()
