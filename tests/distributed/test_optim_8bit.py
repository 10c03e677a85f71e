"""optim.name=adamw_8bit: bitsandbytes' AdamW8bit as DeepSpeed's client optimizer under ZeRO-3.

A real 2-process job of launch/train.py on a tiny Qwen2 LLM: the loss must fall, and the optimizer
state in the checkpoint it writes at the end must really be 8-bit (uint8 moments), not a silent
fall-back to 32-bit AdamW.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.tiny_llm import tiny_qwen2_folder, write_sum_data
from tests.distributed.training_runs import run_training, train_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8


def _tensors(tree: object):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


@pytest.mark.timeout(420)
def test_adamw_8bit_trains_under_zero3(tmp_path):
    model = tiny_qwen2_folder(tmp_path / "tiny-qwen2")
    data = write_sum_data(tmp_path / "data" / "train.jsonl", n=64)
    out = tmp_path / "run"
    result = run_training(
        {
            "model.name_or_path": model,
            "model.kind": "llm",
            "model.dtype": "float32",
            "data.train_file": data,
            "data.eval_file": "",
            "optim.name": "adamw_8bit",
            "optim.warmup_steps": 0,
            "train.max_steps": STEPS,
            "train.micro_batch_size": 2,
            "train.global_batch_size": 8,  # 2 ranks x 2 x 2 accumulation steps
            "train.save_every": 0,  # the trainer still checkpoints at the end
            "train.export_at_end": "false",
            "tracking.enabled": "false",
            "resume": "none",
            "output_dir": out,
        },
        timeout=360,
    )
    assert result.returncode == 0, result.stdout[-4000:]

    losses = [record["loss"] for _, record in sorted(train_metrics(out).items())]
    assert len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses

    optim_files = sorted(out.glob("checkpoints/step_*/*optim_states.pt"))
    assert len(optim_files) == 2, optim_files  # one ZeRO partition per rank
    for path in optim_files:
        state = torch.load(path, map_location="cpu", weights_only=False)
        dtypes = {t.dtype for t in _tensors(state)}
        assert torch.uint8 in dtypes, f"{path.name}: no 8-bit optimizer state, dtypes {dtypes}"
