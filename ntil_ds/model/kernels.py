"""Fused GPU kernels patched into a built model: ``model.kernels=liger`` (Liger-Kernel, Triton).

Why: on an H200 the 2B-dimension step spent as much GPU time in elementwise kernels (the fp32 up-casts
and multiplies of RMSNorm and rotary embeddings, SwiGLU's gate) as in the matrix products. Liger fuses
each into one Triton kernel. What is patched, in the language model of the supported model types
(instances are patched in place, so modules already built and partitioned under ZeRO-3 keep their
parameters):

- every RMSNorm and SwiGLU MLP (Liger's forward bound to the module), and the rotary embedding (the
  model type's module-level ``apply_rotary_pos_emb``, so it holds for the whole process; M-RoPE's
  sections are already folded into cos/sin in transformers 5.24);
- never Liger's cross-entropy or fused-linear-cross-entropy: the loss is NTIL's, computed from the logits
  (a fused linear CE would not even produce them).

Liger-Kernel is in the ``gpu`` extra, not a runtime dependency: asking for it without it installed is a
ConfigError at start (`require_kernels`, before any model is built). Its kernels need Triton on a GPU;
tests/unit/test_kernels.py checks the patching on CPU and the patched outputs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import logging

from torch import nn

from ntil_ds.config import ConfigError

log = logging.getLogger(__name__)

# model_type -> the transformers module whose `apply_rotary_pos_emb` the decoder attention calls. In
# transformers 5.24 Qwen2-VL / Qwen2.5-VL fold M-RoPE's sections into cos/sin before attention, which then
# calls the plain `apply_rotary_pos_emb`: Liger 0.8.5's own Qwen2-VL patch replaces the old
# `apply_multimodal_rotary_pos_emb` (no longer called) and imports an output class 5.24 lacks, so the
# patching is done here, with Liger's kernels, on the language model only (the ViT is frozen in the recipes).
ROTARY_MODULES = {
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "llava": "transformers.models.llama.modeling_llama",  # the LLaVA-1.5 language model is a Llama
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "llama": "transformers.models.llama.modeling_llama",
}


def require_kernels(kernels: str) -> None:
    """Fail at start, with the fix, when the requested kernels cannot be used."""
    if kernels == "none":
        return
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "model.kernels=liger needs the liger-kernel package (a GPU extra): "
            "pip install 'ntil-ds[gpu]' (or pip install liger-kernel), or set model.kernels=none"
        )


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack: ``model.model.language_model`` in MLLMs, ``model.model`` in LLMs."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def apply_kernels(model: nn.Module, kernels: str) -> dict[str, int]:
    """Patch ``model`` in place; returns how many modules of each kind were patched (for the log)."""
    if kernels == "none":
        return {}
    require_kernels(kernels)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ROTARY_MODULES:
        raise ConfigError(
            f"model.kernels=liger supports the model types {', '.join(sorted(ROTARY_MODULES))}, "
            f"not {model_type!r}; set model.kernels=none"
        )
    import importlib

    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    counts = {"rms_norm": 0, "swiglu_mlp": 0}
    for module in language_model(model).modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
            _patch_rms_norm_module(module, eps=eps)  # llama casting (fp32 inside the kernel), no offset
            counts["rms_norm"] += 1
        elif name.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            if getattr(getattr(module, "config", None), "hidden_act", None) not in ("silu", "swish"):
                continue  # SwiGLU only (the config says which activation the MLP uses)
            _patch_swiglu_module(module, LigerSwiGLUMLP)
            counts["swiglu_mlp"] += 1
    # A module-level function: holds for every model of this type in the process (as Liger does it).
    importlib.import_module(ROTARY_MODULES[model_type]).apply_rotary_pos_emb = liger_rotary_pos_emb
    counts["rotary"] = 1
    log.info("liger kernels on %s: %s", model_type, counts)
    return counts
