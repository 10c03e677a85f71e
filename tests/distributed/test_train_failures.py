"""Failing well: a NaN loss stops the job before the optimizer steps, naming where; a bad recipe fails
at start, before any model is built, with a message that names the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.training_runs import (
    REPO_ROOT,
    TINY_RECIPE,
    TRAIN_SCRIPT,
    launch_env,
    run_training,
    tiny_job_overrides,
    tiny_model_and_data,
    train_args,
    train_metrics,
)

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return tiny_model_and_data(tmp_path_factory.mktemp("failures"), "qwen2_vl", n=16, image_size=56)


def overrides(root: Path, model_dir: Path, data_file: Path, name: str, **extra: object) -> dict[str, object]:
    return tiny_job_overrides(
        root / name, model_dir, data_file, **{"train.global_batch_size": 8, "train.save_every": 1, **extra}
    )


def assert_weights_are_those_after_step_1(out: Path) -> None:
    """The weights the stopped job exported equal the step-1 checkpoint: the optimizer never applied
    the step that went non-finite."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForImageTextToText

    after_step_1 = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_00000001")
    after_nan = AutoModelForImageTextToText.from_pretrained(
        out / "after_nan", dtype=torch.float32
    ).state_dict()
    for name, value in after_step_1.items():
        assert torch.equal(after_nan[name], value), name


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_nan_loss_stops_before_the_optimizer_step_naming_step_rank_and_batch(tiny_setup):
    root, model_dir, data_file = tiny_setup
    out = root / "nan"
    result = run_training(
        overrides(root, model_dir, data_file, "nan"),
        script=REPO_ROOT / "tests" / "distributed" / "nan_train.py",
        env=launch_env(NAN_AT_STEP="2", NAN_ON_RANK="1"),
    )
    assert result.returncode != 0, result.stdout[-4000:]
    log = result.stdout
    assert "non-finite loss at step 2" in log, log[-4000:]
    # Rank 1's micro-batch 1 of step 2 = stream positions 13 and 15 (2 ranks, micro-batch 2, no shuffle).
    # each named by its file and line (sample i is line i + 1: no line of the file is skipped)
    samples = f"samples [13, 15] ({data_file}:14, {data_file}:16)"
    assert f"rank 1 (dp rank 1), micro-batch 1 of the step, {samples}" in log, log[-4000:]
    assert "loss_sum=nan" in log
    # Both ranks stopped with the same diagnosis (rank 0 saw a finite loss itself).
    assert log.count("non-finite loss at step 2") >= 2
    assert sorted(train_metrics(out)) == [1]  # step 2 never completed
    assert_weights_are_those_after_step_1(out)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_nan_gradient_with_a_finite_loss_stops_before_the_optimizer_step(tiny_setup):
    root, model_dir, data_file = tiny_setup
    out = root / "nan_grad"
    result = run_training(
        overrides(root, model_dir, data_file, "nan_grad"),
        script=REPO_ROOT / "tests" / "distributed" / "nan_train.py",
        env=launch_env(NAN_AT_STEP="2", NAN_ON_RANK="1", NAN_IN="gradient"),
    )
    assert result.returncode != 0, result.stdout[-4000:]
    log = result.stdout
    assert "non-finite gradient at step 2 (of 4) with a finite loss" in log, log[-4000:]
    assert "non-finite loss" not in log
    # Every rank stopped (ZeRO-3 partitions the NaN gradient over both ranks' optimizer shards).
    assert log.count("non-finite gradient at step 2") >= 2
    assert sorted(train_metrics(out)) == [1]
    assert_weights_are_those_after_step_1(out)


@pytest.mark.timeout(200)
def test_global_batch_not_divisible_by_micro_batch_times_ranks_fails_at_start(tiny_setup):
    root, model_dir, data_file = tiny_setup
    result = run_training(
        overrides(root, model_dir, data_file, "bad_batch", **{"train.global_batch_size": 6}), timeout=180
    )
    assert result.returncode != 0
    assert (
        "train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x 2 data-parallel ranks"
        in result.stdout
    )
    assert "Traceback" not in result.stdout.split("config error")[0]  # a message, not a crash
    assert not (root / "bad_batch").exists()  # failed before touching anything


def test_deepspeed_json_contradicting_the_recipe_fails_at_start(tiny_setup, tmp_path):
    root, model_dir, data_file = tiny_setup
    ds_json = json.loads((REPO_ROOT / "configs" / "deepspeed" / "zero3.json").read_text())
    ds_json["gradient_clipping"] = 0.5
    bad = tmp_path / "zero3_clip.json"
    bad.write_text(json.dumps(ds_json))
    args = train_args(TINY_RECIPE, overrides(root, model_dir, data_file, "bad_json", deepspeed=bad))
    result = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        cwd=REPO_ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "gradient_clipping=0.5" in result.stderr and "optim.grad_clip" in result.stderr
    assert not (root / "bad_json").exists()
