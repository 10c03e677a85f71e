"""Loss normalization parity: 1 process with the whole batch == 2 ranks x 2 micro-batches, on ZeRO-3 and
ZeRO-2 (full fine-tuning: every step's loss and grad norm, the exported weights; ZeRO-2 also resumed
from its step-1 checkpoint to the same step 2 and export); and the hybrid-attention and MoE families
(Qwen3.5, Qwen3.5-MoE, GLM-4.5V) with NTIL and their aux loss, two samples a micro-batch.

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

import json
import shutil
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


STEPS = 2
ZERO2 = "configs/deepspeed/zero2.json"  # the tiny recipe's own is zero3.json


def run_steps(
    root, model_dir, data_file, name: str, nproc: int, micro_batch_size: int, logits: str, **extra: object
) -> dict:
    """STEPS steps of one job; its per-step metrics and exported weights."""
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
        "loss.logits": logits,
        "optim.name": "adamw_torch",
        "optim.lr": 0.1,
        "optim.eps": 1.0,
        "optim.grad_clip": 0.0,  # clipping would normalize the very scale under test
        "optim.warmup_steps": 0,
        "train.max_steps": STEPS,
        "train.micro_batch_size": micro_batch_size,
        "train.global_batch_size": 4,
        "train.save_every": 0,
        "train.export_at_end": "true",
        "tracking.enabled": "false",
        **extra,
    }
    result = run_training(overrides, nproc=nproc)
    assert result.returncode == 0, result.stdout[-6000:]
    return {
        "metrics": train_metrics(out),
        "weights": load_file(out / "export" / "model.safetensors"),
        "log": result.stdout,
        "out": out,
    }


def assert_same_training(run: dict, reference: dict, initial: dict) -> None:
    """Every step's labelled tokens, loss and grad norm, and every exported weight, as the reference's."""
    for step in range(1, STEPS + 1):
        got, want = run["metrics"][step], reference["metrics"][step]
        assert got["labelled_tokens"] == want["labelled_tokens"], step
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
    assert run["weights"].keys() == initial.keys()  # the export uses the checkpoint's own names
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(run["weights"][name], expected, rtol=1e-5, atol=1e-7, msg=name)


ZERO2_OPTIONS = {"deepspeed": ZERO2, "train.save_every": 1}
# Two ranks, one sample a micro-batch, the head only where the targets are (the default).
TWO_RANKS = {"nproc": 2, "micro_batch_size": 1, "logits": "labelled"}


@pytest.fixture(scope="module")
def layouts(pretrained_tiny_model):
    """The module's three first jobs, run together: the whole batch in one process with the logits
    everywhere (loss.logits=all, the reference), and two ranks of one sample a micro-batch with the head
    only where the targets are (the default) on ZeRO-3 and on ZeRO-2 (saving every step)."""
    root, model_dir, data_file = pretrained_tiny_model
    return run_together(
        {
            "single": partial(run_steps, root, model_dir, data_file, "single", 1, 4, "all"),
            "split": partial(run_steps, root, model_dir, data_file, "split", **TWO_RANKS),
            "zero2": partial(run_steps, root, model_dir, data_file, "zero2", **TWO_RANKS, **ZERO2_OPTIONS),
        }
    )


@pytest.mark.timeout(1200)
def test_two_ranks_two_micro_batches_equal_one_process_full_batch(pretrained_tiny_model, layouts):
    _, model_dir, _ = pretrained_tiny_model
    initial = load_file(model_dir / "model.safetensors")
    one_process_reference = layouts["single"]
    # The split run has the head only where the targets are: so this also pins the labelled head under
    # ZeRO-3 to the full logits.
    assert_same_training(layouts["split"], one_process_reference, initial)
    moved = sum(not torch.equal(w, initial[name]) for name, w in one_process_reference["weights"].items())
    assert moved > len(initial) // 2  # the steps did update the weights compared


@pytest.mark.timeout(1200)
def test_full_fine_tuning_on_zero2_equals_one_process_and_resumes_to_the_same_export(
    pretrained_tiny_model, layouts
):
    root, model_dir, data_file = pretrained_tiny_model
    initial = load_file(model_dir / "model.safetensors")
    zero2 = layouts["zero2"]
    assert json.loads((zero2["out"] / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    assert_same_training(zero2, layouts["single"], initial)

    # Resume: the step-2 checkpoint and the export gone, the job continues from step 1 (resume=auto).
    shutil.rmtree(zero2["out"] / "checkpoints" / f"step_{STEPS:08d}")
    shutil.rmtree(zero2["out"] / "export")
    resumed = run_steps(root, model_dir, data_file, "zero2", **TWO_RANKS, **ZERO2_OPTIONS)
    assert "resumed from" in resumed["log"] and "step_00000001" in resumed["log"], resumed["log"][-3000:]
    # The resumed job trained step 2 only: its step-1 record is the first job's (so step 2 and the export
    # are what the comparison checks).
    records = [json.loads(line) for line in (zero2["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 2]
    assert_same_training(resumed, zero2, initial)


# The hybrid-attention and mixture-of-experts families with the loss they train with: NTIL (grouped for
# GLM-4.5V, whose tokenizer groups digits), its noise off (the Gumbel draws are seeded per micro-batch
# index and rank, so they differ between the two layouts by design), 2 samples a micro-batch. NTIL's
# rescale factor and per-sequence means and the router's aux loss (a product of two means over a
# micro-batch's tokens) are statistics of a micro-batch: they agree only where the micro-batches hold the
# same samples. The sampler gives rank r of D the stream positions r, r+D, ...: 2 ranks train on (0, 2)
# and (1, 3) where one process reading the file in order would train on (0, 1) and (2, 3). So the one
# process reads the lines in the ranks' order (`ranks_order`): then every term must agree to float order.
# Cross-entropy's gradient does not depend on which samples share a micro-batch: in the file's own order,
# the aux loss's coefficient at 0, the loss, grad norm and weights still agree (Qwen3.5-MoE).
FAMILY_NTIL = {"loss.name": "ntil", "loss.gumbel_noise_scale": 0.0}
MICRO_BATCH, GLOBAL_BATCH, RANKS = 2, 4, 2


def ranks_order(data_file, out_name: str):
    """The data file with each step's lines in the order the ranks train on them: rank 0's positions of the
    step, then rank 1's, so one process's consecutive micro-batches are the ranks' micro-batches."""
    lines = data_file.read_text().splitlines()
    order = [
        step + rank + RANKS * i
        for step in range(0, len(lines), GLOBAL_BATCH)
        for rank in range(RANKS)
        for i in range(GLOBAL_BATCH // RANKS)
    ]
    path = data_file.with_name(out_name)
    path.write_text("\n".join(lines[i] for i in order) + "\n")
    return path


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "glm4v_moe"])
def test_hybrid_and_moe_families_on_two_zero3_ranks_equal_one_process(tmp_path, kind):
    """Qwen3.5 (Gated DeltaNet + full attention), Qwen3.5-MoE and GLM-4.5V (experts, aux loss at the
    family's coefficient) on mixed text/image batches, 2 samples a micro-batch: 2 ZeRO-3 ranks == one
    process on the same micro-batches, every step's loss, NTIL part, aux loss and grad norm, and every
    exported weight."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.tiny import build_tiny_model_folder

    folder = build_tiny_model_folder(kind, tmp_path / "model")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    initial = load_file(folder / "model.safetensors")
    data_file = write_mixed_arithmetic_data(tmp_path / "data", n=8, image_size=56, seed=1)
    as_ranks = ranks_order(data_file, "ranks_order.jsonl")
    jobs = [
        ("single", 1, as_ranks, "all", FAMILY_NTIL),
        ("split", 2, data_file, "labelled", FAMILY_NTIL),
    ]
    if kind == "qwen3_5_moe":
        # Cross-entropy without the aux loss, the file's own order on both sides (checked at the end).
        ce = {"loss.name": "ce", "model.router_aux_loss_coef": 0.0}
        jobs += [("ce_single", 1, data_file, "all", ce), ("ce_split", 2, data_file, "labelled", ce)]
    runs = run_together(
        {
            name: partial(run_steps, tmp_path, folder, data, name, nproc, MICRO_BATCH, logits, **options)
            for name, nproc, data, logits, options in jobs
        }
    )
    assert_same_training(runs["split"], runs["single"], initial)
    moe = kind != "qwen3_5"
    for step in range(1, STEPS + 1):
        got, want = runs["split"]["metrics"][step], runs["single"]["metrics"][step]
        assert got["micro_batches"] == 1 and want["micro_batches"] == 2, step
        assert got["ntil"] == pytest.approx(want["ntil"], rel=1e-6) and got["ntil"] > 0, step
        assert ("aux_loss" in got) == moe, sorted(got)
        if moe:
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-6) and got["aux_loss"] > 0, step
            assert got["experts_unused"] == want["experts_unused"], step
    assert ("ZeRO-3 leaf modules:" in runs["split"]["log"]) == moe
    moved = sum(not torch.equal(w, initial[name]) for name, w in runs["single"]["weights"].items())
    assert moved > len(initial) // 2  # the steps did update the weights compared
    # The 2-rank ZeRO-3 export loads with plain from_pretrained, no weight missing or unexpected, and holds
    # what was trained (these families' export is checked here, not in test_train_zero3.py's family list).
    exported, info = AutoModelForImageTextToText.from_pretrained(
        runs["split"]["out"] / "export", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    masters = get_fp32_state_dict_from_zero_checkpoint(
        str(runs["split"]["out"] / "checkpoints"), tag=f"step_{STEPS:08d}"
    )
    state = exported.state_dict()
    assert masters.keys() <= state.keys()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    if kind == "qwen3_5_moe":
        # Cross-entropy without the aux loss, the file's own order on both sides: other micro-batches, the
        # same gradient (the aux loss at the family's coefficient moves the weights by ~1e-7 here).
        assert_same_training(runs["ce_split"], runs["ce_single"], initial)
