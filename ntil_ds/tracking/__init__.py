"""Experiment tracking: one MLflow run per training job, logged from the main rank only.

The trainer calls::

    tracker = build_tracker(cfg.tracking, is_main=dist.is_main, output_dir=out, run_id=ckpt_run_id,
                            tags=default_tags(dist, cfg.model.name_or_path, os.environ))
    tracker.log_params(flatten(cfg)); tracker.log_metrics({...}, step); tracker.log_artifact(path)
    tracker.finish("FINISHED")

Every record is first appended to a local journal (``<output_dir>/tracking/journal.jsonl``) and sent
to MLflow by a background thread, so a slow or dead tracking server never stalls training; what could
not be sent is imported later with ``python -m ntil_ds.tracking import``. See docs/tracking.md.

The modules, one job each: ``base`` (the Tracker protocol, NullTracker, TrackingError), ``build``
(which tracker a process gets, where runs go), ``journal`` (the local record), ``mlflow_tracker``
(the MLflow run and its sender thread), ``mlflow_client`` (requests to the store, RunWriter),
``mlflow_system`` (system metrics), ``mlflow_import`` (a journal into a store, after the job),
``tags`` and ``plots``. Only the ``mlflow_*`` modules import mlflow; ``build`` and the import command
import them lazily (``build`` on the main rank of a tracked job only).
"""

from ntil_ds.tracking.base import NullTracker, Tracker, TrackingError
from ntil_ds.tracking.build import build_tracker, resolve_tracking_uri
from ntil_ds.tracking.tags import default_tags

__all__ = [
    "NullTracker",
    "Tracker",
    "TrackingError",
    "build_tracker",
    "default_tags",
    "resolve_tracking_uri",
]
