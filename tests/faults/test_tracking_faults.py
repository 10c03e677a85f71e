"""The tracking journal under faults, with the real tracker and a real MLflow (sqlite) store: a torn
last line (a job killed mid-write), a corrupt line, a full disk. None of them may lose more than the
damaged record, stall delivery, or make a finished training exit as failed."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from ntil_ds.config import TrackingConfig
from ntil_ds.tracking import build_tracker
from ntil_ds.tracking.journal import now_ms

pytestmark = pytest.mark.faults


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def tracker_for(tmp_path, run_id=None):
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="faults")
    return build_tracker(config, is_main=True, output_dir=tmp_path / "run", run_id=run_id)


def run_of(tmp_path, run_id):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    return client.get_run(run_id), steps


def journal_lines(tmp_path) -> list[bytes]:
    return (tmp_path / "run" / "tracking" / "journal.jsonl").read_bytes().split(b"\n")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_torn_last_line_is_cut_with_one_warning_and_the_resumed_run_finishes(tmp_path, caplog):
    """The killed job's steps 1-3 reach the store only through the resumed job's backlog replay."""
    first = tracker_for(tmp_path)
    # The job is killed before its sender ever woke: steps 1-3 are in the journal, written as
    # log_metrics writes them but without waking the sender, so none was sent.
    for step in (1, 2, 3):
        first._journal.append("metrics", step=step, time=now_ms(), values={"train/loss": 1.0 / step})
    assert first._thread.is_alive() and not first._wake.is_set()  # asleep: it sends nothing more
    _, sent_by_the_killed_job = run_of(tmp_path, first.run_id)
    assert sent_by_the_killed_job == []
    # ... and killed while writing step 4's record: half a line, no newline, no finish().
    journal = tmp_path / "run" / "tracking" / "journal.jsonl"
    with journal.open("ab") as f:
        f.write(b'{"kind": "metrics", "session": "' + first._journal.session.encode() + b'", "step": 4, "val')

    caplog.set_level(logging.WARNING)
    resumed = tracker_for(tmp_path, run_id=first.run_id)  # resume from a checkpoint that holds the run id
    for step in (4, 5, 6):
        resumed.log_metrics({"train/loss": 1.0 / step}, step=step)
    resumed.finish("FINISHED")  # must not raise

    torn = [w for w in warnings_of(caplog) if "torn record" in w]
    assert len(torn) == 1 and str(journal) in torn[0]
    lines = journal_lines(tmp_path)
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])  # every line a whole record
    run, steps = run_of(tmp_path, first.run_id)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert run.info.status == "FINISHED"


def test_a_corrupt_line_is_skipped_with_a_warning_and_the_rest_delivered(tmp_path, caplog):
    tracker = tracker_for(tmp_path)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker._journal._file.write(b"\x00\x00 not a record \x00\n")  # say, a block of the file lost
    for step in (2, 3):
        tracker.log_metrics({"train/loss": 1.0 / step}, step=step)
    caplog.set_level(logging.WARNING)
    tracker.finish("FINISHED")
    corrupt = [w for w in warnings_of(caplog) if "corrupt line" in w]
    assert len(corrupt) == 1, warnings_of(caplog)
    run, steps = run_of(tmp_path, tracker.run_id)
    assert steps == [1, 2, 3] and run.info.status == "FINISHED"


class FillsUp:
    """The journal's file, on a disk that is full for the next ``failures`` writes: half of each line
    reaches the disk, then ENOSPC."""

    def __init__(self, file, failures: int) -> None:
        self.file, self.failures = file, failures

    def write(self, data: bytes) -> int:
        if self.failures:
            self.failures -= 1
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_loses_only_the_records_it_refused_counted_and_training_goes_on(tmp_path, caplog):
    tracker = tracker_for(tmp_path)
    caplog.set_level(logging.WARNING)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker._journal._file = FillsUp(tracker._journal._file, failures=1)
    for step in (2, 3, 4):
        tracker.log_metrics({"train/loss": 1.0 / step}, step=step)  # step 2's record is refused: no raise
    tracker.finish("FINISHED")

    messages = warnings_of(caplog)
    assert len([m for m in messages if "cannot write the tracking journal" in m]) == 1
    assert any("1 tracking records of this job could not be written" in m for m in messages), messages
    lines = journal_lines(tmp_path)
    assert all(json.loads(line) for line in lines[:-1])  # the half line was cut, not left to be joined
    run, steps = run_of(tmp_path, tracker.run_id)
    assert steps == [1, 3, 4] and run.info.status == "FINISHED"


def test_finish_never_raises_even_when_the_journal_is_gone(tmp_path, caplog):
    tracker = tracker_for(tmp_path)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    (tmp_path / "run" / "tracking" / "journal.jsonl").unlink()  # an over-eager cleanup script
    caplog.set_level(logging.WARNING)
    tracker.finish("FINISHED")
    assert any("tracking did not finish cleanly" in m for m in warnings_of(caplog)), warnings_of(caplog)
