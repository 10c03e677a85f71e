"""The names of a model's parts: which parameters are the vision tower, the projector, the language model;
whether a checkpoint is an MLLM or an LLM, and which transformers Auto class builds it.

Every place that decides MLLM vs LLM (loading, LoRA placement, QLoRA's 4-bit rule, the memory estimator,
launch/evaluate.py) asks :func:`has_vision` and :func:`auto_model_class`, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ntil_ds.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Parameter-name markers of the parts the freeze flags address, across the model families we train
# (transformers 5.x names): Qwen2-VL / Qwen2.5-VL / Qwen3-VL keep the vision tower in ``model.visual``
# with the projector as ``visual.merger`` (+ ``deepstack_merger_list`` in Qwen3-VL); LLaVA-style models
# have ``vision_tower`` and ``multi_modal_projector``; SmolVLM has ``vision_model``, ``connector`` and
# ``text_model``; the language model is ``language_model`` (or ``text_model``) plus the output head.
PROJECTOR_MARKERS = (
    "multi_modal_projector.",
    "visual.merger.",
    "visual.deepstack_merger_list.",
    "connector.",
)
VISION_MARKERS = ("vision_tower.", "visual.", "vision_model.")
LANGUAGE_MARKERS = ("language_model.", "text_model.", "lm_head.")

ModelPart = Literal["vision_tower", "projector", "language_model", "other"]
Kind = Literal["mllm", "llm"]


def model_part(param_name: str) -> ModelPart:
    """Which part a parameter belongs to, by its name (projector is checked before the vision tower,
    since Qwen's projector lives inside ``visual``)."""
    name = f".{param_name}"
    if any(f".{m}" in name for m in PROJECTOR_MARKERS):
        return "projector"
    if any(f".{m}" in name for m in VISION_MARKERS):
        return "vision_tower"
    if any(f".{m}" in name for m in LANGUAGE_MARKERS):
        return "language_model"
    return "other"


def has_vision(config: Any) -> bool:
    """Whether a transformers config (a model's ``config``, or ``AutoConfig``'s) has a vision part."""
    return getattr(config, "vision_config", None) is not None


def model_kind(kind: str, config: Any) -> Kind:
    """``model.kind`` resolved: ``auto`` is an MLLM when the config has a vision part, else an LLM."""
    if kind == "auto":
        return "mllm" if has_vision(config) else "llm"
    if kind not in ("mllm", "llm"):
        raise ValueError(f"model kind {kind!r} is not one of 'auto', 'mllm', 'llm'")
    return kind  # type: ignore[return-value]


def auto_model_class(kind: str, config: Any) -> type:
    """The transformers Auto class that builds ``config`` as ``kind`` (``auto``, ``mllm`` or ``llm``).

    An explicit ``model.kind`` that the checkpoint contradicts (``llm`` on a Qwen2-VL folder: transformers'
    AutoModelForCausalLM has no class for ``qwen2_vl``) is a :class:`ConfigError` here, before any weight
    is read, instead of transformers' "Unrecognized configuration class" on every rank. A kind the
    checkpoint allows both ways (Gemma 3 builds as either) is kept as the recipe says.
    """
    # transformers is imported here, not at module level: importing this module stays cheap (the
    # entry point's config checks and the QLoRA rule use these names before any model is built).
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    classes = {"mllm": AutoModelForImageTextToText, "llm": AutoModelForCausalLM}
    auto_class = classes[model_kind(kind, config)]
    broken = _BROKEN_MLLM_FORWARD.get(getattr(config, "model_type", None))
    if auto_class is AutoModelForImageTextToText and broken and _installed_transformers() in broken[0]:
        raise ConfigError(f"model.kind={kind}: {broken[1]}")
    if kind != "auto" and not _builds(auto_class, config):
        other = "llm" if kind == "mllm" else "mllm"
        fix = (
            f"set model.kind={other} or model.kind=auto (decided by the checkpoint)"
            if _builds(classes[other], config)
            else "check model.name_or_path, or set model.kind=auto"
        )
        raise ConfigError(
            f"model.kind={kind} contradicts the checkpoint: its config.json has model_type "
            f"{getattr(config, 'model_type', None)!r}, which transformers' {auto_class.__name__} cannot "
            f"build; {fix}"
        )
    return auto_class


# MLLM classes whose forward fails on every input in the named transformers versions, and what to do.
_BROKEN_MLLM_FORWARD = {
    "llama4": (
        ("5.24.0",),
        "transformers 5.24's Llama4ForConditionalGeneration.forward fails on every input, text or image "
        "(AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'); set "
        "model.kind=llm to train the text model (Llama4ForCausalLM, which loads the checkpoint's "
        "language_model weights and leaves the vision tower out)",
    )
}


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


def _builds(auto_class: type, config: Any) -> bool:
    """Whether ``auto_class.from_config(config)`` has a model class: transformers' own mapping (which also
    holds classes registered with ``auto_class.register``), or the checkpoint's remote code."""
    remote = getattr(config, "auto_map", None) or {}
    return type(config) in auto_class._model_mapping or auto_class.__name__ in remote


# ----------------------------------------------------------------------------------------------------
# Mixture-of-experts parts. transformers 5 fuses a layer's experts into one module holding 3-D weights
# [num_experts, out, in] (``mlp.experts.gate_up_proj`` / ``down_proj``) next to its router (``mlp.gate``,
# a [num_experts, hidden] weight); Qwen3-VL-MoE, Qwen3.5-MoE and GLM-4.5V name them so. Llama 4 names
# them ``feed_forward.experts`` (weights [num_experts, in, out]) and ``feed_forward.router``.
ROUTER_MARKERS = ("mlp.gate.", "feed_forward.router.")
EXPERT_MARKERS = ("mlp.experts.", "feed_forward.experts.")
# The config fields the MoE families name their expert count with (text_config for MLLMs).
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")

# Text-model types whose fused experts compute every token (their scores zero where not routed) instead of
# the routed ones: transformers 5.24's Llama4TextExperts, one batched matmul over all experts. For the
# estimator's activations; ZeRO-3 gathers every expert on every rank anyway.
EXPERTS_SEE_EVERY_TOKEN = ("llama4_text",)

MoePart = Literal["router", "experts"]


def moe_part(param_name: str) -> MoePart | None:
    """``router`` or ``experts`` for a mixture-of-experts parameter, by its name; None for the rest."""
    name = f".{param_name}"
    if any(f".{m}" in name for m in ROUTER_MARKERS):
        return "router"
    if any(f".{m}" in name for m in EXPERT_MARKERS):
        return "experts"
    return None


def text_config_of(config: Any) -> Any:
    """The language model's config: ``text_config`` of an MLLM, the config itself for an LLM."""
    return getattr(config, "text_config", None) or config


def num_experts(config: Any) -> int:
    """The expert count of a mixture-of-experts config (0: a dense model)."""
    text = text_config_of(config)
    return next((int(n) for f in _EXPERT_COUNT_FIELDS if (n := getattr(text, f, None))), 0)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a layer's experts: those with a 3-D parameter of their own whose first
    dimension is the config's expert count (transformers 5's fused experts). Found from the loaded model
    itself, not from a list of class names per architecture, so a new family needs no entry here."""
    count = num_experts(model.config)
    if not count:
        return []
    return [
        module
        for module in model.modules()
        if any(_leading_dim(p) == count for p in module.parameters(recurse=False))
    ]


def _leading_dim(param: torch.nn.Parameter) -> int:
    """The first dimension of a 3-D parameter, -1 for any other. Under ZeRO-3 a parameter is an empty
    placeholder; DeepSpeed keeps its full shape in ``ds_shape``."""
    shape = tuple(getattr(param, "ds_shape", None) or param.shape)
    return int(shape[0]) if len(shape) == 3 else -1
