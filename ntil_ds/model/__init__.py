"""Model building: transformers loading (LLM and MLLM), the names of a model's parts, freezing,
attention, LoRA / QLoRA, fused kernels. The tiny offline model folders are ``ntil_ds.tiny``."""

from ntil_ds.model.loading import (
    LoadedModel,
    freeze_parts,
    load_model,
    resolve_attn_implementation,
)
from ntil_ds.model.parts import auto_model_class, has_vision, model_kind, model_part

__all__ = [
    "LoadedModel",
    "auto_model_class",
    "freeze_parts",
    "has_vision",
    "load_model",
    "model_kind",
    "model_part",
    "resolve_attn_implementation",
]
