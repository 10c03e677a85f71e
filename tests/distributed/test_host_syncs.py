"""One host sync per optimizer step and none per micro-batch: the trainer's promise, counted.

A real 2-rank ZeRO-3 job (tiny Qwen2-VL, mixed text/image data), 2 steps of 2 micro-batches per rank, run
under tests/distributed/sync_probe.py: every call of the one named reader (``ntil_ds.dist.read_to_host``)
and every aten op that waits for the device (``.item()``'s ``_local_scalar_dense``, ``nonzero``,
``masked_select`` ...) inside ``Trainer.train_step``, charged to the code that asked for it. The project's
code may read once per step, through the reader, and nowhere else. DeepSpeed's own checks inside its
optimizer step may not grow (its gradient-norm validity and overflow checks; in the first step ZeRO-3
also checks its parameter trace across ranks). The model's own (transformers' Qwen2-VL computes image
positions and the M-RoPE index with host reads) are printed, not asserted: they are the model family's.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.training_runs import (
    REPO_ROOT,
    launch_env,
    run_training,
    tiny_job_overrides,
    tiny_model_and_data,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROBE = REPO_ROOT / "tests" / "distributed" / "sync_probe.py"
# DeepSpeed 0.19.8's ZeRO-3 step after the first (constraints/cpu.txt pins the version), measured: the
# gradient-norm validity check and the gradient scaler's overflow flag. More is a new sync.
DEEPSPEED_SYNCS_PER_STEP = 2


@pytest.mark.timeout(600)
def test_one_host_sync_per_step_and_none_per_micro_batch(tmp_path):
    root, model_dir, data_file = tiny_model_and_data(tmp_path, "qwen2_vl", n=16, image_size=56)
    overrides = tiny_job_overrides(
        root / "run", model_dir, data_file, **{"train.max_steps": 2, "train.global_batch_size": 8}
    )
    report = tmp_path / "syncs.json"
    result = run_training(overrides, script=PROBE, env=launch_env(SYNC_REPORT=str(report)))
    assert result.returncode == 0, result.stdout[-6000:]
    for rank in (0, 1):
        steps = json.loads(report.with_suffix(f".rank{rank}.json").read_text())
        assert [s["micro_batches"] for s in steps] == [2, 2], steps
        for number, step in enumerate(steps, start=1):
            assert step["reads"] == {"read_to_host": 1}, step
            ours = {site: n for site, n in step["ops"].items() if "@ ntil_ds/" in site}
            assert not ours, f"rank {rank}: host syncs in the project's step code: {ours}"
            unattributed = {site: n for site, n in step["ops"].items() if site.endswith("@ other")}
            assert not unattributed, unattributed
            deepspeed = sum(n for site, n in step["ops"].items() if "@ deepspeed/" in site)
            if number > 1:
                assert deepspeed <= DEEPSPEED_SYNCS_PER_STEP, f"rank {rank}: {step['ops']}"
            model = sum(n for site, n in step["ops"].items() if "@ transformers/" in site)
            print(
                f"rank {rank} step {number}: 1 read of ours, {deepspeed} of DeepSpeed, {model} of the model"
            )
