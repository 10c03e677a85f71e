"""LoRA wiring on one process: which layers get adapters per family, what trains, the merge against
peft's own merge_and_unload, and clear errors for recipes that cannot work."""

import pytest
import torch
from torch import nn

from ntil_ds.config import ConfigError, load_config
from ntil_ds.export import merged_state_dict, save_lora_export
from ntil_ds.model import load_model, model_part
from ntil_ds.tiny import build_tiny_model_folder

KINDS = (
    "qwen2_vl",
    "llava",
    "qwen3_vl",
    "gemma3",
    "internvl",
    "smolvlm",
    "qwen2",
    "mllama",
    "glm4v",
    "mistral3",
)


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
    # 2 layers x 7 projections x (A, B); GLM-4's MLP fuses gate_up_proj, which the default
    # target_modules do not name (a GLM-4.1V LoRA recipe adds gate_up_proj): 5 projections
    assert len(adapters) == 2 * (5 if kind == "glm4v" else 7) * 2, adapters
    assert kind == "qwen2" or all(model_part(n) == "language_model" for n in adapters), adapters
    full = {n.split(".modules_to_save.")[0] for n in trainable if "lora_" not in n}
    expected = {"base_model.model.lm_head"}
    if kind in ("qwen2_vl", "glm4v"):  # (GLM-4.1V's downsample conv and blocks stay with the frozen tower)
        expected.add("base_model.model.model.visual.merger")
    elif kind == "qwen3_vl":
        expected |= {
            "base_model.model.model.visual.merger",
            "base_model.model.model.visual.deepstack_merger_list.0",
        }
    elif (
        kind in ("llava", "internvl", "mllama", "mistral3")
    ):  # (Mllama: the cross-attention layer is adapted too)  # (InternVL's vision tower has q/k/v_proj too: never adapted)
        expected.add("base_model.model.model.multi_modal_projector")
    elif kind == "smolvlm":  # (SigLIP's q/k/v_proj in model.vision_model: never adapted)
        expected.add("base_model.model.model.connector")
    elif kind == "gemma3":  # tied embeddings: one trained matrix, the embedding's copy, shared by the head
        expected = {
            "base_model.model.model.language_model.embed_tokens",
            "base_model.model.model.multi_modal_projector",
        }
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


def test_qlora_loads_the_language_model_in_4bit_and_trains_the_adapters_on_cpu(folders, tmp_path):
    """bitsandbytes' nf4 runs on CPU: quantize at load, 4-bit forward, backward into the adapters. Exactly
    the language model's linear layers are 4-bit (the head, projector and vision tower train or are small:
    16-bit); the dequantized weights are checked against the originals (nf4's error is a few % of the
    block's largest value). The merged export is a plain model that computes what the 4-bit model with
    its adapters computes."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folders["qwen2_vl"])
    original = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    original.save_pretrained(tmp_path / "weights")
    model = _load(
        tmp_path / "weights",
        "model.init=pretrained",
        "model.dtype=float32",
        "lora.quantize=nf4",
        "lora.dropout=0.0",
        "lora.merge_on_export=true",
        "model.freeze_projector=false",
    )
    linear = {
        n.removeprefix("base_model.model."): m for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    four_bit = {n for n, m in linear.items() if isinstance(m, bnb.nn.Linear4bit)}
    # The reference: by where the layer sits (model_part), not by the rule under test.
    language = {
        n.removesuffix(".base_layer")
        for n in linear
        if model_part(f"{n}.weight") == "language_model" and ".lora_" not in n and "lm_head" not in n
    }
    assert {n.removesuffix(".base_layer") for n in four_bit} == language and len(language) == 14
    layer = model.base_model.model.model.language_model.layers[0].self_attn.q_proj
    assert layer.base_layer.weight.quant_state.quant_type == "nf4"
    restored = bnb.functional.dequantize_4bit(
        layer.base_layer.weight.data, layer.base_layer.weight.quant_state
    )
    reference = original.model.language_model.layers[0].self_attn.q_proj.weight
    error = (restored.float() - reference.float()).abs()
    assert error.max() < 0.15 * reference.abs().max() and error.mean() < 0.03 * reference.abs().max()
    assert not torch.equal(restored, reference)  # it really is 4-bit

    ids = torch.randint(0, 400, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    # (no image here: the projector gets no gradient)
    assert any("merger.modules_to_save" in n for n in trained)
    grads = {n: g for n, g in trained.items() if "visual" not in n}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any("lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())
    assert any("lm_head.modules_to_save" in n and g.abs().sum() > 0 for n, g in grads.items())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "base_layer" in n)

    # The merged export: dequantized base + B A (alpha / r), loaded by plain transformers without bitsandbytes.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)  # (B starts at zero)
        expected = model.eval()(input_ids=ids).logits
    save_lora_export(model, model.state_dict(), tmp_path / "export")
    assert model.get_base_model().hf_quantizer is not None  # (the training model is left as it was)
    merged, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export" / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    assert getattr(merged.config, "quantization_config", None) is None
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    with torch.no_grad():
        # (bitsandbytes' CPU 4-bit matmul rounds its inputs to bf16: equal to its precision)
        got = merged.eval()(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * expected.abs().max().item())
        moved = (expected - original.eval()(input_ids=ids).logits).abs().max()
        assert moved > 0.2 * expected.abs().max()  # the adapters mattered
    # Exactly the dequantized weight plus the adapter, layer by layer.
    q_proj = model.base_model.model.model.language_model.layers[0].self_attn.q_proj
    want = bnb.functional.dequantize_4bit(q_proj.base_layer.weight.data, q_proj.base_layer.weight.quant_state)
    want = want + 2.0 * q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight  # alpha/r = 2
    torch.testing.assert_close(merged.model.language_model.layers[0].self_attn.q_proj.weight, want)


@pytest.mark.parametrize("kind", KINDS)
def test_qlora_quantizes_exactly_the_language_models_linear_layers(folders, kind):
    """The rule the 4-bit load follows (transformers' skip patterns), for every family's real module
    names, against where each layer sits."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from ntil_ds.model.quantize import is_quantized_linear, quantization_kwargs

    cfg = _cfg(folders[kind], "model.init=pretrained", "lora.quantize=nf4")
    config = AutoConfig.from_pretrained(folders[kind])
    has_vision = getattr(config, "vision_config", None) is not None
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if has_vision else AutoModelForCausalLM).from_config(config)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    expected = {
        n
        for n in names
        if not n.endswith("lm_head") and (not has_vision or model_part(f"{n}.weight") == "language_model")
    }
    assert {n for n in names if is_quantized_linear(n, cfg.lora)} == expected
    assert expected and (not has_vision or len(expected) < len(names) - 1)  # some vision layers stay 16-bit
    # ZeRO-3 places the weights itself (transformers refuses a device_map there); without it, the model
    # is quantized straight onto the training device.
    assert "device_map" not in quantization_kwargs(cfg.model, cfg.lora, device=None, partitioned=True)
    assert quantization_kwargs(cfg.model, cfg.lora, device=None)["device_map"] == {"": "cpu"}
