"""MLflow behind the :class:`~ntil_ds.tracking.tracker.Tracker` interface: the only module importing mlflow.

Data flow: ``log_*`` appends a record to the journal (:mod:`ntil_ds.tracking.journal`) and wakes a
sender thread; the sender reads the journal from where it stopped and writes into the run through
:class:`RunWriter`. When the store is unreachable the sender warns once, backs off (1 s doubling to
60 s) and retries; training never waits on the network. ``finish`` makes one last attempt and, if the
store is still away, says how to import the rest: :func:`import_journal` replays a journal through the
same :class:`RunWriter`, skipping what the run already has, so importing twice adds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

from ntil_ds.tracking.journal import (
    JOURNAL_NAME,
    JournalWriter,
    now_ms,
    read_records,
    read_sent_offset,
    session_runs,
    write_sent_offset,
)
from ntil_ds.tracking.plots import plot_run_history
from ntil_ds.tracking.tracker import TrackingError

logger = logging.getLogger(__name__)

# MLflow reads its HTTP retry policy from these variables at every request and offers no per-client
# setting. Its defaults (7 retries, backoff factor 2, 120 s timeout) hold a request for minutes
# against a dead server; our sender retries on its own schedule, so each request is kept short.
# setdefault: a value the user exported wins.
_HTTP_POLICY = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    # Per connect / per read, not per upload: a large artifact streams for as long as it needs.
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 60.0
_SYSTEM_SAMPLE_S = 10.0
_RECORDS_PER_SEND = 2000  # journal records read into memory at a time (bounded however long the outage)
_PLOT_ARTIFACT_DIR = "plots"
_SENDER_THREAD = "ntil-ds-mlflow"


def bound_http_retries() -> None:
    for name, value in _HTTP_POLICY.items():
        os.environ.setdefault(name, value)


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


def ui_hint(uri: str) -> str:
    """How a user looks at runs in ``uri``."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {uri}"


def _local_artifact_location(uri: str) -> str | None:
    """Artifacts of a local sqlite store go next to the database file.

    MLflow's default for a sqlite store is ``./mlruns`` in the current directory, which scatters
    artifacts over wherever jobs were started and makes MLflow's own default URI switch to that folder.
    """
    prefix = "sqlite:///"  # SQLAlchemy: the path follows; relative, or absolute with a fourth slash
    if not uri.startswith(prefix):
        return None
    database = Path(uri[len(prefix) :].split("?", 1)[0])
    return (database.parent / "mlartifacts").resolve().as_uri()


def _is_permanent(error: Exception) -> bool:
    """A request the store rejected as wrong (4xx): retrying cannot help. Anything else may pass later."""
    if not isinstance(error, MlflowException):
        return False
    status = error.get_http_status_code()
    return 400 <= status < 500 and status != 429


class RunWriter:
    """Writes journal records into one MLflow run, one value per metric key and step.

    The steps the run already has are read from the store first (``fresh=False``): after a resume the
    job re-does the steps between its checkpoint and the crash, and those must not appear twice.
    """

    def __init__(self, client: MlflowClient, run_id: str, *, fresh: bool) -> None:
        self.client = client
        self.run_id = run_id
        # Newest step the run holds per metric key; None: not known (ask the store before sending).
        self._last_step: dict[str, int] | None = {} if fresh else None
        self._params: dict[str, str] | None = {} if fresh else None
        self.sent_metrics = 0
        self.repeated_metrics = 0

    def send(self, records: Iterable[dict[str, Any]]) -> None:
        """Send ``records`` in order; raises what the store raised (the caller retries later)."""
        try:
            pending: list[Metric] = []
            for record in records:
                if record["kind"] == "metrics":
                    pending.extend(self._new_metrics(record))
                    continue
                self._send_metrics(pending)
                pending = []
                if record["kind"] == "params":
                    self._send_params(record["params"])
                elif record["kind"] == "artifact":
                    self._send_artifact(Path(record["path"]), record["artifact_path"])
                elif record["kind"] == "end":
                    self.client.set_terminated(self.run_id, record["status"], end_time=record["time"])
            self._send_metrics(pending)
        except Exception:
            # Part of a batch may have reached the store before the fault: re-read what it has.
            self._last_step = None
            self._params = None
            raise

    def _new_metrics(self, record: dict[str, Any]) -> list[Metric]:
        if self._last_step is None:
            self._last_step = self._read_last_steps()
        step = record["step"]
        new = []
        for key, value in record["values"].items():
            if step <= self._last_step.get(key, -1):
                self.repeated_metrics += 1
                continue
            self._last_step[key] = step
            new.append(Metric(key, value, record["time"], step))
        return new

    def _read_last_steps(self) -> dict[str, int]:
        keys = self.client.get_run(self.run_id).data.metrics
        return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key)) for key in keys}

    def _send_metrics(self, metrics: list[Metric]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            batch = metrics[i : i + MAX_METRICS_PER_BATCH]
            self._rejectable(
                lambda batch=batch: self.client.log_batch(self.run_id, metrics=batch, synchronous=True),
                f"{len(batch)} metrics",
            )
            self.sent_metrics += len(batch)

    def _send_params(self, params: dict[str, str]) -> None:
        if self._params is None:
            self._params = dict(self.client.get_run(self.run_id).data.params)
        changed = {
            k: (self._params[k], v) for k, v in params.items() if k in self._params and self._params[k] != v
        }
        if changed:
            # MLflow params cannot change; the job's own resolved config is in its artifacts.
            listing = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
            logger.warning(
                "MLflow params are immutable; run %s keeps its first values for %s", self.run_id, listing
            )
        new = [Param(k, v) for k, v in params.items() if k not in self._params]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            batch = new[i : i + MAX_PARAMS_TAGS_PER_BATCH]
            self._rejectable(
                lambda batch=batch: self.client.log_batch(self.run_id, params=batch, synchronous=True),
                f"{len(batch)} params",
            )
        self._params.update({p.key: p.value for p in new})

    def _send_artifact(self, path: Path, artifact_path: str | None) -> None:
        if not path.exists():
            logger.warning("artifact %s no longer exists: not logged to run %s", path, self.run_id)
        elif path.is_dir():
            self._rejectable(
                lambda: self.client.log_artifacts(self.run_id, str(path), artifact_path), str(path)
            )
        else:
            self._rejectable(
                lambda: self.client.log_artifact(self.run_id, str(path), artifact_path), str(path)
            )

    def _rejectable(self, request: Any, what: str) -> None:
        """Run ``request``; a store's "this is wrong" answer is reported and skipped, not retried forever."""
        try:
            request()
        except MlflowException as e:
            if not _is_permanent(e):
                raise
            logger.warning("MLflow rejected %s for run %s: %s", what, self.run_id, e.message)


def _system_monitors() -> list[BaseMetricsMonitor]:
    """MLflow's samplers (CPU, memory, disk, network; GPU when NVML answers), without its logging
    thread: that one stops at the first failed request, ours go through the journal."""
    monitors: list[BaseMetricsMonitor] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    with contextlib.suppress(ImportError, RuntimeError):  # no NVIDIA GPU or no pynvml
        monitors.append(GPUMonitor())
    return monitors


def _experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another job created it just now
            raise
        return client.get_experiment_by_name(name).experiment_id


def _existing_run(client: MlflowClient, run_id: str | None) -> Any:
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None


def _reopen(client: MlflowClient, run: Any, tags: dict[str, str]) -> None:
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    # Tags describe the latest job (its SLURM id, node count, code version).
    tag_list = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(tag_list), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run.info.run_id, tags=tag_list[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)


def _create_run(client: MlflowClient, start: dict[str, Any], tags: dict[str, str]) -> str:
    experiment_id = _experiment_id(client, start["experiment"], start["artifact_location"])
    run = client.create_run(experiment_id, run_name=start["run_name"], tags=tags)
    return run.info.run_id


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
        system_sample_s: float = _SYSTEM_SAMPLE_S,
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
            "artifact_location": _local_artifact_location(uri),
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
        self._system = _system_monitors() if system_metrics else None
        self._system_sample_s = system_sample_s
        self._system_sampled_at = -math.inf
        self._system_step: int | None = None  # the training step of the last system sample logged
        # Every request to the store is made by the sender thread, the first one (open or create the
        # run) while the constructor waits: the run id is known right away when the store answers.
        self._required = required
        self._start_error: Exception | None = None
        self._started = threading.Event()
        _quiet_sender_retries()
        self._thread = threading.Thread(target=self._send_loop, name=_SENDER_THREAD, daemon=True)
        self._thread.start()
        # Waited for, whatever it takes (bounded by the HTTP policy above): the trainer saves the run id
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
        run = _existing_run(client, self._run_id)
        if run is not None:
            _reopen(client, run, tags)
            self._writer = RunWriter(client, run.info.run_id, fresh=False)
        else:
            if self._run_id is not None:
                logger.warning("run %s is not in %s: starting a new run", self._run_id, self.uri)
            run_id = _create_run(client, self._start, tags)
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
            timeout = self._system_sample_s if self._system is not None else None
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
        """Sample every ``system_sample_s``; log the samples' mean at the training step, once per step."""
        if self._system is None:
            return
        now = time.monotonic()
        if final or now - self._system_sampled_at >= self._system_sample_s:
            for monitor in self._system:
                monitor.collect_metrics()
            self._system_sampled_at = now
        step = self._last_step
        if step is None or (self._system_step is not None and step <= self._system_step):
            return
        values = {}
        for monitor in self._system:
            values.update(
                {f"system/{k}": v for k, v in monitor.aggregate_metrics().items() if math.isfinite(v)}
            )
            monitor.clear_metrics()
        if values:
            self._system_step = step
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


# ----------------------------------------------------------------------------------------------------
# Import of a journal into a store (python -m ntil_ds.tracking import)


def import_journal(journal: Path, uri: str) -> list[tuple[str, RunWriter]]:
    """Replay every session of ``journal`` into ``uri``; returns ``(session, writer)`` per session.

    A session logs into the run it used when that run exists in ``uri``, else into the run an earlier
    import made for it (tag ``ntil_ds.journal_run``), else into a new run. Steps, params and the end
    status the run already has are skipped, so an import can be repeated.
    """
    bound_http_retries()
    client = MlflowClient(tracking_uri=uri)
    sessions: dict[str, list[dict[str, Any]]] = {}
    bad_lines: list[int] = []
    for _, record in read_records(journal, bad_lines=bad_lines):
        sessions.setdefault(record["session"], []).append(record)
    if bad_lines:
        logger.warning(
            "%s: %d corrupt line(s) skipped, at byte offsets %s", journal, len(bad_lines), bad_lines[:10]
        )
    done = []
    for session, records in sessions.items():
        content = [r for r in records if r["kind"] not in ("start", "run")]
        if not content:  # a job that stopped before logging anything
            continue
        start = next(r for r in records if r["kind"] == "start")
        used = [r["run_id"] for r in records if r["kind"] == "run"]
        # Which run the session belongs to, stable across sessions (a resumed job names its run).
        lineage = start["run_id"] or (used[0] if used else session)
        run = _existing_run(client, used[0] if used else start["run_id"])
        if run is None:
            experiment_id = _experiment_id(client, start["experiment"], _local_artifact_location(uri))
            found = client.search_runs(
                [experiment_id], filter_string=f"tags.`ntil_ds.journal_run` = '{lineage}'", max_results=1
            )
            run_id = (
                found[0].info.run_id
                if found
                else _create_run(client, {**start, "artifact_location": _local_artifact_location(uri)},
                                 {**start["tags"], "ntil_ds.journal_run": lineage})
            )  # fmt: skip
        else:
            run_id = run.info.run_id
        writer = RunWriter(client, run_id, fresh=False)
        writer.send(content)
        done.append((session, writer))
    return done
