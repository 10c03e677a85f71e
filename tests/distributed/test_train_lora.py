"""LoRA on the real job: 2 CPU processes, DeepSpeed ZeRO-3 (and ZeRO-2), tiny Qwen2-VL, mixed text/image
batches. Only adapters, the output head and the projector train; a killed job resumes to the same losses;
the export is a peft adapter that reloads onto the base, and a merged folder that loads with plain
``from_pretrained`` and computes what the adapter does.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.distributed.test_train_zero3 import base_overrides
from tests.distributed.training_runs import (
    kill_after_checkpoint,
    run_training,
    tiny_model_and_data,
    train_metrics,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
LORA = {
    "lora.enabled": "true",
    "lora.r": 4,
    "lora.alpha": 8,
    "lora.dropout": 0.0,  # exact comparisons
    "lora.modules_to_save": "lm_head",
    "lora.merge_on_export": "true",
    "model.freeze_vision_tower": "true",
    "optim.lr": 1e-2,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_model_and_data(tmp_path_factory.mktemp("lora"), "qwen2_vl", n=48, image_size=56)


@pytest.fixture(scope="module")
def uninterrupted(setup):
    root, model_dir, data_file = setup
    out = root / "uninterrupted"
    overrides = {**base_overrides(model_dir, data_file, out), **LORA, "train.export_at_end": "true"}
    result = run_training(overrides)
    assert result.returncode == 0, result.stdout[-6000:]
    return out, result.stdout


def _peft_reference(model_dir, export_dir, masters):
    """The trained PeftModel rebuilt on one process from DeepSpeed's fp32 weights (frozen base included)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    config = json.loads((export_dir / "adapter_config.json").read_text())
    peft_config = LoraConfig(
        r=config["r"],
        lora_alpha=config["lora_alpha"],
        target_modules=config["target_modules"],
        modules_to_save=config["modules_to_save"],
    )
    model = get_peft_model(base, peft_config, autocast_adapter_dtype=False)
    missing, unexpected = model.load_state_dict(masters, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if "lora_" in k or "modules_to_save" in k], missing
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


@pytest.mark.timeout(1200)
def test_lora_export_adapter_and_merged_model_reload(setup, uninterrupted):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.data import Collator, ConversationDataset, load_processor
    from ntil_ds.model.lora import merged_state_dict

    _, model_dir, data_file = setup
    out = uninterrupted[0]
    masters = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{STEPS:08d}")
    reference = _peft_reference(model_dir, out / "export", masters)

    processor = load_processor(out / "export")
    dataset = ConversationDataset(data_file, processor, max_seq_len=128)
    batch = Collator(processor)([dataset[i] for i in (0, 1, 4, 8)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = reference(**inputs).logits

        # The adapter on the (unchanged) base weights, through peft's own loader.
        base_weights = {
            k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in masters.items()
            if "lora_" not in k and "modules_to_save" not in k
        }
        base_weights = {k.replace(".original_module.", "."): v for k, v in base_weights.items()}
        base = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        missing, unexpected = base.load_state_dict(base_weights, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
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
    sd = merged_state_dict(masters, scaling=8 / 4)
    prefix = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    a, b = masters[f"{prefix}.lora_A.default.weight"], masters[f"{prefix}.lora_B.default.weight"]
    want = masters[f"{prefix}.base_layer.weight"] + 2.0 * torch.einsum("or,ri->oi", b, a)
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


@pytest.mark.timeout(1200)
def test_lora_under_zero2(setup, tmp_path):
    _, model_dir, data_file = setup
    out = tmp_path / "zero2"
    overrides = {
        **base_overrides(model_dir, data_file, out),
        **LORA,
        "deepspeed": "configs/deepspeed/zero2.json",
        "train.max_steps": 3,
        "train.save_every": 0,
    }
    result = run_training(overrides)
    assert result.returncode == 0, result.stdout[-6000:]
    losses = [m["loss"] for _, m in sorted(train_metrics(out).items())]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
