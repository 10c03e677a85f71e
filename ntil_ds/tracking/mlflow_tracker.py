"""MLflow behind the :class:`~ntil_ds.tracking.base.Tracker` interface: one run, sent by a thread.

Data flow: ``log_*`` appends a record to the journal (:mod:`ntil_ds.tracking.journal`) and wakes a
sender thread; the sender reads the journal from where it stopped and writes into the run through
:class:`~ntil_ds.tracking.mlflow_client.RunWriter`. When the store is unreachable the sender warns
once, backs off (1 s doubling to 60 s) and retries; training never waits on the network. ``finish``
makes one last attempt and, if the store is still away, says how to import the rest
(:mod:`ntil_ds.tracking.mlflow_import`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from ntil_ds.tracking.base import TrackingError
from ntil_ds.tracking.journal import (
    JOURNAL_NAME,
    JournalWriter,
    now_ms,
    read_records,
    read_sent_offset,
    session_runs,
    write_sent_offset,
)
from ntil_ds.tracking.mlflow_client import (
    RunWriter,
    bound_http_retries,
    create_run,
    existing_run,
    local_artifact_location,
    reopen_run,
    ui_hint,
)
from ntil_ds.tracking.mlflow_system import SAMPLE_INTERVAL_S, SystemSampler
from ntil_ds.tracking.plots import plot_run_history

logger = logging.getLogger(__name__)

_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 60.0
_RECORDS_PER_SEND = 2000  # journal records read into memory at a time (bounded however long the outage)
_PLOT_ARTIFACT_DIR = "plots"
_SENDER_THREAD = "ntil-ds-mlflow"


class _DropSenderThreadRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _SENDER_THREAD


def _quiet_sender_retries() -> None:
    """urllib3 warns at every failed connection attempt; the sender's are reported once, by the tracker.

    Only records made in the sender thread are dropped: other HTTP users in the job still warn.
    """
    pool_logger = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _DropSenderThreadRecords) for f in pool_logger.filters):
        pool_logger.addFilter(_DropSenderThreadRecords())


class MlflowTracker:
    """One MLflow run, logged from the main rank through the journal and a sender thread."""

    def __init__(
        self,
        *,
        uri: str,
        experiment: str,
        run_name: str,
        output_dir: Path,
        run_id: str | None,
        tags: dict[str, str],
        required: bool,
        system_metrics: bool,
        system_sample_s: float = SAMPLE_INTERVAL_S,
    ) -> None:
        bound_http_retries()
        self.uri = uri
        self.output_dir = Path(output_dir)
        self._journal = JournalWriter(self.output_dir / JOURNAL_NAME)
        self._bad_lines: list[int] = []  # offsets of corrupt journal lines skipped (reported once each)
        self._bad_lines_reported = 0
        self._lost_records = 0  # records the journal could not take (a full disk)
        # Records before the marker were handled by earlier jobs; the rest of an earlier job of this
        # run (killed before its sender caught up) is sent first.
        self._offset = min(read_sent_offset(self._journal.path), self._journal.start_offset)
        self._session_run = session_runs(self._journal.path)
        self._start = {
            "experiment": experiment,
            "run_name": run_name,
            "tags": tags,
            "run_id": run_id,
            "artifact_location": local_artifact_location(uri),
        }
        self._append("start", **self._start)
        self._run_id = run_id
        self._writer: RunWriter | None = None
        self._down = False
        self._warned = False
        self._finished = False
        self._last_step: int | None = None  # newest training step logged (system metrics use it)
        self._wake = threading.Event()
        self._closing = False
        self._system = SystemSampler(system_sample_s) if system_metrics else None
        # Every request to the store is made by the sender thread, the first one (open or create the
        # run) while the constructor waits: the run id is known right away when the store answers.
        self._required = required
        self._start_error: Exception | None = None
        self._started = threading.Event()
        _quiet_sender_retries()
        self._thread = threading.Thread(target=self._send_loop, name=_SENDER_THREAD, daemon=True)
        self._thread.start()
        # Waited for, whatever it takes (bounded by mlflow_client's HTTP policy): the trainer saves the run id
        # in its checkpoints, and without it a resumed job could not continue the run.
        self._started.wait()
        if self._start_error is not None and required:
            self._journal.close()
            raise TrackingError(
                f"tracking.required is true but the MLflow store {uri!r} cannot be used: "
                f"{self._start_error}. Start the tracking server or fix tracking.uri / "
                "MLFLOW_TRACKING_URI, or set tracking.required=false to train anyway (records are then "
                f"kept in {self._journal.path} and sent when the store is back)."
            ) from self._start_error
        if self._run_id is not None:
            logger.info("MLflow run %s in %s (%s)", self._run_id, uri, ui_hint(uri))

    # ---- the Tracker interface (training thread) ----------------------------------------------------

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def log_params(self, flat_params: dict[str, Any]) -> None:
        self._record("params", params={key: str(value) for key, value in flat_params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._last_step = step
        self._record(
            "metrics", step=int(step), time=now_ms(), values={k: float(v) for k, v in metrics.items()}
        )

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._record("artifact", path=str(Path(path).resolve()), artifact_path=artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """Never raises: the training is over whatever happens to its tracking (a job that trained
        must not exit as failed because the store or the disk misbehaved at the end)."""
        if self._finished:
            return
        try:
            self._finish(status)
        except Exception as e:
            logger.error(
                "tracking did not finish cleanly (%s: %s); the training is not affected. What was recorded "
                "is in %s; import it with: python -m ntil_ds.tracking import %s --uri %s",
                type(e).__name__, e, self._journal.path, self._journal.path, self.uri,
            )  # fmt: skip

    def _finish(self, status: str) -> None:
        try:
            for png in plot_run_history(self._history(), self._journal.path.parent / "plots"):
                self.log_artifact(png, _PLOT_ARTIFACT_DIR)
        except Exception as e:  # a plot is worth a warning, never a failed job
            logger.warning("could not draw the run's plots: %s", e)
        self._record("end", status=status, time=now_ms())
        self._finished = True
        self._closing = True
        self._wake.set()
        # Bounded: each request is bounded by the HTTP timeout, and a failure ends the last attempt.
        self._thread.join()
        self._journal.close()
        unsent = sum(
            1
            for _, record in read_records(self._journal.path, self._offset, self._bad_lines)
            if self._belongs(record)
        )
        self._report_bad_lines()
        if self._lost_records:
            logger.warning(
                "%d tracking records of this job could not be written to %s (see the error above) and "
                "are lost", self._lost_records, self._journal.path,
            )  # fmt: skip
        if unsent:
            logger.warning(
                "%d tracking records of this job (run %s) did not reach %s; they are in %s. Import them "
                "when the store is back: python -m ntil_ds.tracking import %s --uri %s",
                unsent, self._run_id or "not created yet", self.uri, self._journal.path, self._journal.path, self.uri,
            )  # fmt: skip

    # ---- internals ---------------------------------------------------------------------------------

    def _record(self, kind: str, **fields: Any) -> None:
        if self._finished:
            raise RuntimeError(f"tracker.{kind} after finish(): the run has ended")
        if self._append(kind, **fields):
            self._wake.set()

    def _append(self, kind: str, **fields: Any) -> bool:
        """Journal one record (training or sender thread). A full disk loses it, counted and reported:
        training goes on."""
        try:
            self._journal.append(kind, **fields)
            return True
        except OSError as e:
            self._lost_records += 1
            if self._lost_records == 1:
                logger.error(
                    "cannot write the tracking journal %s (%s): this %s record and any further ones that "
                    "fail are lost (counted at the end of the job); training goes on",
                    self._journal.path, e, kind,
                )  # fmt: skip
            return False

    def _report_bad_lines(self) -> None:
        """One warning per corrupt journal line found (each is skipped, never sent)."""
        new = self._bad_lines[self._bad_lines_reported :]
        if new:
            logger.warning(
                "%s: %d corrupt line(s) skipped (not JSON records; at byte offsets %s)",
                self._journal.path, len(new), ", ".join(map(str, new[:10])),
            )  # fmt: skip
            self._bad_lines_reported = len(self._bad_lines)

    def _connect(self) -> None:
        client = MlflowClient(tracking_uri=self.uri)
        tags = self._start["tags"]
        run = existing_run(client, self._run_id)
        if run is not None:
            reopen_run(client, run, tags)
            self._writer = RunWriter(client, run.info.run_id, fresh=False)
        else:
            if self._run_id is not None:
                logger.warning("run %s is not in %s: starting a new run", self._run_id, self.uri)
            run_id = create_run(client, self._start, tags)
            self._writer = RunWriter(client, run_id, fresh=True)
        self._run_id = self._writer.run_id
        self._append("run", run_id=self._run_id)

    def _send_loop(self) -> None:
        retry_s = _RETRY_FIRST_S
        next_try = 0.0
        try:
            self._connect()
        except Exception as e:
            self._start_error = e
        self._started.set()
        if self._start_error is not None:
            if self._required:
                return  # the constructor raises
            self._mark_down(self._start_error)
            next_try = time.monotonic() + retry_s
        while True:
            timeout = self._system.interval_s if self._system is not None else None
            if self._down:
                wait_retry = max(0.0, next_try - time.monotonic())
                timeout = wait_retry if timeout is None else min(timeout, wait_retry)
            self._wake.wait(timeout)
            self._wake.clear()
            closing = self._closing  # read once: records made before it was set are in the journal
            try:
                self._sample_system(final=closing)
            except Exception as e:  # a sampler fault must not stop the sender
                logger.warning("system metrics stopped: %s", e)
                self._system = None
            if self._down and not closing and time.monotonic() < next_try:
                continue
            try:
                self._drain()
            except Exception as e:
                self._mark_down(e)
                next_try = time.monotonic() + retry_s
                retry_s = min(2 * retry_s, _RETRY_MAX_S)
                if closing:
                    return
                continue
            if self._down:
                self._down = False
                retry_s = _RETRY_FIRST_S
                logger.info(
                    "MLflow store %s is reachable again; the backlog was sent to run %s",
                    self.uri,
                    self._run_id,
                )
            if closing:
                return

    def _drain(self) -> None:
        if self._writer is None:
            self._connect()
        while True:
            chunk, chunk_end = [], self._offset
            for end, record in read_records(self._journal.path, self._offset, self._bad_lines):
                chunk_end = end
                if self._belongs(record):
                    chunk.append(record)
                    if len(chunk) == _RECORDS_PER_SEND:
                        break
            self._report_bad_lines()
            if chunk:
                self._writer.send(chunk)
            if chunk_end == self._offset:
                return
            self._offset = chunk_end
            write_sent_offset(self._journal.path, chunk_end)

    def _belongs(self, record: dict[str, Any]) -> bool:
        """Is the record one to send into this job's run: this session's, or an earlier job's of the run."""
        session = record["session"]
        if record["kind"] in ("start", "run"):
            self._session_run[session] = record["run_id"] or self._session_run.get(session)
            return False
        if session == self._journal.session:
            return True
        # An earlier job's "end" ended the run before this job reopened it: not replayed.
        return (
            record["kind"] != "end"
            and self._run_id is not None
            and self._session_run.get(session) == self._run_id
        )

    def _mark_down(self, error: Exception) -> None:
        """One warning per job, when the store is first lost: a flapping server must not flood the log."""
        if not self._down and not self._warned:
            logger.warning(
                "MLflow store %s is unreachable (%s). Training goes on; tracking records are kept in %s "
                "and sent when the store is back (retried every %.0f-%.0f s).",
                self.uri, error, self._journal.path, _RETRY_FIRST_S, _RETRY_MAX_S,
            )  # fmt: skip
            self._warned = True
        elif not self._down:
            logger.info("MLflow store %s is unreachable again (%s); records are kept", self.uri, error)
        else:
            logger.debug("MLflow store %s still unreachable: %s", self.uri, error)
        self._down = True

    def _sample_system(self, final: bool) -> None:
        """Journal the system metrics' mean at the newest training step, once per step."""
        if self._system is None:
            return
        step = self._last_step  # read once: the training thread moves it on
        values = self._system.sample(step, final)
        if values:
            self._append("metrics", step=step, time=now_ms(), values=values)

    def _history(self) -> dict[str, dict[int, float]]:
        """Every metric of this run in the journal (earlier jobs of a resumed run too), first value per step."""
        sessions = {self._journal.session}
        history: dict[str, dict[int, float]] = {}
        for _, record in read_records(self._journal.path):
            if record["kind"] in ("start", "run") and self._run_id and record["run_id"] == self._run_id:
                sessions.add(record["session"])
            if record["kind"] == "metrics" and record["session"] in sessions:
                for key, value in record["values"].items():
                    history.setdefault(key, {}).setdefault(record["step"], value)
        return history
