"""LoRA / QLoRA, AutoTP and the experts implementation on mixture-of-experts models, one process: what
trains with adapters on attention only and with ``lora.experts=true`` (peft's adapters on the fused
experts' 3-D weights), the merged export reloading as a plain model, the experts' implementation, and
the recipes refused at start."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from ntil_ds.config import ConfigError, load_config
from ntil_ds.export import save_lora_export
from ntil_ds.model import load_model
from ntil_ds.model.experts import resolve_experts_implementation
from ntil_ds.model.parts import moe_part
from ntil_ds.tiny import build_tiny_model_folder

MOE_KINDS = ("qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe")
LAYERS, ATTENTION = 2, ("q_proj", "k_proj", "v_proj", "o_proj")
# Per family: (full-attention layers, MoE layers, shared-expert adapter tensors, routed-expert adapter
# tensors without lora.experts). Qwen3.5-MoE: layer 0 is Gated DeltaNet (no q/k/v/o) and the default
# targets gate/up/down_proj reach each layer's dense shared expert (3 x 2 layers, A and B). GLM-4.5V:
# layer 0 dense (first_k_dense_replace=1) and peft remaps gate/up/down_proj onto the routed experts even
# without lora.experts (docs/models.md, "LoRA targets on GLM-4.5V"; its recipe targets attention only).
SHAPE = {"qwen3_vl_moe": (2, 2, 0, 0), "qwen3_5_moe": (1, 2, 12, 0), "glm4v_moe": (2, 1, 0, 4)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_lora_moe")
    folders = {}
    for kind in MOE_KINDS:  # pretrained weights: QLoRA quantizes at load
        folder = build_tiny_model_folder(kind, root / kind)
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
        folders[kind] = folder
    folders["qwen2_vl"] = build_tiny_model_folder("qwen2_vl", root / "qwen2_vl")
    return folders


def _cfg(folder, *overrides):
    return load_config(
        None,
        [
            f"model.name_or_path={folder}",
            "model.init=pretrained",
            "model.dtype=float32",
            "data.train_file=x",
            "lora.enabled=true",
            "lora.dropout=0.0",
            "lora.r=2",
            "lora.alpha=6",
            "model.freeze_vision_tower=true",
            "model.freeze_projector=true",
            *overrides,
        ],
    )


def _load(folder, *overrides):
    cfg = _cfg(folder, *overrides)
    torch.manual_seed(0)
    return load_model(cfg.model, lora=cfg.lora)


def _grads(model):
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("experts", [False, True])
def test_what_trains_attention_adapters_and_on_request_the_experts(folders, kind, experts):
    model = _load(folders[kind], f"lora.experts={str(experts).lower()}").model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    attention = {n for n in trainable if "lora_" in n and n.split(".")[-4] in ATTENTION}
    expert_adapters = {
        n for n in trainable if "lora_" in n and moe_part(n.replace(".base_layer", "")) == "experts"
    }
    # Dense-named MLP projections do not exist in a MoE layer: attention's 4 per layer, A and B each.
    attention_layers, moe_layers, shared, remapped = SHAPE[kind]
    assert len(attention) == attention_layers * 4 * 2, sorted(trainable)
    # With lora.experts: each MoE layer's gate_up_proj and down_proj, one A and one B each.
    assert len(expert_adapters) == (moe_layers * 2 * 2 if experts else remapped), sorted(trainable)
    shared_adapters = {n for n in trainable if "lora_" in n and ".shared_expert." in n}
    assert len(shared_adapters) == shared, sorted(shared_adapters)
    head = {n for n in trainable if "lm_head.modules_to_save" in n}
    assert trainable == attention | expert_adapters | shared_adapters | head, sorted(
        trainable - attention - expert_adapters - shared_adapters - head
    )
    # The routers and the experts' own weights stay frozen; every trained tensor gets a gradient.
    frozen_moe = [
        n for n, p in model.named_parameters() if moe_part(n.replace(".base_layer", "")) and "lora_" not in n
    ]
    assert frozen_moe and not any(model.get_parameter(n).requires_grad for n in frozen_moe)
    grads = _grads(model)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # lora_A of each expert adapter gets its gradient through B (zero at start): the B's.
    assert all(grads[n].abs().sum() > 0 for n in expert_adapters if "lora_B" in n)
    assert all(model.get_parameter(n).grad is None for n in frozen_moe)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_merged_export_with_expert_adapters_reloads_as_a_plain_model(folders, kind, tmp_path):
    model = _load(folders[kind], "lora.experts=true", "lora.merge_on_export=true").model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)  # (B starts at zero)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    save_lora_export(model, model.state_dict(), tmp_path / "export")
    merged, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export" / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    base = AutoModelForImageTextToText.from_pretrained(folders[kind], dtype=torch.float32)
    with torch.no_grad():
        got = merged.eval()(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert (expected - base.eval()(input_ids=ids).logits).abs().max() > 0.01  # the adapters mattered
    if kind == "glm4v_moe":  # peft's remapped GLM adapter fuses gate's and up's ranks: not the layout below
        return
    # One expert weight against the formula written out: expert e's delta is B_e A_e (alpha / r = 3).
    wrapper = model.base_model.model.model.language_model.layers[1].mlp.experts
    inner = wrapper.base_layer if wrapper.parameter_name == "down_proj" else wrapper
    a, b = inner.lora_A["default"].weight, inner.lora_B["default"].weight  # [r*E, in], [out, r*E]
    experts = 4
    want = base.model.language_model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    for e in range(experts):
        b_e = b.reshape(b.shape[0], 2, experts)[:, :, e]
        want[e] += 3.0 * b_e @ a.reshape(experts, 2, -1)[e]
    got_weight = merged.model.language_model.layers[1].mlp.experts.gate_up_proj
    torch.testing.assert_close(got_weight, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.experts=true", "lora.dropout=0.05"], "set lora.dropout=0"),
        (["lora.experts=true", "lora.quantize=nf4"], "bitsandbytes 4-bit covers linear layers only"),
        (["lora.experts=true", "lora.enabled=false"], "needs lora.enabled=true"),
        (["model.experts_implementation=loop"], "experts_implementation"),
    ],
)
def test_bad_moe_lora_recipes_are_refused_at_start(folders, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(folders["qwen3_vl_moe"], *overrides)


def test_expert_adapters_on_a_dense_model_are_refused(folders):
    with pytest.raises(ConfigError, match="has no experts"):
        _load(folders["qwen2_vl"], "model.init=random", "lora.experts=true")


def test_qlora_on_a_moe_model_quantizes_attention_and_keeps_the_experts_16bit(folders):
    """bitsandbytes' 4-bit layers replace nn.Linear only: attention goes to nf4 (the check after the load
    holds), the experts' 3-D weights stay float32 and frozen, the adapters on attention train on CPU."""
    import bitsandbytes as bnb

    model = _load(folders["qwen3_vl_moe"], "lora.quantize=nf4").model
    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == LAYERS * 4, four_bit
    experts = model.base_model.model.model.language_model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and not experts.gate_up_proj.requires_grad
    grads = _grads(model)
    assert any("q_proj.lora_B" in n and g.abs().sum() > 0 for n, g in grads.items())


def test_experts_implementation_is_resolved_per_device_and_each_computes_the_same(folders):
    assert resolve_experts_implementation("auto", torch.device("cpu")) == "grouped_mm"
    assert _load(folders["qwen2_vl"], "model.init=random", "lora.enabled=false").experts_implementation == ""
    losses, grads = {}, {}
    for impl in ("eager", "batched_mm", "grouped_mm", "auto"):
        loaded = _load(folders["qwen3_vl_moe"], "lora.enabled=false", f"model.experts_implementation={impl}")
        want = "grouped_mm" if impl == "auto" else impl
        assert loaded.experts_implementation == want
        assert loaded.model.config.text_config._experts_implementation == want
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
        out = loaded.model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses[impl] = out.loss.detach()
        grads[impl] = loaded.model.model.language_model.layers[0].mlp.experts.down_proj.grad
    for impl in ("batched_mm", "grouped_mm"):
        torch.testing.assert_close(losses[impl], losses["eager"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[impl], grads["eager"], rtol=1e-5, atol=1e-6)


def test_autotp_with_a_moe_model_is_refused_before_loading(folders):
    """Measured (DeepSpeed 0.19.8, 2 ranks, configs/deepspeed/zero3_autotp.json): deepspeed.initialize
    rejects Qwen3-VL-MoE's tensor-parallel plan ('moe_tp_experts', 'packed_colwise') after the full load;
    the load refuses it first, saying why and what to use. A dense model is not refused here."""
    autotp = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    cfg = _cfg(folders["qwen3_vl_moe"], "lora.enabled=false")
    with pytest.raises(ConfigError, match=r"autotp_size=2 with a mixture-of-experts model .*zero3.json"):
        load_model(cfg.model, ds_config=autotp)
    dense = _cfg(folders["qwen2_vl"], "model.init=random", "lora.enabled=false")
    assert load_model(dense.model, ds_config=autotp).experts_implementation == ""
