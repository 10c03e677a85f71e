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

Checked at start (`check_kernels`): after patching, the modules that really run Liger's kernels are
counted on the model (norms and MLPs whose bound forward is Liger's, attentions whose forward resolves
``apply_rotary_pos_emb`` to Liger's function) against what the config implies (2 norms per layer + 1
final, one SwiGLU MLP per layer when ``hidden_act`` is silu, one attention per layer). A patch that
reaches fewer, e.g. on a transformers version that renamed a class or moved the rotary function, is a
ConfigError naming the patch, the family, the transformers version and the fix (``model.kernels=none``).

Liger-Kernel is in the ``gpu`` extra, not a runtime dependency: asking for it without it installed is a
ConfigError at start (`require_kernels`, before any model is built). Its kernels need Triton on a GPU;
tests/unit/test_kernels.py checks the patching on CPU and the patched outputs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
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
SWIGLU_ACTS = ("silu", "swish")  # the MLP activations that make an MLP a SwiGLU (Liger's SwiGLU kernel)


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
    """Patch ``model`` in place, then check the patch took (`check_kernels`); returns how many modules of
    each kind run Liger's kernels (for the log)."""
    if kernels == "none":
        return {}
    require_kernels(kernels)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ROTARY_MODULES:
        raise ConfigError(
            f"model.kernels=liger supports the model types {', '.join(sorted(ROTARY_MODULES))}, "
            f"not {model_type!r}; set model.kernels=none"
        )
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module, _patch_swiglu_module
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    for module in language_model(model).modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
            _patch_rms_norm_module(module, eps=eps)  # llama casting (fp32 inside the kernel), no offset
        elif name.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            if getattr(getattr(module, "config", None), "hidden_act", None) not in SWIGLU_ACTS:
                continue  # SwiGLU only (the config says which activation the MLP uses)
            _patch_swiglu_module(module, LigerSwiGLUMLP)
    # A module-level function: holds for every model of this type in the process (as Liger does it).
    importlib.import_module(ROTARY_MODULES[model_type]).apply_rotary_pos_emb = liger_rotary_pos_emb
    counts = check_kernels(model)
    log.info("liger kernels on %s: %s", model_type, counts)
    return counts


def expected_kernel_counts(model: nn.Module) -> dict[str, int]:
    """What the language model's config says a complete patch reaches, per patch."""
    text = model.config.get_text_config()
    layers = text.num_hidden_layers
    return {
        "rms_norm": 2 * layers + 1,  # input + post-attention norm per decoder layer, one final norm
        "swiglu_mlp": layers if getattr(text, "hidden_act", None) in SWIGLU_ACTS else 0,
        "rotary": layers,  # one attention per decoder layer, each calling the patched function
    }


def check_kernels(model: nn.Module) -> dict[str, int]:
    """Count, on the patched model itself, the modules that will run Liger's kernels, and stop at start
    when a count differs from what the config implies.

    Why: the patch finds its targets by class name and sets a module-level function, so a transformers
    version that renames a norm class, changes the MLP's attributes or moves ``apply_rotary_pos_emb``
    (or a model whose language model is another family than the map says) would silently train without
    the kernels. Checked on the result, not on the patching code: a norm or MLP counts when its bound
    forward is Liger's; an attention counts when its forward reads the global ``apply_rotary_pos_emb``
    and that name, in the namespace the forward resolves globals from, is Liger's function.
    """
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    lm = language_model(model)
    found = {"rms_norm": 0, "swiglu_mlp": 0, "rotary": 0}
    unpatched_attention: list[str] = []  # where each attention that does not run Liger's rotary reads it
    for module in lm.modules():
        forward = getattr(getattr(module, "forward", None), "__func__", None)
        if forward is LigerRMSNorm.forward:
            found["rms_norm"] += 1
        elif forward is LigerSwiGLUMLP.forward:
            found["swiglu_mlp"] += 1
        elif type(module).__name__.endswith("Attention"):
            reads, resolved = rotary_resolution(type(module))
            if reads and resolved is liger_rotary_pos_emb:
                found["rotary"] += 1
            else:
                unpatched_attention.append(
                    reads or f"{type(module).__qualname__} (no apply_rotary_pos_emb call)"
                )
    expected = expected_kernel_counts(model)
    for patch, count in found.items():
        if count == expected[patch]:
            continue
        detail = ""
        if patch == "rotary" and unpatched_attention:
            detail = (
                f"; the attention reads it from {', '.join(sorted(set(unpatched_attention)))}, the patch "
                f"set it in {ROTARY_MODULES.get(model.config.model_type)}"
            )
        raise ConfigError(
            f"model.kernels=liger: the {patch} patch reaches {count} modules of the "
            f"{model.config.model_type} language model ({lm.config.model_type}), its config implies "
            f"{expected[patch]}, on transformers {transformers_version()}{detail}. The Liger kernels would "
            "silently not run there: set model.kernels=none"
        )
    return found


def rotary_resolution(attention_class: type) -> tuple[str, object]:
    """Where ``attention_class.forward`` looks up ``apply_rotary_pos_emb`` and what it finds there:
    (the module name, the function), or ("", None) when the forward does not call that global."""
    forward = inspect.unwrap(attention_class.forward)  # through decorators such as deprecate_kwarg
    code = getattr(forward, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return "", None
    namespace = forward.__globals__  # the defining module's dict: what a global name resolves to at call time
    return f"{namespace.get('__name__')}.apply_rotary_pos_emb", namespace.get("apply_rotary_pos_emb")


def transformers_version() -> str:
    import transformers

    return transformers.__version__
