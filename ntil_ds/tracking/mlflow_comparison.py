"""A comparison in MLflow: one parent run for the grid, every training job's own run made its child,
with the job's test scores logged into it and the grid's summary into the parent."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from ntil_ds.tracking.mlflow_client import experiment_id, local_artifact_location
from ntil_ds.tracking.step_log import metric_key


class ComparisonRuns:
    def __init__(
        self, uri: str, experiment: str, name: str, params: dict[str, str], parent_run_id: str | None = None
    ) -> None:
        """``parent_run_id``: the parent run of an earlier invocation of the same grid (started again),
        reused when the store still has it."""
        self.client = MlflowClient(uri)
        # As the jobs' trackers do: tagged as model training, artifacts of a sqlite store next to it.
        self.experiment_id = experiment_id(self.client, experiment, local_artifact_location(uri))
        earlier = parent_run_id and self.client.search_runs(
            [self.experiment_id], filter_string=f"attributes.run_id = '{parent_run_id}'", max_results=1
        )
        if earlier:
            self.parent = parent_run_id
            self.client.update_run(self.parent, "RUNNING")
            return
        self.parent = self.client.create_run(
            self.experiment_id, run_name=name, tags={"ntil_ds.comparison": "parent"}
        ).info.run_id
        for key, value in params.items():
            self.client.log_param(self.parent, key, value[:6000])

    def adopt(self, run: Any, run_name: str, split: str = "test") -> None:
        """Make the training job's run (``run``: a comparison RunResult) a child of the comparison (or
        record one for a job that never created its run), and log its scores into it as ``split``/...
        (``val`` for an lr selection run, scored on validation)."""
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"attributes.run_name = '{run_name}'", max_results=1
        )
        if found:
            run.mlflow_run_id = found[0].info.run_id
        else:  # failed before its tracker started (a bad config, a crash at start), or trained into
            # another store (a grid started again elsewhere from its records): still a child
            run.mlflow_run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
            self.client.set_terminated(run.mlflow_run_id, "FINISHED" if run.status == "ok" else "FAILED")
        child = run.mlflow_run_id
        self.client.set_tag(child, "mlflow.parentRunId", self.parent)
        self.client.set_tag(child, "ntil_ds.comparison.loss", run.label)
        self.client.set_tag(child, "ntil_ds.comparison.seed", str(run.seed))
        self.client.set_tag(child, "ntil_ds.comparison.status", run.status)
        if run.error:
            self.client.set_tag(child, "ntil_ds.comparison.error", run.error[-4000:])
        for prefix, scores in ((split, run.metrics), (f"{split}_shuffled", getattr(run, "shuffled", {}))):
            for name, value in scores.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.client.log_metric(child, metric_key(f"{prefix}/{name}"), float(value))

    def finish(
        self, summary: dict, artifacts: list[Path], any_failed: bool, extra_metrics: dict | None = None
    ) -> None:
        """The summary (``{label usable in a key: {metric: {"mean", "std"}}}``), ``extra_metrics`` (the
        paired statistics, flat) and the grid's files into the parent run, which then ends."""
        for key, value in (extra_metrics or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.client.log_metric(self.parent, metric_key(key), float(value))
        for label, stats in summary.items():
            for name, s in stats.items():
                for what in ("mean", "std"):
                    self.client.log_metric(self.parent, metric_key(f"{label}/{name}_{what}"), s[what])
        for path in artifacts:
            self.client.log_artifact(self.parent, str(path))
        self.client.set_tag(self.parent, "ntil_ds.comparison.failed_runs", str(any_failed))
        self.client.set_terminated(self.parent, "FINISHED")
