"""Tiny GLM-4.5V (``glm4v_moe``) folder: GLM-4.1V's vision tower, processor, chat template and digit-grouping
tokenizer (``glm4v.py``: ``\\p{N}{1,3}`` from the left, as GLM-4.5V's real one, so NTIL trains it with the
grouped loss), and a GLM-4.5-Air text model of mixture-of-experts layers: a sigmoid top-k router with its
score-correction bias, fused routed experts and one shared expert per layer, the first layer dense
(``first_k_dense_replace``), as in the real model (128 routed experts, 8 per token, 1 shared).
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.glm4v import build_glm4v

# 4 routed experts, each token takes 2; one shared expert; layer 0 dense, layer 1 sparse. Expert weights
# not square (2 * 24 != 64; see qwen.py's _QWEN3_VL_MOE_TEXT). The family's aux-loss coefficient (1e-4).
_GLM4V_MOE_TEXT = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 24,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "router_aux_loss_coef": 0.0001,
}


def build_glm4v_moe(out_dir: Path) -> None:
    """GLM-4.5V: the tiny GLM-4.1V folder, its config rewritten as ``Glm4vMoeConfig`` (same vision tower,
    token ids and rotary settings) with the MoE text fields above."""
    from transformers import Glm4vConfig, Glm4vMoeConfig

    build_glm4v(out_dir)
    dense = Glm4vConfig.from_pretrained(out_dir).to_dict()
    text = {**dense["text_config"], **_GLM4V_MOE_TEXT}
    for key in ("model_type", "architectures", "transformers_version", "dtype"):
        text.pop(key, None)
    vision = {
        k: v for k, v in dense["vision_config"].items() if k not in ("model_type", "transformers_version")
    }
    ids = {k: dense[k] for k in dense if k.endswith("_token_id") and k not in ("pad_token_id",)}
    config = Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.save_pretrained(out_dir)
