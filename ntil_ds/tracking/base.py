"""The tracking interface the trainer calls, and the tracker of ranks that do not track.

One MLflow run per training job: the main rank gets an
:class:`~ntil_ds.tracking.mlflow_tracker.MlflowTracker`, every other rank a :class:`NullTracker`, so
the trainer calls the same methods on every rank and never branches on rank to log.

This module imports nothing from the rest of ``tracking/``: every tracker builds on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


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
