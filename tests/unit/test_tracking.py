"""Tracking in one process: where runs go, tags, plots, an unreachable store and the journal import."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ntil_ds.config import Config, TrackingConfig, flatten, redact_uri, save_config
from ntil_ds.dist import DistInfo
from ntil_ds.tracking import (
    NullTracker,
    TrackingError,
    build_tracker,
    default_tags,
    resolve_tracking_uri,
    take_uri_credentials,
)
from ntil_ds.tracking.__main__ import main as tracking_cli
from ntil_ds.tracking.plots import digit_position_series, plot_loss_curves, plot_run_history

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _mlflow_http_policy(monkeypatch):
    # The tracker sets MLflow's HTTP retry variables with setdefault: unset them for the test and
    # have monkeypatch put back what was there before (setenv records the original state).
    for name in (
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def closed_port_uri() -> str:
    """An http URI on loopback where nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_uri_precedence_recipe_then_env_then_embedded(tmp_path):
    assert resolve_tracking_uri("http://a:5000", tmp_path, "http://b:5000") == "http://a:5000"
    assert resolve_tracking_uri("", tmp_path, "http://b:5000") == "http://b:5000"
    embedded = resolve_tracking_uri("", tmp_path / "out", None)
    assert embedded == f"sqlite:///{(tmp_path / 'out').resolve()}/mlflow.db"


def test_uri_credentials_are_redacted_in_every_text_and_config_output(tmp_path):
    assert (
        redact_uri("https://al%40ice:to:ken@mlflow.example:5000/x?y=1") == "https://mlflow.example:5000/x?y=1"
    )
    assert redact_uri("open http://u:p@h:1 in a browser; or https://tok@h2/x") == (
        "open http://h:1 in a browser; or https://h2/x"
    )
    for unchanged in (
        "sqlite:////abs/b@c.db",
        "sqlite:///rel/x.db",
        "http://[::1]:5000",
        "a@b",
        "file:///a@b",
    ):
        assert redact_uri(unchanged) == unchanged
    cfg = Config(tracking=TrackingConfig(uri="http://trainer:secret-pw@mlflow.example:5000"))
    assert flatten(cfg)["tracking.uri"] == "http://mlflow.example:5000"  # the MLflow params
    assert "secret" not in save_config(cfg, tmp_path / "config.yaml").read_text()
    assert cfg.tracking.uri == "http://trainer:secret-pw@mlflow.example:5000"  # the job still has them


def test_uri_credentials_become_the_variables_mlflow_reads(monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.setenv(name, "from-the-environment")  # records the original state for teardown
    assert take_uri_credentials("https://al%40ice:p%3Ass@host:5000/x") == "https://host:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "al@ice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "p:ss"
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "from-the-environment"
    assert take_uri_credentials("https://t0ken@host") == "https://host"
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "t0ken"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "kept")
    assert take_uri_credentials("http://host:5000") == "http://host:5000"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "kept"  # a URI without credentials leaves them


def test_non_main_ranks_and_disabled_tracking_get_a_null_tracker(tmp_path):
    assert isinstance(build_tracker(TrackingConfig(), is_main=False, output_dir=tmp_path), NullTracker)
    off = TrackingConfig(enabled=False)
    tracker = build_tracker(off, is_main=True, output_dir=tmp_path)
    assert isinstance(tracker, NullTracker) and tracker.run_id is None
    assert not (tmp_path / "tracking").exists()


def test_default_tags_describe_code_job_and_versions():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3"}
    tags = default_tags(DistInfo(rank=0, world_size=12, tp_size=2), "Qwen/Qwen2-VL-2B-Instruct", env)
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert tags["ntil_ds.git_commit"] == commit == tags["mlflow.source.git.commit"]
    assert tags["ntil_ds.git_dirty"] in ("True", "False")
    assert tags["ntil_ds.slurm_job_id"] == "4242" and tags["ntil_ds.num_nodes"] == "3"
    assert (tags["ntil_ds.world_size"], tags["ntil_ds.tp_size"], tags["ntil_ds.dp_size"]) == ("12", "2", "6")
    assert tags["ntil_ds.model"] == "Qwen/Qwen2-VL-2B-Instruct"
    for package in ("torch", "deepspeed", "transformers"):
        assert tags[f"ntil_ds.version.{package}"] == importlib.metadata.version(package)
    assert "ntil_ds.slurm_job_id" not in default_tags(DistInfo(), "m", {})  # not under SLURM


def test_loss_plot_draws_the_objective_and_ntil_parts(tmp_path):
    history = {
        "train/loss": {1: 2.0, 2: 1.5, 3: 1.2},
        "train/ce": {1: 1.8, 2: 1.3, 3: 1.1},
        "train/emd": {1: 0.4, 2: 0.3, 3: 0.2},
        "eval/loss": {2: 1.6},
        "train/lr": {1: 1e-3, 2: 1e-3, 3: 1e-3},
    }
    png = plot_loss_curves(history, tmp_path / "loss.png")
    assert png is not None and png.read_bytes().startswith(PNG_MAGIC)
    assert plot_loss_curves({"train/lr": {1: 1.0}}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_digit_position_plot_uses_the_first_and_last_evaluation(tmp_path):
    history = {
        "eval/digit_acc_pos0": {10: 0.5, 20: 0.9, 30: 0.95},
        "eval/digit_acc_pos1": {10: 0.25, 20: 0.5, 30: 0.75},
        "eval/digit_acc": {10: 0.4, 20: 0.7, 30: 0.85},
        "train/loss": {1: 2.0, 30: 1.0},
    }
    assert digit_position_series(history) == {
        "eval/step 10": {0: 0.5, 1: 0.25},
        "eval/step 30": {0: 0.95, 1: 0.75},
    }
    drawn = plot_run_history(history, tmp_path)
    assert [p.name for p in drawn] == ["loss_curves.png", "digit_position_error.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in drawn)
    assert [p.name for p in plot_run_history({"train/loss": {1: 1.0}}, tmp_path / "b")] == ["loss_curves.png"]


@pytest.mark.timeout(120)
def test_system_metrics_are_logged_at_training_steps_when_enabled(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    # A relative sqlite URI (three slashes), as users type it: artifacts go next to that database.
    monkeypatch.chdir(tmp_path)
    cfg = TrackingConfig(uri="sqlite:///store/mlflow.db", system_metrics=True, run_name="sys")
    tracker = build_tracker(cfg, is_main=True, output_dir=tmp_path / "out")
    for step in (1, 2, 3):
        tracker.log_metrics({"train/loss": 1.0}, step=step)
    tracker.finish()
    client = MlflowClient(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "sys"
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "mlartifacts").as_uri())
    system = [key for key in run.data.metrics if key.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system, sorted(run.data.metrics)
    steps = [m.step for m in client.get_metric_history(tracker.run_id, "system/cpu_utilization_percentage")]
    assert steps and set(steps) <= {1, 2, 3} and len(steps) == len(set(steps))  # at most one sample a step


@pytest.mark.timeout(120)
def test_experiments_open_as_model_training_and_the_log_gives_the_runs_address(tmp_path, caplog):
    from mlflow import MlflowClient

    caplog.set_level(logging.INFO, logger="ntil_ds.tracking")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("chosen-in-the-ui", tags={"mlflow.experimentKind": "genai_development"})
    client.create_experiment("made-without-a-kind")
    addresses = {}
    for name in ("new", "made-without-a-kind", "chosen-in-the-ui"):
        tracker = build_tracker(
            TrackingConfig(uri=uri, experiment=name), is_main=True, output_dir=tmp_path / name
        )
        tracker.finish()
        experiment_id = client.get_run(tracker.run_id).info.experiment_id
        addresses[name] = (
            f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{tracker.run_id}/model-metrics"
            "?workflowType=machine_learning"  # `mlflow ui`'s address, on the model-training view
        )
    kinds = {
        name: client.get_experiment_by_name(name).tags.get("mlflow.experimentKind") for name in addresses
    }
    assert kinds == {
        "new": "custom_model_development",
        "made-without-a-kind": "custom_model_development",
        "chosen-in-the-ui": "genai_development",  # a kind already set is kept
    }
    messages = [r.getMessage() for r in caplog.records]
    for address in addresses.values():  # once when the run opens, once when it ends
        assert len([m for m in messages if address in m]) == 2, messages


def test_required_store_that_is_unreachable_fails_at_start(tmp_path):
    cfg = TrackingConfig(uri=closed_port_uri(), required=True)
    with pytest.raises(TrackingError, match=r"tracking\.required is true.*tracking\.required=false"):
        build_tracker(cfg, is_main=True, output_dir=tmp_path)
    with pytest.raises(TrackingError, match="cannot be used"):
        build_tracker(
            TrackingConfig(uri="nosuchscheme://x", required=True), is_main=True, output_dir=tmp_path
        )


@pytest.mark.timeout(180)
def test_unreachable_store_keeps_training_and_the_journal_imports_later(tmp_path, caplog, capsys):
    """Store down for the whole job: one warning, nothing raised, everything imported afterwards, once."""
    caplog.set_level(logging.INFO, logger="ntil_ds.tracking")
    out = tmp_path / "run"
    tracker = build_tracker(TrackingConfig(uri=closed_port_uri()), is_main=True, output_dir=out)
    assert tracker.run_id is None  # the store never answered
    tracker.log_params({"loss.name": "ntil", "optim.lr": 1e-5})
    for step in range(1, 7):
        tracker.log_metrics({"train/loss": 1.0 / step, "train/ce": 0.8 / step}, step=step)
        if step % 3 == 0:
            tracker.log_metrics({"eval/loss": 0.5 / step}, step=step)
    (out / "config.yaml").write_text("loss: {name: ntil}\n")
    tracker.log_artifact(out / "config.yaml")
    tracker.finish("FINISHED")

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    unreachable = [m for m in warnings if "is unreachable" in m]
    assert len(unreachable) == 1, warnings
    journal = out / "tracking" / "journal.jsonl"
    [leftover] = [m for m in warnings if "did not reach" in m]
    assert f"python -m ntil_ds.tracking import {journal}" in leftover

    target = f"sqlite:///{tmp_path / 'central.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "ntil_ds.tracking", "import", str(journal), "--uri", target]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "14 metric values sent, 0 already there" in first.stdout

    from mlflow import MlflowClient

    client = MlflowClient(target)
    [run] = client.search_runs([client.get_experiment_by_name("ntil-ds").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params == {"loss.name": "ntil", "optim.lr": "1e-05"}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (s, 1.0 / s) for s in range(1, 7)
    ]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")) == [3, 6]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "plots")
    }
    assert {"config.yaml", "plots/loss_curves.png"} <= artifacts
    assert not (tmp_path / "mlruns").exists()  # artifacts of a sqlite store live next to its file

    # The same command in this process (saves a start-up): nothing is sent twice.
    assert tracking_cli(["import", str(journal), "--uri", target]) == 0
    assert "0 metric values sent, 14 already there" in capsys.readouterr().out
    [same] = client.search_runs([run.info.experiment_id])
    assert same.info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 6
