"""What a model needs for packed rows (`ntil_ds.data.packing`): which models may be packed, and the
per-sample 3-D rotary positions of M-RoPE models.

transformers 5.24 isolates packed samples from ``position_ids`` alone (no attention mask): sdpa/eager get
a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``) and flash-attention 2 its
varlen kernel. That holds for the model types below, each checked by tests/unit/test_packing.py (packed
logits, loss and gradients equal the unpacked ones). Other types (e.g. Gemma 3's bidirectional image
attention) are refused rather than trained on a mask nobody checked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ntil_ds.config import ConfigError

# model_type of the config (the top-level one for MLLMs) -> whether it uses M-RoPE (3-D positions).
PACKABLE_MODEL_TYPES = {
    "qwen2_vl": True,
    "qwen2_5_vl": True,
    "llava": False,
    "qwen2": False,
    "llama": False,
}


def check_packing_supported(model: nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    text = getattr(model.config, "text_config", None) or model.config
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        # Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet layers carry state along the row (a causal
        # convolution and a recurrent delta rule). transformers 5.24 keeps packed samples apart there only
        # with the flash-linear-attention / causal-conv1d kernels given cu_seqlens; its torch path
        # refuses the boundaries, and without them (this project's packing: restarting positions) the
        # samples leak into each other (tests/unit/test_packing.py shows both).
        raise ConfigError(
            f"data.max_tokens_per_micro_batch > 0 (sequence packing) is refused for {model_type!r}: its "
            "linear-attention layers (Gated DeltaNet) carry their convolution and recurrent state across "
            "the whole row, and transformers' torch path of them cannot take the packed samples' "
            "boundaries, so packed samples would leak into each other; set data.max_tokens_per_micro_batch=0"
        )
    if model_type not in PACKABLE_MODEL_TYPES:
        raise ConfigError(
            f"data.max_tokens_per_micro_batch > 0 (sequence packing) is verified for the model types "
            f"{', '.join(sorted(PACKABLE_MODEL_TYPES))}, not {model_type!r}; set data.max_tokens_per_micro_batch=0"
        )


def rope_fn_for(model: nn.Module) -> Callable | None:
    """For M-RoPE models, a function computing each sample's 3-D positions with the model's own
    ``get_rope_index`` (it reads only the config, never the weights, so it runs in data-loader workers);
    None for models with ordinary 1-D positions."""
    check_packing_supported(model)
    if not PACKABLE_MODEL_TYPES[model.config.model_type]:
        return None
    # Qwen2VLModel / Qwen2_5_VLModel own get_rope_index (found through wrappers such as peft's, too)
    owner = next(m for m in model.modules() if callable(getattr(m, "get_rope_index", None)))
    return _MRope(owner.get_rope_index)


class _MRope:
    """rope_fn(input_ids [S, L], mm_token_type_ids [S, L], attention_mask [S, L], images) -> [3, S, L]."""

    def __init__(self, get_rope_index: Callable) -> None:
        self.get_rope_index = get_rope_index

    def __call__(self, input_ids, mm_token_type_ids, attention_mask, images) -> torch.Tensor:
        positions, _ = self.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=images.get("image_grid_thw"),
            video_grid_thw=images.get("video_grid_thw"),
            attention_mask=attention_mask,
        )
        return positions
