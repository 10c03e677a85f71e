"""LoRA and QLoRA on the real job: 2 CPU processes, DeepSpeed ZeRO-3 (and ZeRO-2), a tiny pretrained
Qwen2-VL folder, mixed text/image batches. Only adapters, the output head and the projector train;
checkpoints hold those and no frozen base; a killed job resumes to the same losses; the export is a peft
adapter that reloads onto the base, and a merged folder that loads with plain ``from_pretrained`` and
computes what the adapter does. QLoRA (4-bit nf4 base, bitsandbytes on CPU) with ``lora.head=number_rows``
(of the head only the digits' rows train, as a delta) trains under ZeRO-2 and ZeRO-3 and resumes after
a kill; its merged export is the dequantized base plus the adapters, and the base head plus the delta.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.distributed.test_train_zero3 import base_overrides
from tests.distributed.training_runs import (
    kill_after_checkpoint,
    run_together,
    run_training,
    tiny_model_and_data,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
LORA = {
    "model.init": "pretrained",  # the frozen base is read from the folder again on resume
    "lora.enabled": "true",
    "lora.r": 4,
    "lora.alpha": 8,
    "lora.dropout": 0.0,  # exact comparisons
    "lora.modules_to_save": "lm_head",
    "lora.merge_on_export": "true",
    "model.freeze_vision_tower": "true",
    "optim.lr": 1e-2,
}

QLORA = {
    **LORA,
    "lora.quantize": "nf4",
    "lora.head": "number_rows",  # (LoRA above keeps lora.modules_to_save=lm_head: the old spelling of full)
    "lora.modules_to_save": "",
    "train.max_steps": 4,
    "train.save_every": 2,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText

    root, model_dir, data_file = tiny_model_and_data(
        tmp_path_factory.mktemp("lora"), "qwen2_vl", n=48, image_size=56
    )
    torch.manual_seed(0)  # a "pretrained" base: random weights saved in the folder
    base = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    base.save_pretrained(model_dir)
    return root, model_dir, data_file


def _base_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)


def _trained(overrides: dict) -> tuple[Path, str]:
    """A job run to its end: its output folder and log."""
    result = run_training(overrides)
    assert result.returncode == 0, result.stdout[-6000:]
    return Path(str(overrides["output_dir"])), result.stdout


@pytest.fixture(scope="module")
def uninterrupted_jobs(setup):
    """The module's two uninterrupted jobs, run together: LoRA on ZeRO-3, and QLoRA on ZeRO-2."""
    root, model_dir, data_file = setup
    lora = {
        **base_overrides(model_dir, data_file, root / "uninterrupted"),
        **LORA,
        "train.export_at_end": "true",
    }
    qlora = {
        **base_overrides(model_dir, data_file, root / "qlora_zero2"),
        **QLORA,
        "deepspeed": "configs/deepspeed/zero2.json",
    }
    return run_together({"lora": partial(_trained, lora), "qlora_zero2": partial(_trained, qlora)})


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_jobs):
    return uninterrupted_jobs["lora"]


def _peft_reference(model_dir, export_dir, masters):
    """The trained PeftModel rebuilt on one process: the base from the model folder, the trained
    weights from DeepSpeed's fp32 masters (the checkpoint holds nothing else)."""
    from peft import LoraConfig, get_peft_model

    config = json.loads((export_dir / "adapter_config.json").read_text())
    peft_config = LoraConfig(
        r=config["r"],
        lora_alpha=config["lora_alpha"],
        target_modules=config["target_modules"],
        modules_to_save=config["modules_to_save"],
    )
    model = get_peft_model(_base_model(model_dir), peft_config, autocast_adapter_dtype=False)
    missing, unexpected = model.load_state_dict(masters, strict=False)
    assert not unexpected, unexpected
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(masters) and not trained & set(missing), sorted(trained ^ set(masters))
    return model.eval()


@pytest.mark.timeout(1200)
def test_lora_trains_only_adapters_head_and_projector(uninterrupted):
    out, log = uninterrupted
    assert "LoRA r=4" in log
    metrics = train_metrics(out)
    losses = [metrics[s]["loss"] for s in range(1, STEPS + 1)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.9 * losses[0], losses
    adapter = out / "export" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    saved = load_file(adapter)
    assert saved and all("lora_" in k or "lm_head" in k or "merger" in k for k in saved), sorted(saved)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in saved.items())  # B starts at 0: it trained
    assert not any("visual.blocks" in k or "embed_tokens" in k for k in saved)  # frozen parts stay out
    # The checkpoints hold what trains and its optimizer state, not a copy of the frozen base.
    checkpoint = out / "checkpoints" / f"step_{STEPS:08d}"
    model_states = sorted(checkpoint.glob("*model_states.pt"))
    assert len(model_states) == 2, sorted(checkpoint.parent.glob("*/*"))  # one per ZeRO-3 rank
    for states in model_states:
        content = torch.load(states, map_location="cpu", weights_only=False)
        assert content["module"] and all("lora_" in k or "modules_to_save" in k for k in content["module"])
        assert not content.get("frozen_param_fragments"), states.name


@pytest.mark.timeout(1200)
def test_lora_export_adapter_and_merged_model_reload(setup, uninterrupted):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ntil_ds.data import Collator, ConversationDataset, load_processor
    from ntil_ds.export import merged_state_dict

    _, model_dir, data_file = setup
    out = uninterrupted[0]
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{STEPS:08d}")
    reference = _peft_reference(model_dir, out / "export", masters)

    processor = load_processor(out / "export")
    dataset = ConversationDataset(data_file, processor, max_seq_len=128)
    batch = Collator(processor)([dataset[i] for i in (0, 1, 4, 8)])
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    with torch.no_grad():
        expected = reference(**inputs).logits

        # The adapter on the (unchanged) base weights, through peft's own loader.
        base = _base_model(model_dir)
        base_logits = base.eval()(**inputs).logits
        adapted = PeftModel.from_pretrained(base, out / "export").eval()  # (wraps base in place)
        assert torch.equal(adapted(**inputs).logits, expected)

        # The merged folder: plain transformers, no peft; equal up to the float order of W + s*B@A.
        merged, info = AutoModelForImageTextToText.from_pretrained(
            out / "export" / "merged", dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        torch.testing.assert_close(merged.eval()(**inputs).logits, expected, rtol=1e-5, atol=1e-5)
        assert (expected - base_logits).abs().max() > 1e-3  # the adapter mattered
    # The merge itself against an independent formula, on one layer.
    full = reference.state_dict()  # the base from the folder + the trained weights
    sd = merged_state_dict(full, scaling=8 / 4)
    prefix = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    a, b = masters[f"{prefix}.lora_A.default.weight"], masters[f"{prefix}.lora_B.default.weight"]
    want = full[f"{prefix}.base_layer.weight"] + 2.0 * torch.einsum("or,ri->oi", b, a)
    torch.testing.assert_close(sd["model.language_model.layers.0.self_attn.q_proj.weight"], want)


@pytest.mark.timeout(1500)
def test_killed_lora_job_resumes_to_the_same_losses(setup, uninterrupted):
    root, model_dir, data_file = setup
    reference = train_metrics(uninterrupted[0])
    out = root / "killed"
    overrides = {**base_overrides(model_dir, data_file, out), **LORA, "train.export_at_end": "true"}
    kill_after_checkpoint(overrides, 3, log_path=root / "killed.log")
    assert not (out / "checkpoints" / "step_00000006").exists()
    resumed = run_training(overrides)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from" in resumed.stdout
    metrics = train_metrics(out)
    for step in range(1, STEPS + 1):
        for key in ("loss", "ce", "grad_norm"):
            assert metrics[step][key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-7), (step, key)


@pytest.fixture(scope="module")
def qlora_zero2(uninterrupted_jobs):
    return uninterrupted_jobs["qlora_zero2"]


@pytest.mark.timeout(1200)
def test_qlora_trains_under_zero2_on_a_4bit_language_model(qlora_zero2, uninterrupted):
    out, log = qlora_zero2
    assert "QLoRA: 14 linear layers of the language model in 4-bit nf4" in log
    losses = [m["loss"] for _, m in sorted(train_metrics(out).items())]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    # The same first step as LoRA on the 16-bit base, up to nf4's rounding of the weights.
    lora_first = train_metrics(uninterrupted[0])[1]["loss"]
    assert losses[0] != lora_first and losses[0] == pytest.approx(lora_first, rel=0.02)


@pytest.mark.timeout(1500)
def test_killed_qlora_job_under_zero3_resumes_to_the_zero2_losses(setup, qlora_zero2):
    """ZeRO-3 partitions the packed 4-bit weights; killed after its step-2 checkpoint (no frozen base in
    it) and resumed, it computes what the uninterrupted ZeRO-2 job computed."""
    root, model_dir, data_file = setup
    out = root / "qlora_zero3"
    overrides = {**base_overrides(model_dir, data_file, out), **QLORA, "train.export_at_end": "true"}
    kill_after_checkpoint(overrides, 2, log_path=root / "qlora_killed.log")
    resumed = run_training(overrides)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from" in resumed.stdout and "QLoRA: 14 linear layers" in resumed.stdout
    reference = train_metrics(qlora_zero2[0])
    metrics = train_metrics(out)
    assert sorted(metrics) == [1, 2, 3, 4]
    for step in range(1, 5):
        for key in ("loss", "ce", "grad_norm"):
            assert metrics[step][key] == pytest.approx(reference[step][key], rel=1e-4), (step, key)
    # The step-2 checkpoint holds what trains (adapters, projector, the head's delta: no copy of the
    # head), and of the 4-bit base only bitsandbytes' small quantization-state entries (ignored on
    # load), not the packed weights.
    model_states = sorted((out / "checkpoints" / "step_00000002").glob("*model_states.pt"))
    assert len(model_states) == 2
    for states in model_states:
        content = torch.load(states, map_location="cpu", weights_only=False)
        trained = [
            k for k in content["module"] if "lora_" in k or "modules_to_save" in k or k.endswith(".delta")
        ]
        assert "base_model.model.lm_head.delta" in trained and not content.get("frozen_param_fragments")
        assert not any("lm_head.modules_to_save" in k for k in trained), states.name
        rest = set(content["module"]) - set(trained)
        assert all(".base_layer.weight." in k for k in rest), sorted(rest)[:5]  # quant-state entries only
    # The merged export is a plain 16-bit model: each 4-bit weight dequantized, plus B A (alpha / r) from
    # the exported adapter. The reference quantizes the folder's weight with bitsandbytes itself (nf4,
    # double quantization, blocks of 64: what the 4-bit load does) and dequantizes it.
    import bitsandbytes as bnb
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    merged, info = AutoModelForImageTextToText.from_pretrained(
        out / "export" / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()) and getattr(merged.config, "quantization_config", None) is None, info
    adapter = load_file(out / "export" / "adapter_model.safetensors")
    layer = "model.language_model.layers.1.mlp.down_proj"
    original = _base_model(model_dir).get_parameter(f"{layer}.weight").detach()
    packed, state = bnb.functional.quantize_4bit(
        original, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.float32
    )
    dequantized = bnb.functional.dequantize_4bit(packed, state)
    a = adapter[f"base_model.model.{layer}.lora_A.weight"].float()
    b = adapter[f"base_model.model.{layer}.lora_B.weight"].float()
    want = dequantized + 2.0 * (b @ a)  # alpha / r = 8 / 4
    assert (want - dequantized).abs().max() > 1e-4  # the adapter trained: leaving it out would show
    torch.testing.assert_close(merged.get_parameter(f"{layer}.weight"), want, rtol=1e-6, atol=1e-7)
    # The head: the folder's (16-bit) head with the trained delta added to the digits' rows, exactly.
    # The adapter carries the delta as peft's rank-k LoRA on lm_head: A the delta, B the rows' one-hot
    # columns; the rows are the digits the tokenizer spells (found here through the loss's lookup).
    from ntil_ds.data import load_processor, tokenizer_of
    from ntil_ds.loss import digit_token_ids_from_tokenizer

    rows = digit_token_ids_from_tokenizer(tokenizer_of(load_processor(model_dir)))
    delta = adapter["base_model.model.lm_head.lora_A.weight"]
    one_hot = adapter["base_model.model.lm_head.lora_B.weight"]
    assert torch.equal(one_hot[rows], torch.eye(len(rows))) and one_hot.sum() == len(rows)
    assert delta.shape == (len(rows), merged.config.text_config.hidden_size) and delta.abs().max() > 0
    head = _base_model(model_dir).lm_head.weight.detach().clone()
    head[rows] += delta
    assert torch.equal(merged.lm_head.weight, head)
