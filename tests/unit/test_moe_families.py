"""Qwen3.5-MoE and GLM-4.5V's tiny folders: their parts by name (vision tower, projector, language model,
router, experts; the names written out here from transformers 5.24's modules, independently of
parts.py), the expert modules found from the model (GLM's dense first layer has none), and GLM-4.5V's
tokenizer grouping digits so that build_loss picks the grouped NTIL loss."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from ntil_ds.config import load_config
from ntil_ds.loss.build import build_loss
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.model.parts import expert_modules, model_part, moe_part, num_experts
from ntil_ds.tiny import build_tiny_model_folder

# kind: (its sparse layers, the shared expert's name, the projector's prefix)
FAMILIES = {
    "qwen3_5_moe": ((0, 1), "shared_expert", "model.visual.merger."),
    "glm4v_moe": ((1,), "shared_experts", "model.visual.merger."),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_families")
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in FAMILIES}


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_parts_router_and_experts_by_name(folders, kind):
    sparse, shared, projector = FAMILIES[kind]
    config = AutoConfig.from_pretrained(folders[kind])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    names = [n for n, _ in model.named_parameters()]
    layers = "model.language_model.layers"
    routers = {f"{layers}.{i}.mlp.gate.weight" for i in sparse}
    experts = {f"{layers}.{i}.mlp.experts.{w}" for i in sparse for w in ("gate_up_proj", "down_proj")}
    assert {n for n in names if moe_part(n) == "router"} == routers
    assert {n for n in names if moe_part(n) == "experts"} == experts
    # the shared expert is a dense MLP of the language model, neither router nor experts
    assert any(f".mlp.{shared}." in n for n in names)
    assert all(moe_part(n) is None for n in names if f".mlp.{shared}" in n)
    assert num_experts(config) == 4
    assert expert_modules(model) == [model.model.language_model.layers[i].mlp.experts for i in sparse]
    parts = {n: model_part(n) for n in names}
    assert {p for n, p in parts.items() if n.startswith(projector)} == {"projector"}
    assert {p for n, p in parts.items() if n.startswith("model.visual.blocks.")} == {"vision_tower"}
    assert {p for n, p in parts.items() if n.startswith("model.language_model.")} == {"language_model"}
    assert parts["lm_head.weight"] == "language_model"


def test_glm45v_tokenizer_groups_digits_and_trains_with_the_grouped_loss(folders):
    tokenizer = AutoTokenizer.from_pretrained(folders["glm4v_moe"])
    ids = tokenizer("x=12345,07", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in ids] == ["x", "=", "123", "45", ",", "07"]
    cfg = load_config(None, [f"model.name_or_path={folders['glm4v_moe']}", "data.train_file=x"])
    assert isinstance(build_loss(cfg, tokenizer), GroupedNTILLoss)
    qwen = AutoTokenizer.from_pretrained(folders["qwen3_5_moe"])  # Qwen's digits stay single
    assert not isinstance(build_loss(cfg, qwen), GroupedNTILLoss)
