"""The Hub ``config.json`` numbers of the models the recipes name: what ``AutoConfig`` would read, only the
keys that decide the architecture's size. The memory estimator (:mod:`ntil_ds.memory_estimate`) builds
these models on the meta device from them, so nothing is downloaded."""

from __future__ import annotations

from typing import Any

# The Hub config.json numbers of the models the recipes name (what AutoConfig would read; only the keys
# that decide the architecture's size).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2-VL-2B-Instruct": {
        "model_type": "qwen2_vl",
        "text_config": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                        "tie_word_embeddings": True},
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                          "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2},
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2-VL-7B-Instruct": {
        "model_type": "qwen2_vl",
        "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16,
                          "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2},
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        "model_type": "qwen2_5_vl",
        "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                        "max_position_embeddings": 128000, "tie_word_embeddings": False},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-VL-8B-Instruct": {
        "model_type": "qwen3_vl",
        "text_config": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                        "vocab_size": 151936, "max_position_embeddings": 262144, "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                          "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
        "tie_word_embeddings": False,
    },
    # Qwen3-VL-MoE: 128 experts of width 768, 8 per token, every layer sparse (30.5B total, 3.3B active).
    "Qwen/Qwen3-VL-30B-A3B-Instruct": {
        "model_type": "qwen3_vl_moe",
        "text_config": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                        "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                          "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
        "tie_word_embeddings": False,
    },
    "google/gemma-3-4b-it": {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "vocab_size": 262208, "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896,
                          "patch_size": 14, "vision_use_head": False},
        "mm_tokens_per_image": 256,
        "tie_word_embeddings": True,
    },
    # InternViT-300M + 2-layer MLP projector + Qwen2.5-7B (vocabulary: Qwen2.5's 151665 + 9 InternVL tokens)
    "OpenGVLab/InternVL3-8B-hf": {
        "model_type": "internvl",
        "text_config": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                        "vocab_size": 151674, "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "image_size": 448, "patch_size": 14, "attention_bias": True,
                          "use_qk_norm": False, "norm_type": "layer_norm"},
        "downsample_ratio": 0.5,
        "image_seq_length": 256,
        "tie_word_embeddings": False,
    },
    # SigLIP-so400m (384 px tiles) + pixel shuffle by 3 + one linear projector + SmolLM2-1.7B (vocabulary:
    # SmolLM2's 49152 + the image/row/column tokens; the head is not tied in this model)
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": {
        "model_type": "smolvlm",
        "text_config": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "head_dim": 64, "vocab_size": 49280, "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "image_size": 384, "patch_size": 14},
        "scale_factor": 3,
        "image_token_id": 49190,
        "tie_word_embeddings": False,
    },
    "llava-hf/llava-1.5-7b-hf": {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "vocab_size": 32064},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                          "patch_size": 14, "projection_dim": 768},
        "tie_word_embeddings": False,
    },
    # Llama 3.2 Vision: a tiled ViT-H/14 (32 local + 8 global layers, 4 tiles of 560 px) and Llama 3.1-8B
    # with 8 gated cross-attention layers inserted (40 layers); the embedding holds 128256 + 8 rows.
    "meta-llama/Llama-3.2-11B-Vision-Instruct": {
        "model_type": "mllama",
        "text_config": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 40,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                          "num_global_layers": 8, "attention_heads": 16, "image_size": 560, "patch_size": 14,
                          "max_num_tiles": 4, "vision_output_dim": 7680,
                          "intermediate_layers_indices": [3, 7, 15, 23, 30]},
        "image_token_index": 128256,
        "tie_word_embeddings": False,
    },
    # GLM-4.1V: a 24-layer ViT (2x2 merge by a strided convolution) and GLM-4-9B (partial M-RoPE)
    "zai-org/GLM-4.1V-9B-Thinking": {
        "model_type": "glm4v",
        "text_config": {"hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                        "num_attention_heads": 32, "num_key_value_heads": 2, "vocab_size": 151552,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5},
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 24, "hidden_size": 1536, "intermediate_size": 13696, "num_heads": 12,
                          "out_hidden_size": 4096, "image_size": 336, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2},
        "tie_word_embeddings": False,
    },
    # Mistral Small 3.1: Pixtral's 24-layer ViT (14 px patches, up to 1540 px), a 2x2 patch merger, and
    # Mistral-Small-24B (40 layers of width 5120, vocabulary 131072)
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": {
        "model_type": "mistral3",
        "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "vocab_size": 131072, "sliding_window": None,
                        "tie_word_embeddings": False},
        "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64,
                          "image_size": 1540, "patch_size": 14},
        "image_token_index": 10,
        "spatial_merge_size": 2,
        "multimodal_projector_bias": False,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
    # Qwen3.5-MoE: 40 layers, 3 Gated DeltaNet to 1 full attention; 256 experts of width 512, 8 per token,
    # plus a shared expert of width 512; Qwen3-VL's vision tower (35B total, 3B active).
    "Qwen/Qwen3.5-35B-A3B": {
        "model_type": "qwen3_5_moe",
        "text_config": {"hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4,
                        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                        "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "vocab_size": 248320, "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                          "num_position_embeddings": 2304},
        "tie_word_embeddings": False,
    },
    # Qwen3.5 dense: 64 layers, 3 Gated DeltaNet to 1 full attention.
    "Qwen/Qwen3.5-27B": {
        "model_type": "qwen3_5",
        "text_config": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "vocab_size": 248320,
                        "tie_word_embeddings": False},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                          "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2,
                          "num_position_embeddings": 2304},
        "tie_word_embeddings": False,
    },
    # GLM-4.5V: GLM-4.5-Air's text model (46 layers, the first dense; 128 routed experts of width 1408, 8 per
    # token, 1 shared; 96 query heads of 128) and GLM-4.1V's vision tower (108B total, 12B active).
    "zai-org/GLM-4.5V": {
        "model_type": "glm4v_moe",
        "text_config": {"hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
                        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                        "attention_bias": True, "n_routed_experts": 128, "num_experts_per_tok": 8,
                        "n_shared_experts": 1, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                        "vocab_size": 151552, "tie_word_embeddings": False},
        "vision_config": {"depth": 24, "hidden_size": 1536, "intermediate_size": 10944, "num_heads": 12,
                          "out_hidden_size": 4096, "patch_size": 14, "spatial_merge_size": 2,
                          "image_size": 336},
        "tie_word_embeddings": False,
    },
    # Llama 4 Scout: 48 layers, every one MoE (16 routed experts of width 8192, 1 per token, a shared expert);
    # 40 query heads of 128, vocabulary 202,048; a 34-layer ViT (109B total, 17B active).
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": {
        "model_type": "llama4",
        "text_config": {"hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                        "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
                        "interleave_moe_layer_step": 1, "vocab_size": 202048, "attention_chunk_size": 8192,
                        "use_qk_norm": True, "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34,
                          "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                          "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
                          "projector_output_dim": 4096, "vision_output_dim": 4096},
        "tie_word_embeddings": False,
    },
}  # fmt: skip
