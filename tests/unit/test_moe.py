"""Mixture-of-experts parts: the router and expert parameters by name, the expert modules found from the
loaded model (what the engine makes ZeRO-3 leaf modules), and a MoE model without any refused at start."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from ntil_ds.config import ConfigError
from ntil_ds.engine import set_expert_leaf_modules
from ntil_ds.model.parts import expert_modules, moe_part, num_experts
from ntil_ds.tiny import build_tiny_model_folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    built = {}
    for kind in ("qwen3_vl_moe", "qwen3_vl"):
        config = AutoConfig.from_pretrained(build_tiny_model_folder(kind, root / kind))
        torch.manual_seed(0)
        built[kind] = AutoModelForImageTextToText.from_config(config)
    return built


def test_router_and_expert_parameters_by_name(models):
    model = models["qwen3_vl_moe"]
    parts = {name: moe_part(name) for name, _ in model.named_parameters()}
    layers = model.config.text_config.num_hidden_layers
    # written out independently of parts.py: transformers 5.24's names for Qwen3-VL-MoE's MoE block
    routers = {f"model.language_model.layers.{i}.mlp.gate.weight" for i in range(layers)}
    experts = {
        f"model.language_model.layers.{i}.mlp.experts.{w}"
        for i in range(layers)
        for w in ("gate_up_proj", "down_proj")
    }
    assert {n for n, p in parts.items() if p == "router"} == routers
    assert {n for n, p in parts.items() if p == "experts"} == experts
    assert all(moe_part(n) is None for n, _ in models["qwen3_vl"].named_parameters())


def test_expert_modules_are_found_from_the_model(models):
    model = models["qwen3_vl_moe"]
    assert num_experts(model.config) == 4 and num_experts(models["qwen3_vl"].config) == 0
    found = expert_modules(model)
    assert found == [layer.mlp.experts for layer in model.model.language_model.layers]
    assert expert_modules(models["qwen3_vl"]) == []
    # Under ZeRO-3 a parameter is an empty placeholder; its full shape is in ds_shape.
    placeholder = torch.nn.Module()
    placeholder.config = model.config
    placeholder.w = torch.nn.Parameter(torch.empty(0))
    placeholder.w.ds_shape = torch.Size([4, 48, 64])
    assert expert_modules(placeholder) == [placeholder]


def test_leaf_modules_set_from_the_model_and_a_moe_without_experts_refused(models, tmp_path):
    model = models["qwen3_vl_moe"]
    classes = set_expert_leaf_modules(model)
    assert [c.__name__ for c in classes] == ["Qwen3VLMoeTextExperts"]
    flagged = [m for m in model.modules() if getattr(m, "_z3_leaf", False)]
    assert flagged == expert_modules(model)
    assert set_expert_leaf_modules(models["qwen3_vl"]) == []  # dense: nothing to mark, no error

    # A MoE config whose experts are per-expert Linear modules (no 3-D weights): refused, never a warning.
    config = AutoConfig.from_pretrained(build_tiny_model_folder("qwen3_vl_moe", tmp_path / "moe"))
    other = AutoModelForImageTextToText.from_config(config)
    for layer in other.model.language_model.layers:
        layer.mlp.experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    with pytest.raises(ConfigError, match="mixture of experts .* no module holds 3-D expert weights"):
        set_expert_leaf_modules(other)
