"""`sbatch slurm/train.sh` on a real local SLURM cluster, 2 CPU processes on one node.

- the tiny demo recipe (real trainer, ZeRO-3, tiny Qwen2-VL) runs to completion;
- the same job sent the preemption signal mid-run checkpoints, requeues itself and finishes, with the
  loss sequence of the uninterrupted run and in the same MLflow run;
- a rank that dies ends the job (FAILED, long before its time limit; tests/slurm/standin_train.py,
  a small real gloo job that can kill one of its ranks).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ntil_ds.preemption import EXIT_PREEMPTED
from tests.conftest import REPO_ROOT
from tests.distributed.training_runs import train_metrics
from tests.slurm.cluster import LocalSlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.distributed]

TINY_RECIPE = "configs/train/tiny_qwen2vl_clock.yaml"
STEPS = 16


def submit(cluster: LocalSlurmCluster, tmp: Path, recipe: str, *overrides: str, script: str | None = None,
           minutes: int = 10) -> str:  # fmt: skip
    """sbatch slurm/train.sh as a user would, with the CPU settings of this machine."""
    env = {
        "ACCELERATOR": "cpu",
        "NPROC_PER_NODE": "2",
        "NTIL_PREEMPT_FLAG": str(tmp / "preempt.flag"),
        # the venv's deepspeed/python, as an activated venv would give
        "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
    }
    if script is not None:
        env["TRAIN_SCRIPT"] = script
    return cluster.sbatch(
        [
            f"--output={tmp}/slurm-%j.out",
            "--gpus-per-node=0",
            f"--cpus-per-task={cluster.cpus}",
            f"--time={minutes}",
            # the recipe's warning (300 s before the limit) would come at once in a job this short
            "--signal=B:USR1@10",
            "slurm/train.sh",
            recipe,
            *overrides,
        ],
        env=env,
        cwd=REPO_ROOT,
    )


def job_log(tmp: Path, job_id: str) -> str:
    path = tmp / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no job log)"


def steps_logged(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny demo's model folder and clock data, generated offline."""
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("demo-inputs")
    model_dir = build_tiny_model_folder("qwen2_vl", root / "model")
    paths = write_dataset("clock", 48, root / "data", seed=0)
    return model_dir, paths["train"]


def demo_overrides(demo_inputs: tuple[Path, Path], root: Path, *extra: str) -> list[str]:
    model_dir, train_file = demo_inputs
    return [
        f"output_dir={root}/out",
        f"model.name_or_path={model_dir}",
        f"data.train_file={train_file}",
        "data.eval_file=",
        f"train.max_steps={STEPS}",
        # 2 ranks x 2 sequences, no accumulation: the cheapest real step
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "optim.warmup_steps=2",
        "train.log_every=1",
        "train.save_every=0",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        *extra,
    ]


def mlflow_runs(root: Path) -> tuple[list, object]:
    """All runs of the job's tracking store, and the client that read them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    runs = [run for exp in client.search_experiments() for run in client.search_runs([exp.experiment_id])]
    return runs, client


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, demo_inputs, tmp_path_factory):
    """The reference: the tiny demo recipe trained start to end in one job."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = submit(slurm_cluster, tmp, TINY_RECIPE, *demo_overrides(demo_inputs, tmp))
    info = slurm_cluster.wait_job(job, timeout=600)
    return tmp, job, info


@pytest.mark.timeout(660)
def test_tiny_demo_runs_to_completion(uninterrupted):
    tmp, job, info = uninterrupted
    log = job_log(tmp, job)
    assert (info.state, info.exit_code, info.restarts) == ("COMPLETED", "0:0", 0), log
    assert sorted(train_metrics(tmp / "out")) == list(range(1, STEPS + 1)), log
    assert (tmp / "out" / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file()
    assert (tmp / "out" / "export" / "config.json").is_file()  # the Hugging Face folder
    assert f"step {STEPS}/{STEPS} loss" in log  # rank 0's step log reaches the job's output file
    assert "training exited with 0" in log


@pytest.mark.timeout(1200)
def test_preempted_job_checkpoints_requeues_and_matches_uninterrupted_run(
    slurm_cluster, demo_inputs, uninterrupted, tmp_path
):
    ref_tmp, _, ref_info = uninterrupted
    assert ref_info.state == "COMPLETED", job_log(ref_tmp, uninterrupted[1])
    out = tmp_path / "out"
    job = submit(slurm_cluster, tmp_path, TINY_RECIPE, *demo_overrides(demo_inputs, tmp_path))

    # Mid-run: once 2 steps are logged, send what --signal=B:USR1@N sends ahead of the time limit.
    deadline = time.monotonic() + 480
    while steps_logged(out) < 2:
        assert time.monotonic() < deadline, job_log(tmp_path, job)
        assert slurm_cluster.job(job).state in ("PENDING", "RUNNING"), job_log(tmp_path, job)
        time.sleep(0.05)
    res = slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    assert res.returncode == 0, res.stderr

    info = slurm_cluster.wait_job(job, timeout=600)
    log = job_log(tmp_path, job)
    assert (info.state, info.exit_code, info.restarts) == ("COMPLETED", "0:0", 1), log
    assert f"ranks checkpointed (exit {EXIT_PREEMPTED}): requeueing job {job}" in log
    # The preemption checkpoint is mid-run, and the second start resumed from it.
    checkpoints = sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/COMPLETE"))
    assert len(checkpoints) == 2 and checkpoints[-1] == f"step_{STEPS:08d}", (checkpoints, log)
    preempted_at = json.loads((out / "checkpoints" / checkpoints[0] / "trainer_state.json").read_text())[
        "step"
    ]
    assert 2 <= preempted_at < STEPS, log
    first_start, second_start = log.split(f"job {job} start 2")
    assert f"preempted at step {preempted_at}" in first_start
    assert "resumed from" in second_start and checkpoints[0] in second_start
    assert not (tmp_path / "preempt.flag").exists()  # a later start must not stop at once

    # Same losses as the uninterrupted run, step by step, bit for bit: the checkpoint restores weights,
    # optimizer, data position and random state exactly, and nothing else differs between the runs.
    metrics, reference = train_metrics(out), train_metrics(ref_tmp / "out")
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "ce", "ntil", "grad_norm"):
            assert metrics[step][key] == reference[step][key], (step, key)

    # The requeued start continued the same MLflow run: one run, finished, with every step's loss.
    runs, client = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    assert sorted(history) == list(range(1, STEPS + 1))
    assert history == pytest.approx({s: metrics[s]["loss"] for s in history}, rel=1e-9)


@pytest.mark.timeout(300)
def test_dead_rank_ends_the_job(slurm_cluster, tmp_path):
    # Rank 1 dies at step 3 while rank 0 waits in a collective. The job must end FAILED on its own, not
    # hang until its 3-minute limit (state TIMEOUT), and must not be requeued.
    job = submit(
        slurm_cluster, tmp_path, "tests/slurm/standin_recipe.yaml", f"output_dir={tmp_path}/out",
        "max_steps=50", "step_seconds=0.2", "die_rank=1", "die_at_step=3",
        script="tests/slurm/standin_train.py", minutes=3,
    )  # fmt: skip
    info = slurm_cluster.wait_job(job, timeout=240)
    log = job_log(tmp_path, job)
    assert info.state == "FAILED", log
    # Promised: a non-zero exit that is not the preemption code (so no requeue). Which code reaches
    # SLURM is a race and not promised: the dead rank's own 3, or 1 from rank 0, whose collective fails
    # when its peer vanishes, if the launcher notices rank 0 first.
    code, signal_number = info.exit_code.split(":")
    assert code not in ("0", str(EXIT_PREEMPTED)) and signal_number == "0", info.exit_code
    assert "rank 1 dies at step 3" in log
    assert info.restarts == 0
