"""The local, append-only record of everything a job tracks: ``<output_dir>/tracking/journal.jsonl``.

Why a journal: the tracking server may be down when a record is made, and the job may be killed
(preemption) before the server comes back. Each record is a line of JSON written (and flushed) before
anything is sent; the sender thread reads the file from where it stopped, so memory stays bounded
however long an outage lasts, and whatever never reached the server is still on disk to import.

A job killed, or a disk that fills up, in the middle of a write leaves a torn last line. The writer
cuts it off when it opens the journal (one warning, counted in :attr:`JournalWriter.torn_lines_cut`)
and, if a write fails, cuts what part of the record reached the disk, so a new record never joins a
fragment. Readers skip a complete line that is not a record (corruption) and report its offset.

Next to it, ``journal.sent`` holds the byte offset up to which records were handled (sent, or not
this run's): a resumed job starts there and first sends what its killed predecessor could not.

Records (``kind`` first), all with the ``session`` (one per process that opened the journal):

- ``start``: experiment, run_name, tags, run_id (the run resumed, or null), artifact_location
- ``run``: run_id (the run this session logs into, once the store created or reopened it)
- ``params``: params ``{name: str}``
- ``metrics``: step, time (ms since the epoch), values ``{key: float}``
- ``artifact``: path (absolute), artifact_path
- ``end``: status, time
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOURNAL_NAME = "tracking/journal.jsonl"
_RUN_RECORD_PREFIXES = (b'{"kind": "start"', b'{"kind": "run"')


def now_ms() -> int:
    return int(time.time() * 1000)


class JournalWriter:
    """Appends records for one session; safe to call from the training and the sender thread."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.session = uuid.uuid4().hex
        self._lock = threading.Lock()
        self.torn_lines_cut = cut_torn_last_line(self.path)
        # Unbuffered: a write that fails leaves nothing in a buffer to be written again later.
        self._file = self.path.open("ab", buffering=0)
        # Where this session's records begin: earlier sessions (the job before a resume) are not resent.
        self.start_offset = self._file.tell()

    def append(self, kind: str, **fields: Any) -> None:
        """Write one record. Raises OSError (a full disk) with the journal as it was before the call."""
        line = json.dumps({"kind": kind, "session": self.session, **fields}, allow_nan=True)
        data = (line + "\n").encode("utf-8")
        with self._lock:
            start = self._file.tell()
            try:
                written = 0
                while written < len(data):
                    written += self._file.write(data[written:])
            except OSError:
                # Part of the line may be on disk: cut it, or the next record would join the fragment.
                os.ftruncate(self._file.fileno(), start)
                self._file.seek(start)
                raise

    def close(self) -> None:
        with self._lock:
            self._file.close()


def cut_torn_last_line(path: Path) -> int:
    """Cut a last line that has no newline (its writer was killed, or the disk filled up): 1 if one was
    cut, else 0. Call only where no other process writes the journal (the tracker of the job's rank 0)."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Find the newline that ends the last complete record, reading backwards in blocks.
        end = size
        keep = 0
        while end > 0:
            begin = max(0, end - 65536)
            f.seek(begin)
            newline = f.read(end - begin).rfind(b"\n")
            if newline >= 0:
                keep = begin + newline + 1
                break
            end = begin
        f.truncate(keep)
    log.warning(
        "%s ended in a torn record (%d bytes without a newline: a job died, or the disk filled up, while "
        "writing it); it was cut off and is not sent",
        path, size - keep,
    )  # fmt: skip
    return 1


def read_records(
    path: Path, offset: int = 0, bad_lines: list[int] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Complete records from byte ``offset`` on, each with the offset just after it.

    A last line without its newline (being written, or cut by a kill) is left for later. A complete
    line that is not a JSON record is skipped; its offset is appended to ``bad_lines`` when given.
    """
    with Path(path).open("rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            start, offset = offset, offset + len(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "kind" not in record or "session" not in record:
                if bad_lines is not None:
                    bad_lines.append(start)
                continue
            yield offset, record


def session_runs(path: Path) -> dict[str, str | None]:
    """The run each session of the journal logged into (or resumed), None where it never had one."""
    runs: dict[str, str | None] = {}
    if not Path(path).exists():
        return runs
    with Path(path).open("rb") as f:
        for raw in f:
            # Only start/run records name runs; skip parsing the many metric lines.
            if raw.startswith(_RUN_RECORD_PREFIXES) and raw.endswith(b"\n"):
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue  # a corrupt line: read_records skips and reports it
                runs[record["session"]] = record["run_id"] or runs.get(record["session"])
    return runs


def sent_marker(journal: Path) -> Path:
    return Path(journal).with_suffix(".sent")


def read_sent_offset(journal: Path) -> int:
    """Where earlier jobs stopped sending; 0 (send everything again: the store drops repeated steps)
    when the marker is missing or unreadable."""
    marker = sent_marker(journal)
    if not marker.exists():
        return 0
    try:
        return int(marker.read_text())
    except ValueError:
        log.warning("%s is not a byte offset: the journal is sent again from its start", marker)
        return 0


def write_sent_offset(journal: Path, offset: int) -> None:
    marker = sent_marker(journal)
    tmp = marker.with_suffix(".sent.tmp")
    tmp.write_text(str(offset))
    tmp.replace(marker)  # atomic: a kill leaves the old or the new offset, never half of one
