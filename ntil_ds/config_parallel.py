"""The recipe's ``parallel`` keys (sequence parallelism) and their checks against the other keys (part of
``config.validate``; what needs the world size or the loaded model is checked in ``dist.DistInfo`` and
``engine.register_sequence_parallel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ntil_ds.typed_config import ConfigError


@dataclass
class ParallelConfig:
    # DeepSpeed Ulysses sequence parallelism (docs/training.md, "Long sequences"): this many consecutive
    # ranks split every micro-batch's rows on the sequence dimension (each holds 1/size of the tokens'
    # activations; attention exchanges heads for positions). 1: off. The world size must be a multiple
    # of it, and the attention heads (and key/value heads, or the size of them) too.
    sequence_parallel_size: int = 1


def validate_parallel(cfg: Any) -> None:  # a config.Config (not imported: config builds on this module)
    size = cfg.parallel.sequence_parallel_size
    if size < 1:
        raise ConfigError(f"parallel.sequence_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    refused = {
        "data.max_tokens_per_micro_batch": (
            cfg.data.max_tokens_per_micro_batch > 0,
            "packed rows need flash-attention's variable-length kernel inside the sequence-parallel "
            "attention; set data.max_tokens_per_micro_batch=0 (padded rows)",
        ),
        "loss.name": (
            cfg.loss.name == "ntl",
            "the NTL peer loss has no sequence-parallel form; use loss.name=ntil or ce",
        ),
        "model.attn_implementation": (
            cfg.model.attn_implementation == "eager",
            "eager attention needs the whole 4-D mask, which DeepSpeed's Ulysses attention does not pass; "
            "use auto, sdpa or flash_attention_2",
        ),
    }
    for key, (is_refused, why) in refused.items():
        if is_refused:
            raise ConfigError(f"parallel.sequence_parallel_size={size} with {key}: {why}")
