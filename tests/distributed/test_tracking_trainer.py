"""MLflow tracking of the real trainer: launch/train.py with the tiny Qwen2-VL clock recipe, 2 ranks.

Two scenarios:

- a job killed (SIGKILL of every process, as a node failure) after its step-2 checkpoint, then the
  resumed job to the end, both into the embedded default store (``sqlite:///<output_dir>/mlflow.db``).
  The run must be one run, holding every step once with the value first logged for it, the params of
  the resolved recipe, the eval steps, the plots and the model.
- a short job logging to a real ``mlflow server`` behind MLflow's basic-auth app, its credentials given
  in the URI (``http://user:password@host``): the run is logged, and the password is in no file the
  job wrote, no line of its log and no param or tag of the run. The address of the run's charts the
  job prints at its start and end opens, in headless Chromium, on those charts in MLflow's
  model-training view (not the GenAI one MLflow 3 opens by default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ntil_ds.config import flatten, load_config
from tests.distributed.mlflow_server import MlflowServer, SigningProxy
from tests.distributed.training_runs import (
    TINY_RECIPE,
    kill_after_checkpoint,
    launch_env,
    run_training,
)

pytestmark = pytest.mark.distributed

STEPS = 6
STEP_KEYS = ("loss", "ce", "ntil", "emd", "rel", "mag", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib")


def first_logged(output_dir: Path, split: str) -> dict[int, dict]:
    """step -> the first record the trainer wrote for it (a resumed job repeats steps after its checkpoint)."""
    records: dict[int, dict] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == split:
            records.setdefault(record["step"], record)
    return records


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> dict[str, object]:
    """The overrides every job here shares: a tiny Qwen2-VL folder and clock data, 2 x 2 per step."""
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("tracked_trainer_inputs")
    data = write_dataset("clock", 40, root / "data", seed=0)
    return {
        "model.name_or_path": build_tiny_model_folder("qwen2_vl", root / "model"),
        "data.train_file": data["train"],
        "data.eval_file": data["val"],
        "optim.warmup_steps": 1,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.log_every": 1,
    }


def job_env() -> dict[str, str]:
    env = launch_env()
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, tiny_inputs):
    root = tmp_path_factory.mktemp("tracked_trainer")
    out = root / "run"
    overrides = {
        **tiny_inputs,
        "output_dir": out,
        "train.max_steps": STEPS,
        "train.save_every": 2,
        "train.eval_every": 3,
        "tracking.experiment": "trainer-test",
        "tracking.log_model": "true",
    }
    env = job_env()  # no MLFLOW_TRACKING_URI: the embedded default store
    kill_after_checkpoint(overrides, 2, env=env, timeout=300)
    resumed = run_training(overrides, env=env)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from" in resumed.stdout
    cfg = load_config(TINY_RECIPE, [f"{k}={v}" for k, v in overrides.items()])
    return out, cfg, resumed.stdout


@pytest.mark.timeout(900)
def test_killed_and_resumed_trainer_job_is_one_complete_mlflow_run(killed_and_resumed):
    from mlflow import MlflowClient

    out, cfg, _ = killed_and_resumed
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("trainer-test").experiment_id])
    run_id = run.info.run_id
    final_state = json.loads((out / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())
    assert final_state["tracker_run_id"] == run_id
    assert run.info.status == "FINISHED"
    # The recipe, plus what it resolved to on this device (a dense model: no experts implementation).
    resolved = {"model.experts_implementation_resolved": "none"}
    assert run.data.params == {key: str(value) for key, value in flatten(cfg).items()} | resolved

    reference = first_logged(out, "train")
    for key in STEP_KEYS:
        history = client.get_metric_history(run_id, f"train/{key}")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), key  # once each
        for metric in history:
            assert metric.value == pytest.approx(reference[metric.step][key], rel=1e-9), (key, metric.step)
    evals = first_logged(out, "eval")
    eval_history = client.get_metric_history(run_id, "eval/loss")
    assert sorted((m.step, m.value) for m in eval_history) == [(s, evals[s]["loss"]) for s in (3, 6)]
    assert [m.step for m in client.get_metric_history(run_id, "data/train_kept")] == [0]
    # "HH:MM" answers: units and tens digits, scored by place for the digit-position plot.
    for place in (0, 1):
        history = client.get_metric_history(run_id, f"eval/digit_acc_pos{place}")
        assert sorted((m.step, m.value) for m in history) == [
            (s, evals[s][f"digit_acc_pos{place}"]) for s in (3, 6)
        ]

    tags = run.data.tags
    assert tags["ntil_ds.world_size"] == "2" and tags["ntil_ds.model"] == cfg.model.name_or_path
    assert tags["ntil_ds.version.deepspeed"] and tags["ntil_ds.git_commit"]

    def artifacts(path=None):
        for item in client.list_artifacts(run_id, path):
            yield from artifacts(item.path) if item.is_dir else [item.path]

    logged = set(artifacts())
    expected = {"config.yaml", "deepspeed.json", "model/config.json"}
    expected |= {"plots/loss_curves.png", "plots/digit_position_error.png"}
    assert expected <= logged, logged
    assert any(p.startswith("model/") and p.endswith(".safetensors") for p in logged), logged


@pytest.mark.timeout(900)
def test_trainer_log_shows_where_the_run_is(killed_and_resumed):
    out, _, log = killed_and_resumed
    assert f"mlflow ui --backend-store-uri sqlite:///{out.resolve()}/mlflow.db" in log
    assert "unreachable" not in log and "did not reach" not in log


# Basic-auth passwords must have 12 characters or more (MLflow's rule).
USER, PASSWORD = "trainer", "secret-7Xq9Kp2m"


@pytest.fixture(scope="module")
def authenticated_job(tmp_path_factory, tiny_inputs):
    """2 steps (checkpoint and eval at step 2) into a basic-auth server, credentials in tracking.uri."""
    root = tmp_path_factory.mktemp("authenticated")
    server = MlflowServer(root / "server", credentials=(USER, PASSWORD))
    server.root.mkdir()
    server.start()
    try:
        out = root / "run"
        overrides = {
            **tiny_inputs,
            "output_dir": out,
            "train.max_steps": 2,
            "train.save_every": 2,
            "train.eval_every": 2,
            "train.export_at_end": "false",
            "tracking.experiment": "authenticated",
            "tracking.uri": server.uri.replace("http://", f"http://{USER}:{PASSWORD}@"),
        }
        job = run_training(overrides, env=job_env())
        assert job.returncode == 0, job.stdout[-6000:]
        yield server, out, job.stdout
    finally:
        server.kill()


@pytest.mark.timeout(600)
def test_credentials_in_the_uri_reach_the_server_and_are_written_nowhere(authenticated_job, monkeypatch):
    from mlflow import MlflowClient

    server, out, log = authenticated_job
    # The server wants the credentials: the job could only log because it used them.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert refused.value.code == 401

    files = [p for p in out.rglob("*") if p.is_file()]
    assert out / "config.yaml" in files and out / "tracking" / "journal.jsonl" in files
    assert any(p.name == "config.yaml" and "checkpoints" in p.parts for p in files), files
    for secret in (PASSWORD, "secret"):
        assert not [p for p in files if secret.encode() in p.read_bytes()], secret
        assert not [line for line in log.splitlines() if secret in line], secret
    server_artifacts = [p for p in (server.root / "artifacts").rglob("*") if p.is_file()]
    assert server_artifacts and not [p for p in server_artifacts if PASSWORD.encode() in p.read_bytes()]

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("authenticated")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2]
    assert run.data.params["tracking.uri"] == server.uri  # as given, less the credentials
    shown = [*run.data.params.values(), *run.data.tags.values(), *experiment.tags.values()]
    assert not [value for value in shown if "secret" in value]


def chromium() -> str:
    """Debian's chromium (`make system-deps`); CI (NTIL_REQUIRE_SLURM=1) fails without it."""
    path = shutil.which("chromium")
    if path is None:
        reason = "chromium is not installed (`make system-deps` installs Debian's chromium)"
        if os.environ.get("NTIL_REQUIRE_SLURM") or os.environ.get("CI"):
            pytest.fail(f"{reason}; NTIL_REQUIRE_SLURM / CI is set")
        pytest.skip(reason)
    return path


def rendered_page(url: str, profile: Path) -> str:
    """The page's DOM after the MLflow UI (a JS app) has loaded its data and drawn its charts."""
    command = [
        chromium(),
        *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
        *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
        f"--user-data-dir={profile}",
        "--window-size=1400,2600",  # tall: charts out of view are not drawn; the train section is third
        "--virtual-time-budget=20000",
        "--run-all-compositor-stages-before-draw",  # else the charts are still spinners when dumped
        "--dump-dom",
        url,
    ]
    page = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert page.returncode == 0, page.stderr[-3000:]
    return page.stdout


@pytest.mark.timeout(600)
def test_the_printed_address_opens_the_runs_charts_as_model_training(
    authenticated_job, monkeypatch, tmp_path
):
    from mlflow import MlflowClient

    server, _, log = authenticated_job
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("authenticated")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    [run] = client.search_runs([experiment.experiment_id])

    address = (
        f"{server.uri}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
        "?workflowType=machine_learning"
    )
    lines = log.splitlines()
    printed = [i for i, line in enumerate(lines) if address in line]
    first_step = next(i for i, line in enumerate(lines) if "step 1/2 loss" in line)
    last_step = next(i for i, line in enumerate(lines) if "step 2/2 loss" in line)
    assert len(printed) == 2 and printed[0] < first_step < last_step < printed[1], printed

    with SigningProxy(server) as proxy:
        page = rendered_page(address.replace(server.uri, proxy.uri), tmp_path / "chromium-profile")
    assert run.info.run_name in page and "Model metrics" in page
    # The model-training view's sidebar, not the GenAI one's:
    assert "Model registry" in page and "Agent versions" not in page
    # The run's charts were drawn (a chart per metric, titled by its name within its section):
    assert page.count('class="main-svg"') >= 6
    assert ">digit_acc<" in page and ">grad_norm<" in page  # eval/digit_acc, train/grad_norm
