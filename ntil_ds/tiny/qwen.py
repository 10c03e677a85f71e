"""Tiny Qwen folders: Qwen2 (text only), Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE.

The VL families share the tokenizer, the processor files and the 2x2 patch merge; each differs in its
vision tower and rotary settings. Chat templates (``templates/``): Qwen2-VL / Qwen2.5-VL's real one
(a system prompt added when none is given); Qwen3-VL-Instruct's without its tool-calling and thinking
branches (no default system prompt); Qwen2-Instruct's (text only: content is a string).
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.processor_files import save_processor_files
from ntil_ds.tiny.tokenizer import qwen_tokenizer, tiny_text_config_kwargs

# 28x28 .. 112x112 pixels: 1 to 16 image tokens after the 2x2 merge, so tests stay fast.
_QWEN_MIN_PIXELS = 28 * 28
_QWEN_MAX_PIXELS = 112 * 112

_QWEN_VL_ID_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def _qwen_vl_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=_QWEN_MIN_PIXELS,
        max_pixels=_QWEN_MAX_PIXELS,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def _save_qwen_vl_processor(out_dir: Path, processor_class: str, tokenizer) -> None:
    """Write the processor files a Hub Qwen-VL checkpoint has (see ``processor_files``)."""
    image_processor = _qwen_vl_image_processor()
    video_config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "cap_pixels_per_frame": True,
        "size": {"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": _QWEN_MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": image_processor.image_mean,
        "image_std": image_processor.image_std,
    }
    save_processor_files(
        out_dir, tokenizer, image_processor, {"processor_class": processor_class}, video_config
    )


def _qwen_vl_text_and_ids(template: str, rope_parameters: dict, **text_fields) -> tuple:
    """The shared start of every tiny Qwen-VL: its tokenizer, the text config (with the family's rotary
    settings), and the image/video/vision-marker ids the config names."""
    tokenizer = qwen_tokenizer(template)
    text = tiny_text_config_kwargs(tokenizer)
    text.update(text_fields)
    text["rope_parameters"] = rope_parameters
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _QWEN_VL_ID_TOKENS.items()}
    return tokenizer, text, ids


def build_qwen2_vl(out_dir: Path) -> None:
    from transformers import Qwen2VLConfig

    # mrope_section sums to head_dim / 2 (head_dim = 64 / 4 = 16).
    tokenizer, text, ids = _qwen_vl_text_and_ids(
        "qwen_vl", {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=False,
        **ids,
    )
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen2VLProcessor", tokenizer)


def build_qwen2_5_vl(out_dir: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    tokenizer, text, ids = _qwen_vl_text_and_ids(
        "qwen_vl", {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        tie_word_embeddings=False,
        **ids,
    )
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen2_5_VLProcessor", tokenizer)


def build_qwen3_vl(out_dir: Path) -> None:
    from transformers import Qwen3VLConfig

    _build_qwen3_vl_like(out_dir, Qwen3VLConfig)


# Qwen3-VL-30B-A3B's routing, shrunk: 4 experts of which each token takes 2 (the real model: 128 and 8),
# every layer sparse (decoder_sparse_step 1), the family's aux-loss coefficient (0.001). The expert
# weights must not be square (2 * 24 != 64): transformers tells a Hub checkpoint's transposed layout from
# its own by the shapes alone (conversion_mapping's Transpose(check_dims=True)).
_QWEN3_VL_MOE_TEXT = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}


def build_qwen3_vl_moe(out_dir: Path) -> None:
    """Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL's vision tower and template, MoE layers."""
    from transformers import Qwen3VLMoeConfig

    _build_qwen3_vl_like(out_dir, Qwen3VLMoeConfig, **_QWEN3_VL_MOE_TEXT)


def build_qwen3_5_moe(out_dir: Path) -> None:
    """Qwen3.5-MoE (Qwen3.5-35B-A3B, -397B-A17B): Qwen3.5's hybrid attention (one Gated DeltaNet and one
    full-attention layer) with every MLP a mixture of experts: 4 routed experts, 2 per token (the real
    35B-A3B: 256 and 8), plus the sigmoid-gated shared expert."""
    from transformers import Qwen3_5MoeConfig

    _build_qwen3_5_like(
        out_dir,
        Qwen3_5MoeConfig,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=24,
        router_aux_loss_coef=0.001,
    )


def build_qwen3_5(out_dir: Path) -> None:
    """Qwen3.5 (dense, e.g. Qwen3.5-27B): Qwen3-VL's processor, template and vision tower (without
    deepstack); the text model alternates Gated DeltaNet (linear attention) and full-attention layers (the
    real one: 3 of every 4 linear), with partial rotary (a quarter of head_dim: 8 of 32, so the M-RoPE
    sections sum to 4)."""
    from transformers import Qwen3_5Config

    _build_qwen3_5_like(out_dir, Qwen3_5Config)


def _build_qwen3_5_like(out_dir: Path, config_class: type, **text_fields) -> None:
    """A tiny Qwen3.5-style folder of `config_class` (Qwen3.5 or Qwen3.5-MoE)."""
    _build_qwen3_vl_like(
        out_dir,
        config_class,
        rope={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        head_dim=32,
        deepstack=False,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **text_fields,
    )


# Interleaved M-RoPE; the sections sum to head_dim / 2 as in the real [24, 20, 20] for head_dim 128.
_QWEN3_VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def _build_qwen3_vl_like(
    out_dir: Path,
    config_class: type,
    rope: dict = _QWEN3_VL_ROPE,
    head_dim: int = 16,
    deepstack: bool = True,
    **text_fields,
) -> None:
    """A Qwen3-VL-style folder (Qwen3-VL's vision tower, processor and template) of `config_class`, its
    text config from `rope`, `head_dim` and the family's own `text_fields`."""
    tokenizer, text, ids = _qwen_vl_text_and_ids("qwen3_vl", rope, head_dim=head_dim, **text_fields)
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 14,  # Qwen3.5's real one has 16; 14 keeps the processor the other Qwen folders share
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to the image's patches
    }
    if deepstack:
        vision["deepstack_visual_indexes"] = [0]  # layer 0's features are also added to the LM's first layer
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen3VLProcessor", tokenizer)


def build_qwen2(out_dir: Path) -> None:
    from transformers import Qwen2Config

    tokenizer = qwen_tokenizer("qwen2")
    config = Qwen2Config(**tiny_text_config_kwargs(tokenizer), tie_word_embeddings=False)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
