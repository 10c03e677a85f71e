"""The tracking interface the trainer calls, and the choice of implementation.

One MLflow run per training job: the main rank gets an :class:`~ntil_ds.tracking.mlflow_store.MlflowTracker`,
every other rank a :class:`NullTracker`, so the trainer calls the same methods on every rank and never
branches on rank to log.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from ntil_ds.config import TrackingConfig


class TrackingError(RuntimeError):
    """Tracking cannot start although the recipe says ``tracking.required: true``."""


class Tracker(Protocol):
    """What the trainer logs. Implementations never raise on a tracking-server fault mid-run."""

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (store it in checkpoints); None on non-main ranks or before the run exists."""
        ...

    def log_params(self, flat_params: dict[str, Any]) -> None:
        """Log the flattened resolved config (:func:`ntil_ds.config.flatten`)."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log scalar metrics at an optimizer step. One value per key and step: a step the run already
        has for a key (re-done after a resume) is not logged again."""
        ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder into the run (under ``artifact_path`` if given)."""
        ...

    def finish(self, status: str = "FINISHED") -> None:
        """Log the plots, flush everything, end the run with ``FINISHED``, ``FAILED`` or ``KILLED``."""
        ...


class NullTracker:
    """The tracker of non-main ranks and of runs with ``tracking.enabled: false``: does nothing."""

    run_id: str | None = None

    def log_params(self, flat_params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


def resolve_tracking_uri(configured: str, output_dir: Path, env_uri: str | None) -> str:
    """Where runs go: ``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else an embedded sqlite store.

    The embedded store is ``sqlite:///<output_dir>/mlflow.db`` with an absolute path, so the job's
    working directory does not matter (MLflow's own default, ``./mlflow.db`` or ``./mlruns``, does).
    """
    if configured:
        return configured
    if env_uri:
        return env_uri
    return f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}"


def build_tracker(
    cfg: TrackingConfig,
    *,
    is_main: bool,
    output_dir: Path,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> Tracker:
    """The tracker for this process.

    ``run_id`` comes from the checkpoint on resume: the job continues that run. ``tags`` are added to
    (and override) :func:`ntil_ds.tracking.tags.default_tags`-style tags the caller gathered; the run
    name is ``cfg.run_name`` or, if empty, the output folder's name.

    Raises :class:`TrackingError` only when ``cfg.required`` and the store cannot be reached at start.
    """
    if not cfg.enabled or not is_main:
        return NullTracker()
    # mlflow costs ~1.6 s to import: only the main rank of a tracked job pays it.
    from ntil_ds.tracking.mlflow_store import MlflowTracker

    output_dir = Path(output_dir)
    # The one place the library reads MLFLOW_TRACKING_URI (the documented fallback for tracking.uri);
    # every MLflow client below gets the resolved URI explicitly.
    uri = resolve_tracking_uri(cfg.uri, output_dir, os.environ.get("MLFLOW_TRACKING_URI"))
    return MlflowTracker(
        uri=uri,
        experiment=cfg.experiment,
        run_name=cfg.run_name or f"{output_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}",
        output_dir=output_dir,
        run_id=run_id,
        tags=dict(tags or {}),
        required=cfg.required,
        system_metrics=cfg.system_metrics,
    )
