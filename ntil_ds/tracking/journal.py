"""The local, append-only record of everything a job tracks: ``<output_dir>/tracking/journal.jsonl``.

Why a journal: the tracking server may be down when a record is made, and the job may be killed
(preemption) before the server comes back. Each record is a line of JSON written (and flushed) before
anything is sent; the sender thread reads the file from where it stopped, so memory stays bounded
however long an outage lasts, and whatever never reached the server is still on disk to import.

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
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        self._file = self.path.open("a", encoding="utf-8")
        # Where this session's records begin: earlier sessions (the job before a resume) are not resent.
        self.start_offset = self._file.tell()

    def append(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "session": self.session, **fields}, allow_nan=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: Path, offset: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """Complete records from byte ``offset`` on, each with the offset just after it.

    A last line without its newline (being written, or cut by a kill) is left for later.
    """
    with Path(path).open("rb") as f:
        f.seek(offset)
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            offset += len(raw)
            yield offset, json.loads(raw)


def session_runs(path: Path) -> dict[str, str | None]:
    """The run each session of the journal logged into (or resumed), None where it never had one."""
    runs: dict[str, str | None] = {}
    if not Path(path).exists():
        return runs
    with Path(path).open("rb") as f:
        for raw in f:
            # Only start/run records name runs; skip parsing the many metric lines.
            if raw.startswith(_RUN_RECORD_PREFIXES) and raw.endswith(b"\n"):
                record = json.loads(raw)
                runs[record["session"]] = record["run_id"] or runs.get(record["session"])
    return runs


def sent_marker(journal: Path) -> Path:
    return Path(journal).with_suffix(".sent")


def read_sent_offset(journal: Path) -> int:
    marker = sent_marker(journal)
    return int(marker.read_text()) if marker.exists() else 0


def write_sent_offset(journal: Path, offset: int) -> None:
    marker = sent_marker(journal)
    tmp = marker.with_suffix(".sent.tmp")
    tmp.write_text(str(offset))
    tmp.replace(marker)  # atomic: a kill leaves the old or the new offset, never half of one
