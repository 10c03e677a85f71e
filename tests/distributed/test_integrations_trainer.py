"""NTIL through transformers.Trainer (ntil_ds.integrations.attach_ntil) == ntil-ds's own trainer, on 2 gloo
ranks of DeepSpeed ZeRO-3 each (the Trainer's own DeepSpeed integration on one side), the same batches,
gradient accumulation 2, 2 samples a micro-batch of ragged answer lengths: every step's loss, grad norm and
NTIL part (CE, EMD, REL, MAG) to float order. A tiny Qwen2 through the labelled head and a tiny Qwen2-VL
(mixed image/text micro-batches) through ``compute_loss_func`` on whole logits.

Why these catch a broken adapter: a wrong shift moves every target (the loss changes at once); a wrong
normalisation under accumulation or over ranks scales the gradient (grad norm, then step 2's loss); parts
that are not those of the step's micro-batches differ from ntil-ds's. Adam with eps=1 moves the weights by
~lr * g, so step 2 checks the gradient's scale, not only its sign.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ntil_ds.jobs import REPO_ROOT, TRAIN_SCRIPT, launcher_command
from tests.distributed.tiny_llm import tiny_qwen2_folder, write_sum_data
from tests.distributed.training_runs import (
    allreduce_workspaces_left,
    finish_training,
    launch_env,
    start_training,
    train_metrics,
    write_mixed_arithmetic_data,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, MICRO, ACCUMULATE, LR, EPS = 2, 2, 2, 1e-3, 1.0
HF_JOB = REPO_ROOT / "tests" / "distributed" / "hf_trainer_job.py"
ZERO3 = REPO_ROOT / "configs" / "deepspeed" / "zero3.json"


def saved_model(kind: str, root):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from ntil_ds.tiny import build_tiny_model_folder

    if kind == "qwen2":
        folder, model_class = tiny_qwen2_folder(root / kind), AutoModelForCausalLM
    else:
        folder, model_class = build_tiny_model_folder(kind, root / kind), AutoModelForImageTextToText
    torch.manual_seed(0)
    model_class.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("kind", "head"), [("qwen2", "labelled"), ("qwen2_vl", "logits")])
def test_trainer_with_ntil_on_zero3_equals_ntil_ds_trainer(tmp_path, kind, head):
    folder = saved_model(kind, tmp_path)
    samples = STEPS * ACCUMULATE * MICRO * 2
    if kind == "qwen2":
        data = write_sum_data(tmp_path / "data.jsonl", n=samples, seed=3)
    else:
        data = write_mixed_arithmetic_data(tmp_path / "data", n=samples, image_size=56, seed=1)
    reference, logged = tmp_path / "ntil_ds", tmp_path / "hf_log.json"
    # Both jobs at once (their start-ups overlap on 2 cores); both read the recipe's own ZeRO-3 JSON.
    ours = start_training(2, TRAIN_SCRIPT, {
        "output_dir": reference, "model.name_or_path": folder, "model.kind": "llm" if kind == "qwen2" else "mllm",
        "model.init": "pretrained", "model.dtype": "float32", "data.train_file": data, "data.eval_file": "",
        "data.max_seq_len": 128, "data.shuffle": "false", "loss.name": "ntil", "loss.gumbel_noise_scale": 0.0,
        "optim.name": "adamw_torch", "optim.lr": LR, "optim.eps": EPS, "optim.grad_clip": 0.0,
        "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0, "train.max_steps": STEPS,
        "train.micro_batch_size": MICRO, "train.global_batch_size": MICRO * ACCUMULATE * 2, "train.log_every": 1,
        "train.save_every": 0, "train.export_at_end": "false", "tracking.enabled": "false", "resume": "none",
        "deepspeed": ZERO3,
    }, launch_env())  # fmt: skip
    command = launcher_command("deepspeed", 2, HF_JOB, [
        "--model", str(folder), "--data", str(data), "--deepspeed-json", str(ZERO3), "--out", str(logged),
        "--head", head, "--micro", str(MICRO), "--accumulate", str(ACCUMULATE), "--steps", str(STEPS),
        "--lr", str(LR), "--eps", str(EPS)])  # fmt: skip
    theirs = subprocess.Popen(
        command,
        cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for job in (ours, theirs):
        code, output = finish_training(job)
        assert code == 0, output[-5000:]
    trainer_steps = [record for record in json.loads(logged.read_text()) if "loss" in record]
    assert [record["step"] for record in trainer_steps] == list(range(1, STEPS + 1))
    ours = train_metrics(reference)
    for record in trainer_steps:
        want = ours[record["step"]]
        for name in ("loss", "ce", "emd", "rel", "mag", "ntil"):
            assert record[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), (record["step"], name)
        assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record["step"]
    # DeepSpeed's CPU allreduce made a workspace per rank in /dev/shm; attach_ntil unlinked them (none outlives it)
    port = command[command.index("--master_port") + 1]
    assert not allreduce_workspaces_left(port)
