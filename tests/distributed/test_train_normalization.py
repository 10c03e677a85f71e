"""Loss normalization parity: 1 process with the whole batch == 2 ranks x 2 micro-batches.

The trainer divides the step's summed loss by the step's global labelled-token count and undoes
DeepSpeed's division by gradient_accumulation_steps and its averaging over data-parallel ranks. If any
of the three were wrong, the 2x2 run's gradient would be off by a factor (or by a different weighting of
the samples, which have different answer lengths) and so would its grad norm and updated weights.

Why plain cross-entropy here: NTIL's sequence-level terms are means over the sequences of a micro-batch
and its rescale factor CE/NTIL is per micro-batch (as in the paper), so NTIL's gradient legitimately
depends on how a batch is split into micro-batches; cross-entropy's must not.
Why optim.eps=1: Adam's first step is lr * g / (|g| + eps). With the usual tiny eps that is ~lr * sign(g),
blind to a wrong gradient scale; with eps=1 it is ~lr * g, so the weights check the gradient itself.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.training_runs import run_training, train_metrics, write_mixed_arithmetic_data

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def pretrained_tiny_model(tmp_path_factory):
    """A tiny Qwen2-VL with saved random weights: both runs start from the very same parameters."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("parity")
    folder = build_tiny_model_folder("qwen2_vl", root / "model")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    data_file = write_mixed_arithmetic_data(root / "data", n=8, image_size=56, seed=1)
    return root, folder, data_file


def one_step(root, model_dir, data_file, name: str, nproc: int, micro_batch_size: int) -> dict:
    out = root / name
    overrides = {
        "output_dir": out,
        "model.name_or_path": model_dir,
        "model.init": "pretrained",
        "model.dtype": "float32",
        "data.train_file": data_file,
        "data.eval_file": "",
        "data.max_seq_len": 128,
        "data.shuffle": "false",
        "loss.name": "ce",
        "optim.name": "adamw_torch",
        "optim.lr": 0.1,
        "optim.eps": 1.0,
        "optim.grad_clip": 0.0,  # clipping would normalize the very scale under test
        "optim.warmup_steps": 0,
        "train.max_steps": 1,
        "train.micro_batch_size": micro_batch_size,
        "train.global_batch_size": 4,
        "train.save_every": 0,
        "train.export_at_end": "true",
        "tracking.enabled": "false",
    }
    result = run_training(overrides, nproc=nproc)
    assert result.returncode == 0, result.stdout[-6000:]
    return {"metrics": train_metrics(out)[1], "weights": load_file(out / "export" / "model.safetensors")}


@pytest.mark.timeout(1200)
def test_two_ranks_two_micro_batches_equal_one_process_full_batch(pretrained_tiny_model):
    root, model_dir, data_file = pretrained_tiny_model
    initial = load_file(model_dir / "model.safetensors")
    single = one_step(root, model_dir, data_file, "single", nproc=1, micro_batch_size=4)
    split = one_step(root, model_dir, data_file, "split", nproc=2, micro_batch_size=1)

    assert split["metrics"]["labelled_tokens"] == single["metrics"]["labelled_tokens"]
    assert split["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-6)
    assert split["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-5)
    assert single["weights"].keys() == initial.keys()  # the export uses the checkpoint's own names
    moved = 0
    for name, reference in single["weights"].items():
        torch.testing.assert_close(split["weights"][name], reference, rtol=1e-5, atol=1e-7, msg=name)
        moved += int(not torch.equal(reference, initial[name]))
    assert moved > len(initial) // 2  # the step did update the weights it compares
