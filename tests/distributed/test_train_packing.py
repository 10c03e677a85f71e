"""Packed training on 2 ZeRO-3 processes equals unpacked training in 1: same loss, grad norm and weights.

The packed run packs each rank's 4 samples per step into micro-batches of at most 96 tokens (samples of
43-50 tokens: rows of 1 or 2 samples, 2 or 3 per rank in step 1, so one rank splits a micro-batch to run as
many forwards as the other and DeepSpeed is told the accumulation boundary), prepares steps in a
data-loader worker process, and relies on the sdpa block-diagonal mask transformers builds from the
restarting position ids (rows of 2 samples would see each other without it). The reference: one process,
one padded micro-batch of all 8 samples. Plain cross-entropy (see test_train_normalization.py for why):
its gradient does not depend on how a step is split. Two steps, so the second runs on weights the first
packed step produced. The checkpoint after step 1 must record 8 consumed samples, not what the worker had
already prefetched (resume exactness).
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.training_runs import (
    run_together,
    run_training,
    train_metrics,
    write_mixed_arithmetic_data,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def pretrained_tiny_model(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("packing")
    folder = build_tiny_model_folder("qwen2_vl", root / "model")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    data_file = write_mixed_arithmetic_data(root / "data", n=16, image_size=56, seed=1)
    return root, folder, data_file


def train(root, model_dir, data_file, name: str, nproc: int, extra: dict) -> dict:
    out = root / name
    overrides = {
        "output_dir": out,
        "model.name_or_path": model_dir,
        "model.init": "pretrained",
        "model.dtype": "float32",
        "model.attn_implementation": "sdpa",
        "data.train_file": data_file,
        "data.eval_file": "",
        "data.max_seq_len": 96,
        "data.shuffle": "false",
        "loss.name": "ce",
        "optim.name": "adamw_torch",
        "optim.lr": 0.1,
        "optim.eps": 1.0,  # Adam's step ~ lr * g: the weights check the gradient itself
        "optim.grad_clip": 0.0,
        "optim.warmup_steps": 0,
        "train.max_steps": 2,
        "train.global_batch_size": 8,
        "train.save_every": 1,
        "train.keep_last": 2,
        "train.export_at_end": "true",
        "tracking.enabled": "false",
        **extra,
    }
    result = run_training(overrides, nproc=nproc)
    assert result.returncode == 0, result.stdout[-6000:]
    return {
        "out": out,
        "metrics": train_metrics(out),
        "weights": load_file(out / "export" / "model.safetensors"),
    }


@pytest.mark.timeout(1200)
def test_packed_two_ranks_equal_unpacked_one_process(pretrained_tiny_model):
    root, model_dir, data_file = pretrained_tiny_model
    packing = {"train.micro_batch_size": 1, "data.max_tokens_per_micro_batch": 96, "data.num_workers": 1}
    runs = run_together(
        {
            "unpacked": partial(
                train, root, model_dir, data_file, "unpacked", 1, {"train.micro_batch_size": 8}
            ),
            "packed": partial(train, root, model_dir, data_file, "packed", 2, packing),
        }
    )
    reference, packed = runs["unpacked"], runs["packed"]
    # packing happened: 4 samples of 43-50 tokens per rank make rows of 1 or 2 under the 96-token budget,
    # 2 or 3 forwards (ignored, micro_batch_size=1 would make 4); the reference takes 1 of 8 samples
    assert packed["metrics"][1]["micro_batches"] in (2, 3)
    assert [reference["metrics"][step]["micro_batches"] for step in (1, 2)] == [1, 1]
    for step in (1, 2):
        got, want = packed["metrics"][step], reference["metrics"][step]
        assert got["labelled_tokens"] == want["labelled_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    initial = load_file(model_dir / "model.safetensors")
    moved = 0
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(packed["weights"][name], weight, rtol=1e-4, atol=1e-6, msg=name)
        moved += int(not torch.equal(weight, initial[name]))
    assert moved > len(initial) // 2

    state = json.loads((packed["out"] / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["sampler"]["consumed_samples"] == 8
