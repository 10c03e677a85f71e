"""LoRA wiring on one process: which layers get adapters per family, what trains, the merge against
peft's own merge_and_unload, and clear errors for recipes that cannot work."""

import pytest
import torch

from ntil_ds.config import ConfigError, load_config
from ntil_ds.model import load_model, model_part
from ntil_ds.model.lora import merged_state_dict
from ntil_ds.model.tiny import build_tiny_model_folder

KINDS = ("qwen2_vl", "llava", "qwen3_vl", "gemma3", "qwen2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_lora")
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in KINDS}


def _cfg(folder, *overrides):
    return load_config(
        None,
        [
            f"model.name_or_path={folder}",
            "model.init=random",
            "model.dtype=float32",
            "data.train_file=x",
            "lora.enabled=true",
            "model.freeze_vision_tower=true",
            *overrides,
        ],
    )


def _load(folder, *overrides):
    cfg = _cfg(folder, *overrides)
    torch.manual_seed(0)
    return load_model(cfg.model, lora=cfg.lora).model


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_go_on_the_language_model_only(folders, kind):
    model = _load(folders[kind])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapters = [n for n in trainable if "lora_" in n]
    # 2 layers x 7 projections x (A, B)
    assert len(adapters) == 2 * 7 * 2, adapters
    assert kind == "qwen2" or all(model_part(n) == "language_model" for n in adapters), adapters
    full = {n.split(".modules_to_save.")[0] for n in trainable if "lora_" not in n}
    expected = {"base_model.model.lm_head"}
    if kind in ("qwen2_vl",):
        expected.add("base_model.model.model.visual.merger")
    elif kind == "qwen3_vl":
        expected |= {"base_model.model.model.visual.merger", "base_model.model.model.visual.deepstack_merger_list.0"}
    elif kind == "llava":
        expected.add("base_model.model.model.multi_modal_projector")
    elif kind == "gemma3":  # tied embeddings: one trained matrix, the embedding's copy, shared by the head
        expected = {"base_model.model.model.language_model.embed_tokens", "base_model.model.model.multi_modal_projector"}
        head = model.base_model.model.lm_head.modules_to_save["default"].weight
        assert head is model.get_input_embeddings().modules_to_save["default"].weight
    assert full == expected
    frozen_vision = [n for n, p in model.named_parameters() if model_part(n) == "vision_tower"]
    assert kind == "qwen2" or frozen_vision
    assert not any(model.get_parameter(n).requires_grad for n in frozen_vision)


def test_frozen_projector_is_not_trained_and_all_linear_targets(folders):
    model = _load(folders["llava"], "model.freeze_projector=true", "lora.target_modules=all-linear")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any("multi_modal_projector" in n for n in trainable)
    assert len([n for n in trainable if "lora_A" in n]) == 2 * 7  # every linear layer of the LM, not lm_head


def test_merge_equals_peft_merge_and_unload(folders):
    model = _load(folders["qwen2_vl"], "lora.r=4", "lora.alpha=12")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.normal_(std=0.1)  # B starts at zero; make the adapter and the saved head matter
    ours = merged_state_dict(model.state_dict(), scaling=12 / 4)
    reference = model.merge_and_unload().state_dict()
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.freeze_vision_tower=false"], "set model.freeze_vision_tower=true"),
        (["lora.target_modules=nope"], "matches no linear layer"),
        (["lora.r=0"], "must be > 0"),
        (["lora.dropout=1.0"], r"must be in \[0, 1\)"),
        (["model.freeze_language_model=true"], "set model.freeze_language_model=false"),
    ],
)
def test_bad_lora_recipes_are_clear_errors(folders, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(folders["qwen2_vl"], *overrides)


def test_quantize_without_lora_is_an_error(folders):
    with pytest.raises(ConfigError, match="needs lora.enabled=true"):
        _cfg(folders["qwen2"], "lora.enabled=false", "lora.quantize=nf4")


def test_qlora_random_init_is_an_error(folders):
    with pytest.raises(ConfigError, match="set model.init=pretrained"):
        _cfg(folders["qwen2"], "lora.quantize=nf4")


def test_qlora_loads_4bit_base_weights_and_trains_the_adapters_on_cpu(folders, tmp_path):
    """bitsandbytes' nf4 runs on CPU: quantize at load, 4-bit forward, backward into the adapters. The
    dequantized weights are checked against the 16-bit originals (nf4's error is a few % of the block's
    largest value)."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["qwen2"]), dtype=torch.bfloat16)
    original.save_pretrained(tmp_path / "weights")
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tmp_path / 'weights'}",
            "model.init=pretrained",
            "model.dtype=bfloat16",
            "data.train_file=x",
            "lora.enabled=true",
            "lora.quantize=nf4",
            "lora.dropout=0.0",
        ],
    )
    model = load_model(cfg.model, lora=cfg.lora).model
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bnb.nn.Linear4bit)
    assert layer.base_layer.weight.quant_state.quant_type == "nf4"
    restored = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
    reference = original.model.layers[0].self_attn.q_proj.weight
    error = (restored.float() - reference.float()).abs()
    assert error.max() < 0.15 * reference.abs().max() and error.mean() < 0.03 * reference.abs().max()
    assert not torch.equal(restored, reference)  # it really is 4-bit

    ids = torch.randint(0, 400, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any("lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "base_layer" in n)


def test_qlora_under_deepspeed_is_refused_with_the_reason():
    from ntil_ds.model.lora import quantization_kwargs

    cfg = load_config(None, ["model.name_or_path=x", "data.train_file=x", "lora.enabled=true", "lora.quantize=nf4"])
    with pytest.raises(ConfigError, match="does not train under DeepSpeed"):
        quantization_kwargs(cfg.model, cfg.lora, under_deepspeed=True, device=None)
    assert quantization_kwargs(cfg.model, cfg.lora, under_deepspeed=False, device=None)["device_map"] == {"": "cpu"}
