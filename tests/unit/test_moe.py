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


# ----------------------------------------------------------------------------------------------------
# The router's aux loss and the experts' load (ntil_ds/moe.py)


def _text_batch(folder, tmp_path):
    import json

    from ntil_ds.data import Collator, ConversationDataset, load_processor
    from ntil_ds.data.batch import MicroBatch

    processor = load_processor(folder)
    lines = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in (("What is 12 + 30?", "42"), ("Add 7 and 5, then tell me the sum please.", "12"))
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = ConversationDataset(data, processor, max_seq_len=128)
    return MicroBatch([0, 1], Collator(processor, fake_image=False)([dataset[0], dataset[1]]))


def _grads(model, batch, terms):
    """Gradients of the summed CE over the targets, plus the aux term when ``terms`` is given."""
    model.zero_grad(set_to_none=True)
    inputs = batch.model_inputs(torch.device("cpu"), torch.float32)
    extra = terms.forward_kwargs if terms is not None else {}
    output = model(**inputs, use_cache=False, **extra)
    loss_sum = torch.nn.functional.cross_entropy(
        output.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="sum"
    )
    if terms is not None:
        terms.record(output, inputs["attention_mask"])
        loss_sum = terms.objective_sum(loss_sum, batch.num_targets)
    loss_sum.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, output


def _switch_aux(router_logits, mask, top_k, experts):
    """Switch Transformer's balance loss, written out: E * sum_e (share of top-k picks) * (mean prob),
    both over every MoE layer's unpadded tokens together (transformers' definition for this family)."""
    keep = mask.reshape(-1).bool()
    logits = torch.cat([layer[keep] for layer in router_logits])
    probs = logits.softmax(-1)
    picks = torch.nn.functional.one_hot(probs.topk(top_k, -1).indices, experts).sum(1).float()
    return experts * (picks.mean(0) * probs.mean(0)).sum()


def test_aux_loss_is_the_familys_and_reaches_only_what_feeds_a_router(models, tmp_path):
    from ntil_ds.moe import RouterTerms, router_terms_for

    folder = build_tiny_model_folder("qwen3_vl_moe", tmp_path / "moe")
    model = models["qwen3_vl_moe"].train()
    batch = _text_batch(folder, tmp_path)
    assert batch.tensors["attention_mask"].min() == 0  # padding: the loss and the load skip it
    without, _ = _grads(model, batch, None)

    family = router_terms_for(model, None)
    assert (family.coef, family.num_experts, family.top_k) == (0.001, 4, 2)
    assert router_terms_for(models["qwen3_vl"], 0.5) is None  # dense: no terms
    at_zero, output = _grads(model, batch, router_terms_for(model, 0.0))
    assert at_zero.keys() == without.keys()
    assert all(torch.equal(at_zero[n], without[n]) for n in without), "coef 0 changed a gradient"

    terms = RouterTerms(coef=0.5, num_experts=4, top_k=2)
    with_aux, output = _grads(model, batch, terms)
    mask = batch.tensors["attention_mask"]
    reference = _switch_aux(output.router_logits, mask, 2, 4)
    torch.testing.assert_close(terms.last_aux, reference, rtol=1e-6, atol=1e-7)
    assert terms.last_aux > 1.0 - 1e-6  # >= 1, equal only when perfectly balanced
    # The term differentiated: coef * aux * (the micro-batch's labelled tokens), which the trainer then
    # divides by the step's global count like the summed loss (the normalisation contract).
    model.zero_grad(set_to_none=True)
    inputs = batch.model_inputs(torch.device("cpu"), torch.float32)
    out = model(**inputs, use_cache=False, output_router_logits=True)
    ce_sum = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="sum"
    )
    aux = _switch_aux(out.router_logits, mask, 2, 4)
    (ce_sum + 0.5 * aux * int((batch.targets != -100).sum())).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(with_aux[name], param.grad, rtol=1e-5, atol=1e-8, msg=name)

    layers = model.model.language_model.layers
    last = len(layers) - 1
    changed = {n for n in without if not torch.equal(with_aux[n], without[n])}
    routers = {n for n in without if n.endswith("mlp.gate.weight")}
    assert routers and routers <= changed  # every router's weight
    # Nothing after the last router: the last layer's experts, the final norm, the head.
    after = {
        n
        for n in without
        if f"layers.{last}.mlp.experts." in n or n.startswith(("lm_head.", "model.language_model.norm."))
    }
    assert after and not (after & changed), after & changed
    # Before the routers it reaches the residual stream: the embeddings and the first attention.
    assert "model.language_model.embed_tokens.weight" in changed
    assert any(n.startswith("model.language_model.layers.0.self_attn.") for n in changed)
    assert not any(n.startswith("model.visual.") for n in without)  # text only: the tower took no part


def test_expert_load_counts_the_unpadded_top_k_picks_and_reports_shares():
    from ntil_ds.moe import expert_counts, router_metrics

    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 1.0, 5.0, 4.0], [9.0, 0.0, 0.0, 8.0]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding
    counts = expert_counts((logits, logits.flip(-1)), 2, 4, mask)
    assert counts.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert expert_counts((logits,), 2, 4, None).tolist() == [[2, 1, 1, 2]]

    # Two MoE layers over a step: layer 0 balanced, layer 1 with one expert unused; tp=2 counts twice.
    host = {"aux_sum": 2 * 6.0, "expert_counts": [2 * c for c in (5, 5, 5, 5, 10, 6, 4, 0)]}
    metrics = router_metrics(host, labelled=4.0, tp=2, experts=4)
    assert metrics == {
        "aux_loss": 1.5,
        "expert_share_min": 0.0,
        "expert_share_max": 0.5,
        "experts_unused": 1.0,
    }
    assert router_metrics({"loss_sum": 1.0}, 4.0, 1, 4) == {}


def _glm_routing(logits, bias, groups, top_groups, top_k):
    """GLM-4.5V's routing written out in float64: sigmoid(logits) + correction bias, the best
    `top_groups` groups by the sum of their two best scores, then the top-k experts within them."""
    scores = logits.double().sigmoid() + bias.double()
    tokens, experts = scores.shape
    per_group = scores.view(tokens, groups, experts // groups)
    best_groups = per_group.topk(2, dim=-1).values.sum(-1).topk(top_groups, dim=-1).indices
    allowed = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed.repeat_interleave(experts // groups, dim=1)
    return scores.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices


def test_glm_expert_load_counts_the_routing_the_biased_grouped_router_performed(tmp_path):
    """GLM-4.5V routes on sigmoid(logits) + e_score_correction_bias within groups: the expert load counts
    those choices (kept from the router's own forward), not the raw logits' top-k."""
    from ntil_ds.moe import expert_counts, router_terms_for

    folder = build_tiny_model_folder("glm4v_moe", tmp_path / "glm")
    config = AutoConfig.from_pretrained(folder)
    config.text_config.n_group, config.text_config.topk_group = 2, 1  # 2 groups of 2 experts, 1 taken
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    bias = torch.tensor([0.0, -0.9, 0.35, 0.3])  # pulls the choice away from the raw logits' order
    for router in routers:
        router.e_score_correction_bias.copy_(bias)
    terms = router_terms_for(model, None)
    batch = _text_batch(folder, tmp_path)
    inputs = batch.model_inputs(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        output = model(**inputs, use_cache=False, **terms.forward_kwargs)
    terms.record(output, inputs["attention_mask"])

    mask = inputs["attention_mask"].reshape(-1).double()
    expected = torch.stack(
        [
            torch.nn.functional.one_hot(_glm_routing(layer, bias, 2, 1, 2), 4)
            .sum(1)
            .double()
            .mul(mask[:, None])
            .sum(0)
            for layer in output.router_logits
        ]
    )
    raw = expert_counts(output.router_logits, 2, 4, inputs["attention_mask"])
    assert not torch.equal(raw, expected), "the bias must change the routing for this test to mean anything"
    assert torch.equal(terms.last_counts, expected), (terms.last_counts, expected)
