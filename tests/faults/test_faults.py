"""Fault injection: real 2-process training jobs (the tiny recipe, the real launchers) hit by the faults
a cluster produces, and what survives each. docs/reliability.md tabulates the promises these check.

Elsewhere in the suite, the same standard: a NaN loss or gradient (tests/distributed/
test_train_failures.py), the MLflow server killed and restarted mid-run (tests/distributed/
test_tracking_mlflow.py), a dead rank under SLURM and preemption (tests/slurm/), a torn or
unwritable tracking journal (tests/faults/test_tracking_faults.py).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ntil_ds.checkpoint import COMPLETE_MARKER, checkpoint_damage, checkpoint_tag, checkpoints_root
from ntil_ds.preemption import EXIT_PREEMPTED
from tests.distributed.training_runs import (
    REPO_ROOT,
    TINY_RECIPE,
    TRAIN_SCRIPT,
    kill_process_tree,
    launch_env,
    launcher_command,
    run_training,
    tiny_job_overrides,
    tiny_model_and_data,
    train_args,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.faults]

FAULT_SCRIPT = REPO_ROOT / "tests" / "faults" / "fault_train.py"


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return tiny_model_and_data(tmp_path_factory.mktemp("faults"), "qwen2_vl", n=16, image_size=56)


def overrides(setup, name: str, **extra: object) -> dict[str, object]:
    root, model_dir, data_file = setup
    return tiny_job_overrides(root / name, model_dir, data_file, **{"optim.lr": 0.001, **extra})


def _runs_train_py(process: psutil.Process) -> bool:
    """Whether ``process`` is a training rank; a short-lived helper that already ended is not."""
    try:
        return "train.py" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie; a process that ends between the two questions is not alive."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def losses(out: Path) -> dict[int, float]:
    return {step: record["loss"] for step, record in train_metrics(out).items()}


@pytest.mark.timeout(600)
def test_rank_killed_with_sigkill_mid_step_ends_the_job_fast_and_nonzero(tiny_setup, tmp_path):
    over = overrides(tiny_setup, "sigkill", **{"train.max_steps": 500})
    out = Path(str(over["output_dir"]))
    command = launcher_command("deepspeed", 2, TRAIN_SCRIPT, train_args(TINY_RECIPE, over))
    with (tmp_path / "job.log").open("w") as log:
        job = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=launch_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 400
            while not ((out / "metrics.jsonl").exists() and max(train_metrics(out), default=0) >= 2):
                assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[
                    -3000:
                ]
                time.sleep(0.2)
            workers = [p for p in psutil.Process(job.pid).children(recursive=True) if _runs_train_py(p)]
            rank_1 = next(p for p in workers if p.environ().get("RANK") == "1")
            killed_at = time.monotonic()
            rank_1.kill()  # a node's OOM killer, a hardware fault: no handler runs
            returncode = job.wait(timeout=300)  # the guard against a hang; the promise is checked below
            took_s = time.monotonic() - killed_at
        finally:
            if job.poll() is None:
                kill_process_tree(job.pid)
    assert returncode not in (0, EXIT_PREEMPTED), returncode
    # A bound that tells a hang (gloo's 30-minute timeout) from an ending, not a speed check.
    assert took_s < 120, f"the job took {took_s:.0f} s to end after rank 1 was killed"
    assert not [p for p in workers if _alive(p)], "a rank outlived the job"
    print(f"job ended {took_s:.1f} s after SIGKILL of rank 1, exit code {returncode}")


@pytest.mark.timeout(900)
def test_sigusr1_during_a_checkpoint_save_checkpoints_exits_85_and_resumes(tiny_setup):
    over = overrides(tiny_setup, "usr1", **{"train.save_every": 2})
    out = Path(str(over["output_dir"]))
    first = run_training(
        over, launcher="deepspeed", script=FAULT_SCRIPT, env=launch_env(NTIL_FAULT="usr1_during_save:2")
    )
    assert first.returncode == EXIT_PREEMPTED, first.stdout[-4000:]
    saved = checkpoints_root(out) / checkpoint_tag(2)
    assert (saved / COMPLETE_MARKER).is_file() and checkpoint_damage(saved) is None  # the save finished
    assert sorted(train_metrics(out)) == [1, 2]  # stopped at the next step boundary

    # The README's own mistake: the CE baseline started on the NTIL run's folder. Refused at start,
    # naming each key, before anything is built or written.
    config_before = (out / "config.yaml").read_text()
    other_recipe = run_training({**over, "loss.name": "ce", "optim.lr": 0.5}, launcher="deepspeed")
    assert other_recipe.returncode == 2, other_recipe.stdout[-4000:]
    assert "loss.name: 'ntil' in the checkpoint, 'ce' now" in other_recipe.stdout
    assert "optim.lr: 0.001 in the checkpoint, 0.5 now" in other_recipe.stdout
    assert (out / "config.yaml").read_text() == config_before
    assert sorted(train_metrics(out)) == [1, 2]

    resumed = run_training(over, launcher="deepspeed")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"resumed from {saved}" in resumed.stdout
    assert sorted(train_metrics(out)) == [1, 2, 3, 4]


@pytest.mark.timeout(900)
def test_disk_full_while_saving_then_a_truncated_checkpoint_resume_falls_back_to_an_intact_one(tiny_setup):
    over = overrides(
        tiny_setup, "enospc", **{"train.max_steps": 6, "train.save_every": 1, "train.keep_last": 2}
    )
    out = Path(str(over["output_dir"]))
    root = checkpoints_root(out)

    # A full disk while rank 1 writes its part of step 4: the job stops, non-zero, and says why.
    full = run_training(over, script=FAULT_SCRIPT, env=launch_env(NTIL_FAULT="enospc_at_save:4"))
    assert full.returncode not in (0, EXIT_PREEMPTED), full.stdout[-4000:]
    assert "No space left on device" in full.stdout
    assert f"the newest complete checkpoint, {checkpoint_tag(3)}, is untouched" in full.stdout
    assert not (root / checkpoint_tag(4) / COMPLETE_MARKER).exists()  # never used
    for step in (2, 3):  # the previous checkpoints are usable
        assert checkpoint_damage(root / checkpoint_tag(step)) is None
    first_losses = losses(out)
    assert sorted(first_losses) == [1, 2, 3, 4]

    # Then a file of step 3 is cut short (say, a copy to other storage was interrupted).
    damaged = root / checkpoint_tag(3)
    victim = max(damaged.rglob("*.pt"), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)

    resumed = run_training(over)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"checkpoint {damaged} is damaged ({victim.relative_to(damaged)} has" in resumed.stdout
    assert f"resumed from {root / checkpoint_tag(2)}" in resumed.stdout
    after = losses(out)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    # Steps 3 and 4, re-done from the step-2 checkpoint, are exactly what the first job computed.
    assert after[3] == first_losses[3] and after[4] == first_losses[4]


@pytest.mark.timeout(600)
def test_malformed_lines_with_skip_train_and_are_counted_in_the_run(tiny_setup):
    data_file = tiny_setup[2]
    lines = data_file.read_text().splitlines()
    cut_short, no_answer = '{"messages": [', '{"messages": [{"role": "user", "content": "no answer"}]}'
    mixed = [*lines[:8], cut_short, *lines[8:16], no_answer]  # 2 of 18 lines (11 %) are malformed
    train = data_file.parent / "with_bad_lines.jsonl"
    train.write_text("\n".join(mixed) + "\n")
    over = overrides(
        tiny_setup,
        "bad_lines",
        **{"data.train_file": train, "data.on_bad_sample": "skip", "tracking.enabled": "true"},
    )
    result = run_training(over)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "16 samples kept" in result.stdout and "2 skipped" in result.stdout

    from mlflow import MlflowClient

    out = Path(str(over["output_dir"]))
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.metrics["data/train_skipped"] == 2 and run.data.metrics["data/train_kept"] == 16
    assert run.info.status == "FINISHED"
