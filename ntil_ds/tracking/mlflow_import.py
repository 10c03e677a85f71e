"""Import of a journal into a store: ``python -m ntil_ds.tracking import`` (see ``__main__.py``).

:func:`import_journal` replays a job's journal (:mod:`ntil_ds.tracking.journal`) through the same
:class:`~ntil_ds.tracking.mlflow_client.RunWriter` the live sender uses, skipping what the run already
has, so importing twice adds nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from ntil_ds.tracking.journal import read_records
from ntil_ds.tracking.mlflow_client import (
    RunWriter,
    bound_http_retries,
    create_run,
    existing_run,
    experiment_id,
    local_artifact_location,
)

logger = logging.getLogger(__name__)


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
        run = existing_run(client, used[0] if used else start["run_id"])
        if run is None:
            experiment = experiment_id(client, start["experiment"], local_artifact_location(uri))
            found = client.search_runs(
                [experiment], filter_string=f"tags.`ntil_ds.journal_run` = '{lineage}'", max_results=1
            )
            run_id = (
                found[0].info.run_id
                if found
                else create_run(client, {**start, "artifact_location": local_artifact_location(uri)},
                                {**start["tags"], "ntil_ds.journal_run": lineage})
            )  # fmt: skip
        else:
            run_id = run.info.run_id
        writer = RunWriter(client, run_id, fresh=False)
        writer.send(content)
        done.append((session, writer))
    return done
