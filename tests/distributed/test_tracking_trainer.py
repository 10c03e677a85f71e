"""MLflow tracking of the real trainer: launch/train.py with the tiny Qwen2-VL clock recipe, 2 ranks.

One scenario, two jobs: a job killed (SIGKILL of every process, as a node failure) after its step-2
checkpoint, then the resumed job to the end, both into the embedded default store
(``sqlite:///<output_dir>/mlflow.db``). The run must be one run, holding every step once with the
value first logged for it, the params of the resolved recipe, the eval steps, the plots and the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ntil_ds.config import flatten, load_config
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
def killed_and_resumed(tmp_path_factory):
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("tracked_trainer")
    model_dir = build_tiny_model_folder("qwen2_vl", root / "model")
    data = write_dataset("clock", 40, root / "data", seed=0)
    out = root / "run"
    overrides = {
        "output_dir": out,
        "model.name_or_path": model_dir,
        "data.train_file": data["train"],
        "data.eval_file": data["val"],
        "optim.warmup_steps": 1,
        "train.max_steps": STEPS,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.log_every": 1,
        "train.save_every": 2,
        "train.eval_every": 3,
        "tracking.experiment": "trainer-test",
        "tracking.log_model": "true",
    }
    env = launch_env()
    env.pop("MLFLOW_TRACKING_URI", None)  # the embedded default store
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
    assert run.data.params == {key: str(value) for key, value in flatten(cfg).items()}

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
