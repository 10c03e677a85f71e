"""Model building: transformers loading (LLM and MLLM), freezing, attention; tiny offline folders."""

from ntil_ds.model.loading import (
    LoadedModel,
    freeze_parts,
    load_model,
    model_kind,
    model_part,
    resolve_attn_implementation,
)

__all__ = [
    "LoadedModel",
    "freeze_parts",
    "load_model",
    "model_kind",
    "model_part",
    "resolve_attn_implementation",
]
