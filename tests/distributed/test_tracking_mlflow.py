"""MLflow tracking of real 2-process torchrun jobs (tests/distributed/tracking_job.py) against a real
``mlflow server`` on 127.0.0.1 with a sqlite backend, started (and killed, and restarted) by the test.

The server killed mid-run and restarted: nothing lost, one warning. A job killed while the server is
down, then resumed: the same run, every step once. (The real trainer and the embedded default store:
test_tracking_trainer.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ntil_ds.config import Config, TrackingConfig, flatten
from tests.distributed.mlflow_server import MlflowServer

pytestmark = pytest.mark.distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB = REPO_ROOT / "tests" / "distributed" / "tracking_job.py"
EXPERIMENT = "tracking-test"  # tracking_job.py's default
STEP_KEYS = ("train/loss", "train/grad_norm", "train/lr", "train/step_time_s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mlflow_server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    mlflow_server.start()
    try:
        yield mlflow_server
    finally:
        mlflow_server.kill()


def start_job(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(JOB),
        "--output-dir",
        str(out),
        *args,
    ]
    # cwd: a scratch folder, to see that nothing is written to the working directory.
    return subprocess.Popen(
        cmd, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_job(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = start_job(out, *args)
    stdout, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


def the_run(uri: str, experiment_name: str = EXPERIMENT):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, f"expected one run for the job, found {len(runs)}"
    return client, runs[0]


def steps_of(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def expected_params(out: Path, uri: str, experiment: str, steps: int, log_model: bool) -> dict[str, str]:
    cfg = Config(
        output_dir=str(out), tracking=TrackingConfig(uri=uri, experiment=experiment, log_model=log_model)
    )
    cfg.train.max_steps = steps
    return {key: str(value) for key, value in flatten(cfg).items()}


def artifact_paths(client, run_id: str, path: str = "") -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path or None):
        found |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def journal_steps(out: Path) -> list[tuple[int, int]]:
    """(step, time in ms) of the train/loss records the job has written so far."""
    path = out / "tracking" / "journal.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [(r["step"], r["time"]) for r in records if r["kind"] == "metrics" and "train/loss" in r["values"]]


def wait_for_step(job: subprocess.Popen, out: Path, step: int, deadline: float) -> None:
    while not journal_steps(out) or max(journal_steps(out))[0] < step:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
        time.sleep(0.2)


@pytest.mark.timeout(600)
def test_resumed_job_continues_the_same_run_without_repeated_or_missing_steps(tmp_path, server):
    """A job preempted while the server is down; the resumed job sends what it could not, once."""
    out = tmp_path / "run"
    hold = tmp_path / "server-is-down"
    args = ("--uri", server.uri, "--experiment", "resume", "--steps", "8", "--save-every", "3")
    preempted = start_job(out, *args, "--crash-after", "5", "--hold", f"4:{hold}")
    try:
        wait_for_step(preempted, out, 4, time.monotonic() + 300)
        server.kill()
        hold.touch()  # step 5 is logged with the server gone, then every rank is killed
        preempted.communicate(timeout=120)
    finally:
        if preempted.poll() is None:
            preempted.kill()
    assert preempted.returncode != 0
    assert [step for step, _ in journal_steps(out)] == [1, 2, 3, 4, 5]
    server.start()
    client, run = the_run(server.uri, "resume")
    assert run.info.status == "RUNNING"
    assert 5 not in steps_of(client, run.info.run_id, "train/loss")  # only in the killed job's journal

    resumed = run_job(out, *args)  # from the step-3 checkpoint: re-does steps 4 and 5
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "starting a new run" not in resumed.stdout
    client, run_after = the_run(server.uri, "resume")
    assert run_after.info.run_id == run.info.run_id
    assert run_after.info.status == "FINISHED"
    for key in STEP_KEYS:
        assert steps_of(client, run.info.run_id, key) == list(range(1, 9)), key
    assert steps_of(client, run.info.run_id, "eval/loss") == [2, 4, 6, 8]
    assert run_after.data.params == expected_params(out, server.uri, "resume", 8, log_model=False)
    assert "immutable" not in resumed.stdout  # the same config logs the same params
    assert "plots/loss_curves.png" in artifact_paths(client, run.info.run_id)


@pytest.mark.timeout(600)
def test_server_killed_mid_run_and_restarted_loses_no_step(tmp_path, server):
    out = tmp_path / "run"
    down, back = tmp_path / "server-is-down", tmp_path / "server-is-back"
    args = ("--uri", server.uri, "--experiment", "outage", "--steps", "10", "--save-every", "100")
    job = start_job(out, *args, "--hold", f"2:{down}", "--hold", f"7:{back}")
    try:
        deadline = time.monotonic() + 300
        wait_for_step(job, out, 2, deadline)
        server.kill()
        killed_ms = time.time() * 1000
        down.touch()
        wait_for_step(job, out, 7, deadline)  # steps 3-7 are logged while the server is gone
        server.start()
        back_ms = time.time() * 1000
        back.touch()
        stdout, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stdout[-4000:]

    logged_while_down = [step for step, ms in journal_steps(out) if killed_ms < ms < back_ms]
    assert logged_while_down == [3, 4, 5, 6, 7]
    warnings = [line for line in stdout.splitlines() if line.startswith("WARNING")]
    assert len([w for w in warnings if "is unreachable" in w]) == 1, warnings
    assert not [w for w in warnings if "did not reach" in w], warnings
    assert "reachable again" in stdout

    client, run = the_run(server.uri, "outage")
    assert run.info.status == "FINISHED"
    for key in STEP_KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, 11)), key
