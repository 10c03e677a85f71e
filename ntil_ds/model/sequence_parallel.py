"""Which loaded models DeepSpeed's Ulysses sequence parallelism can wrap (``parallel.sequence_parallel_size``
> 1), checked before anything is registered; the registration itself is in ``ntil_ds.engine``.

Ulysses trades the sequence for the heads inside attention: an all-to-all gives each rank of the group
the whole sequence for ``heads / size`` heads, so the head counts must split; it replaces the attention
function transformers calls (sdpa, flash), so the model's attention must be one of those; and it only
wraps softmax attention, so layers that carry a state along the row (Gated DeltaNet) would see a slice
of it. A vision tower would run on each rank's slice of tokens it cannot read alone: the multimodal
families are refused until their merged embeddings are sliced after the tower.
"""

from __future__ import annotations

from typing import Any

from ntil_ds.config import ConfigError
from ntil_ds.model.parts import has_vision, num_experts, text_config_of

WRAPPABLE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def check_sequence_parallel_supported(config: Any, size: int) -> None:
    """Raise ConfigError, naming the fix, when a model with ``config`` cannot train at this size."""
    text = text_config_of(config)
    name = getattr(config, "model_type", "this model")
    key = f"parallel.sequence_parallel_size={size}"
    if has_vision(config):
        raise ConfigError(
            f"{key} with {name!r}, a multimodal model: sequence parallelism splits text-only models so far "
            "(the vision tower's merged embeddings are not sliced yet); train it with "
            "parallel.sequence_parallel_size=1"
        )
    if num_experts(config):
        raise ConfigError(
            f"{key} with {name!r}, a mixture of experts: DeepSpeed's ZeRO-3 does not run sequence "
            "parallelism with experts; set parallel.sequence_parallel_size=1"
        )
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        raise ConfigError(
            f"{key} with {name!r}: its linear-attention layers (Gated DeltaNet) carry state along the whole "
            "row, which Ulysses (it wraps softmax attention only) would cut at every slice; set "
            "parallel.sequence_parallel_size=1"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(
            f"{key} with {name!r}: its {heads} attention heads and {kv_heads} key/value heads must split "
            f"over the {size} ranks (heads divisible by the size; key/value heads divisible by it or "
            "dividing it); choose a size that divides them"
        )
    attention = getattr(config, "_attn_implementation", None)
    if attention not in WRAPPABLE_ATTENTION:
        raise ConfigError(
            f"{key} with attention {attention!r}: Ulysses wraps {', '.join(WRAPPABLE_ATTENTION)}; set "
            "model.attn_implementation=auto or sdpa"
        )
