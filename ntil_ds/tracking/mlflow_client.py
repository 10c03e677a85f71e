"""The MLflow client side of tracking: the HTTP policy, the run a job logs into, and the writer.

:class:`RunWriter` writes journal records (:mod:`ntil_ds.tracking.journal`) into one MLflow run, one
value per metric key and step, so the live sender (:mod:`ntil_ds.tracking.mlflow_tracker`) and the
later import (:mod:`ntil_ds.tracking.mlflow_import`) send through the same code and a record the run
already has is never sent twice. A value the store rejects as wrong (HTTP 4xx) is reported and
skipped; any other fault is raised for the caller to retry later.

The run itself: :func:`experiment_id` gets or creates the experiment (safe when two jobs create it at
once), :func:`existing_run` / :func:`reopen_run` continue a resumed job's run, :func:`create_run`
starts a new one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH

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


def bound_http_retries() -> None:
    """Keep each MLflow request short (see ``_HTTP_POLICY``); call before the first request."""
    for name, value in _HTTP_POLICY.items():
        os.environ.setdefault(name, value)


def ui_hint(uri: str) -> str:
    """How a user looks at runs in ``uri``."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri} in a browser"
    return f"mlflow ui --backend-store-uri {uri}"


def local_artifact_location(uri: str) -> str | None:
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


def experiment_id(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The id of experiment ``name``, created if missing (two jobs creating it at once both get it)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another job created it just now
            raise
        return client.get_experiment_by_name(name).experiment_id


def existing_run(client: MlflowClient, run_id: str | None) -> Any:
    """The run ``run_id`` in the store; None when there is no id or the store has no such run."""
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None


def reopen_run(client: MlflowClient, run: Any, tags: dict[str, str]) -> None:
    """Continue a resumed job's run: status back to RUNNING, the tags of the job now running."""
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    # Tags describe the latest job (its SLURM id, node count, code version).
    tag_list = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(tag_list), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run.info.run_id, tags=tag_list[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)


def create_run(client: MlflowClient, start: dict[str, Any], tags: dict[str, str]) -> str:
    """A new run as a journal's ``start`` record describes it; returns its id."""
    experiment = experiment_id(client, start["experiment"], start["artifact_location"])
    run = client.create_run(experiment, run_name=start["run_name"], tags=tags)
    return run.info.run_id
