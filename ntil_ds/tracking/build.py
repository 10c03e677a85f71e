"""Which tracker a process gets, and where its runs go.

:func:`build_tracker` gives the main rank of a tracked job an MLflow tracker and every other process a
:class:`~ntil_ds.tracking.base.NullTracker`. The MLflow tracker is imported inside the function: mlflow
costs ~1.6 s to import, and only the main rank of a tracked job pays it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ntil_ds.config import TrackingConfig
from ntil_ds.tracking.base import NullTracker, Tracker


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

    Raises :class:`~ntil_ds.tracking.base.TrackingError` only when ``cfg.required`` and the store
    cannot be reached at start.
    """
    if not cfg.enabled or not is_main:
        return NullTracker()
    # mlflow costs ~1.6 s to import: only the main rank of a tracked job pays it.
    from ntil_ds.tracking.mlflow_tracker import MlflowTracker

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
