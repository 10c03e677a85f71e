"""LoRA (and QLoRA's 4-bit base weights) through peft, for the recipe's ``lora:`` block.

What trains: low-rank adapters on the ``lora.target_modules`` linear layers of the **language model**
(never the vision tower: its linear layers share names like ``q_proj`` in SigLIP-based families), plus
the modules in ``lora.modules_to_save``, trained in full and saved with the adapter. NTIL's gradient
reaches the digits through the output head, so the recipes keep ``lm_head`` there; the projector goes
there too when ``model.freeze_projector=false``. The vision tower must be frozen (a full trainable copy
of it inside the adapter is not what LoRA is for): ``model.freeze_vision_tower=true``.

Under ZeRO-3 the base model is already partitioned when peft wraps it (``zero.Init``): the adapters
are created as ordinary tensors and ``deepspeed.initialize`` partitions them with the rest; peft gathers
a partitioned module before copying it for ``modules_to_save``. The checkpoint is DeepSpeed's: adapters,
``modules_to_save`` and their optimizer state; the frozen base is read again from ``model.name_or_path``
on resume (``checkpoint.saves_frozen_weights``).

QLoRA (``lora.quantize=nf4``): the language model's linear layers load as bitsandbytes 4-bit layers,
packed into tensors of the training dtype so that ZeRO-3 partitions them like any other weight; the
output head, ``modules_to_save``, projector and vision tower stay 16-bit (a 4-bit weight gets no
gradient). Works under ZeRO-2 and ZeRO-3.

Export (:func:`save_lora_export`, called by ``checkpoint.export_hf_folder``): the adapter as peft writes
it (``adapter_config.json`` + ``adapter_model.safetensors``, loads with ``PeftModel.from_pretrained``),
and with ``lora.merge_on_export=true`` also ``merged/``: the base weights with ``B @ A * alpha / r``
added, a plain Hugging Face folder that loads with ``from_pretrained`` and no peft.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ntil_ds.config import ConfigError, LoraConfig, ModelConfig

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
# Set on the PeftModel by apply_lora: the export reads it (checkpoint.py has no config at hand).
_LORA_CONFIG_ATTR = "ntil_lora_config"


def split_names(value: str) -> list[str]:
    """ "a, b,c" -> ["a", "b", "c"] (recipes write module lists as one comma-separated string)."""
    return [name.strip() for name in value.split(",") if name.strip()]


def lora_target_names(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Full names of the language model's linear layers that get adapters.

    ``target_modules`` holds layer names (``q_proj``) matched against the last part of each module name,
    or ``all-linear``: every linear layer of the language model except the output head.
    """
    from ntil_ds.model.loading import model_part

    wanted = split_names(lora.target_modules)
    has_vision = getattr(model.config, "vision_config", None) is not None
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
            continue
        if has_vision and model_part(f"{name}.weight") not in ("language_model", "other"):
            continue
        if "all-linear" in wanted or name.split(".")[-1] in wanted:
            names.append(name)
    if not names:
        raise ConfigError(
            f"lora.target_modules={lora.target_modules!r} matches no linear layer of the language model of "
            f"{type(model).__name__}; use layer names like q_proj,v_proj or all-linear"
        )
    return names


def _modules_to_save(model: nn.Module, cfg: ModelConfig, lora: LoraConfig) -> list[str]:
    """``lora.modules_to_save``, plus the projector's outermost modules when the recipe trains it."""
    from ntil_ds.model.loading import model_part

    names = split_names(lora.modules_to_save)
    if getattr(model.config, "vision_config", None) is not None and not cfg.freeze_projector:
        # e.g. model.multi_modal_projector, model.visual.merger (+ model.visual.deepstack_merger_list)
        tops = set()
        for name, _ in model.named_parameters():
            parts = name.split(".")
            for depth in range(1, len(parts)):
                prefix = ".".join(parts[:depth])
                # (a list of projectors, Qwen3-VL's deepstack mergers: each one, peft wraps modules only)
                if model_part(f"{prefix}.weight") == "projector" and not isinstance(
                    model.get_submodule(prefix), nn.ModuleList | nn.ModuleDict
                ):
                    tops.add(prefix)
                    break
        names += sorted(tops - set(names))
    return names


def apply_lora(model: nn.Module, cfg: ModelConfig, lora: LoraConfig) -> nn.Module:
    """Wrap ``model`` with LoRA adapters as the recipe's ``lora`` block says; returns the PeftModel."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as error:  # peft is a dependency; a hand-made environment may still lack it
        raise ConfigError(
            "lora.enabled=true needs the peft package: pip install -c constraints/cpu.txt peft"
        ) from error
    if getattr(model.config, "vision_config", None) is not None and not cfg.freeze_vision_tower:
        raise ConfigError(
            "lora.enabled=true trains adapters on the language model only; set model.freeze_vision_tower=true "
            "(a fully trained vision tower would be copied whole into the adapter)"
        )
    if cfg.freeze_language_model:
        raise ConfigError(
            "lora.enabled=true trains the language model's adapters: set model.freeze_language_model=false"
        )
    targets = lora_target_names(model, lora)
    to_save = _modules_to_save(model, cfg, lora)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # Full module names: an exact list, so nothing outside the language model matches by accident.
        target_modules=targets,
        modules_to_save=to_save or None,
        bias="none",
        # Tied input/output embeddings (Gemma 3): the trained copy of lm_head stays tied to the embedding,
        # as in the base model, so the merged export (which ties them again) keeps the trained head.
        ensure_weight_tying=_ties_embeddings(model),
    )
    # Adapters in the base model's dtype: DeepSpeed's bf16 mode expects one dtype for all parameters.
    peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    setattr(peft_model, _LORA_CONFIG_ATTR, lora)
    trainable = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel for p in _trainable(peft_model))
    log.info(
        "LoRA r=%d alpha=%g on %d linear layers; trained in full: %s; %d trainable parameters",
        lora.r,
        lora.alpha,
        len(targets),
        ", ".join(to_save) or "nothing",
        trainable,
    )
    return peft_model


def unquantized_module_patterns(lora: LoraConfig) -> list[str]:
    """Module-name patterns that QLoRA keeps in 16 bits (transformers' ``llm_int8_skip_modules`` syntax:
    a regex matched from the start of the full module name, up to a module boundary).

    Only the language model's linear layers go to 4 bits: a 4-bit weight gets no gradient, so whatever
    trains in full (the output head, ``lora.modules_to_save``, the projector) must stay 16-bit, and the
    frozen vision tower is small next to the language model and loses accuracy in 4 bits.
    """
    from ntil_ds.model.loading import PROJECTOR_MARKERS, VISION_MARKERS

    names = [marker.rstrip(".") for marker in (*PROJECTOR_MARKERS, *VISION_MARKERS)]
    names += ["lm_head", *split_names(lora.modules_to_save)]
    return [rf"(?:.*\.)?{re.escape(name)}" for name in dict.fromkeys(names)]


def is_quantized_linear(module_name: str, lora: LoraConfig) -> bool:
    """Whether QLoRA loads the linear layer ``module_name`` in 4 bits (the rule transformers applies to
    :func:`unquantized_module_patterns`; the memory estimator counts with it)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return should_convert_module(module_name, unquantized_module_patterns(lora))


def quantization_kwargs(
    cfg: ModelConfig, lora: LoraConfig | None, device: Any, partitioned: bool = False
) -> dict[str, Any]:
    """QLoRA: ``from_pretrained`` arguments that load the language model's linear weights as 4-bit nf4
    (bitsandbytes).

    Double quantization (the block scales in 8 bits), compute in the training dtype, and the packed
    4-bit weights stored in that dtype too: DeepSpeed's bf16/fp16 modes expect one dtype for every
    parameter, and ZeRO-3 partitions the packed weights like any other tensor of that dtype.
    """
    if lora is None or not lora.enabled or lora.quantize == "none":
        return {}
    if cfg.init != "pretrained":
        raise ConfigError(
            "lora.quantize=nf4 quantizes pretrained weights as they load: set model.init=pretrained "
            "(for a random model, save it with save_pretrained first and train from that folder)"
        )
    try:
        import bitsandbytes  # noqa: F401  (transformers needs it for the 4-bit layers)
    except ImportError as error:
        raise ConfigError(
            "lora.quantize=nf4 needs bitsandbytes: pip install -c constraints/cpu.txt bitsandbytes"
        ) from error
    from transformers import BitsAndBytesConfig

    from ntil_ds.model.loading import DTYPES

    dtype = DTYPES[cfg.dtype]
    kwargs: dict[str, Any] = {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
            llm_int8_skip_modules=unquantized_module_patterns(lora),
        )
    }
    if not partitioned:  # (transformers refuses a device_map under ZeRO-3: zero.Init places the weights)
        kwargs["device_map"] = {"": device if device is not None else "cpu"}  # quantize straight onto it
    return kwargs


def check_quantized(model: nn.Module, lora: LoraConfig) -> None:
    """After a QLoRA load: every linear layer :func:`is_quantized_linear` names is bitsandbytes' 4-bit
    layer and no other is; logs what went to 4 bits. A layer that silently stayed 16-bit (or a trained
    one that went 4-bit and would get no gradient) is an error here, not a surprise in memory or loss."""
    import bitsandbytes as bnb

    wrong, quantized, elements = [], 0, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        is_4bit = isinstance(module, bnb.nn.Linear4bit)
        if is_4bit != is_quantized_linear(name, lora):
            wrong.append(f"{name} ({'4-bit' if is_4bit else '16-bit'})")
        if is_4bit:
            quantized += 1
            elements += module.in_features * module.out_features
    if wrong or not quantized:
        raise RuntimeError(
            "QLoRA: the 4-bit load did not quantize the language model's linear layers as planned: "
            + (", ".join(wrong[:8]) if wrong else "no layer is 4-bit")
        )
    log.info(
        "QLoRA: %d linear layers of the language model in 4-bit nf4 (%.1f M weights); "
        "the output head, vision tower and projector stay 16-bit",
        quantized,
        elements / 1e6,
    )


def _ties_embeddings(model: nn.Module) -> bool:
    config = model.config
    text = config.get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def is_lora_model(model: nn.Module) -> bool:
    return getattr(model, _LORA_CONFIG_ATTR, None) is not None


def save_lora_export(model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Rank 0: write the adapter to ``out_dir`` and, on request, the merged model to ``out_dir/merged``.

    ``state_dict``: the consolidated (gathered) weights of the PeftModel, adapters and base together.
    QLoRA's merged model is a plain 16-bit one: the 4-bit base weights dequantized (what the adapters
    were trained against) with the adapters folded in.
    """
    lora: LoraConfig = getattr(model, _LORA_CONFIG_ATTR)
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if lora.merge_on_export:
        base = model.get_base_model()
        if getattr(base, "hf_quantizer", None) is not None:  # QLoRA
            state_dict = dequantized_state_dict(model, state_dict)
        merged = merged_state_dict(state_dict, scaling=lora.alpha / lora.r)
        recorded = base.__dict__.pop("_weight_conversions", None)  # see checkpoint.export_hf_folder
        try:
            with _seen_as_unquantized(base):
                base.save_pretrained(out_dir / MERGED_DIR, state_dict=merged, safe_serialization=True)
        finally:
            if recorded is not None:
                base._weight_conversions = recorded
    log.info("exported the LoRA adapter to %s%s", out_dir, " (+ merged/)" if lora.merge_on_export else "")


@contextlib.contextmanager
def _seen_as_unquantized(model: nn.Module) -> Iterator[None]:
    """QLoRA's base as ``save_pretrained`` should see it for the merged export: a plain model. Its
    quantizer would replace the (dequantized, merged) state dict it is given with its own 4-bit one and
    write a quantization config that makes the folder load as 4-bit."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        yield
        return
    quantization_config = model.config.quantization_config
    model.hf_quantizer = None
    del model.config.quantization_config
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        model.config.quantization_config = quantization_config


def dequantized_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with each of ``model``'s 4-bit weights as a 16-bit tensor (its quantization state
    entries, ``<weight>.absmax`` and the like, dropped)."""
    import bitsandbytes as bnb

    four_bit = {
        name: module for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)
    }
    result = {k: v for k, v in state_dict.items() if k.split(".weight.")[0] not in four_bit}
    for name, module in four_bit.items():
        quant_state = module.weight.quant_state  # (every rank holds it whole; ZeRO-3 splits only the data)
        packed = state_dict[f"{name}.weight"].to(quant_state.absmax.device)
        result[f"{name}.weight"] = (
            bnb.functional.dequantize_4bit(packed, quant_state).to(quant_state.dtype).cpu()
        )
    return result


_PEFT_PREFIX = "base_model.model."


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The PeftModel's weights as the plain model's: ``W + scaling * B @ A`` for each adapted layer, the
    trained copy of each ``modules_to_save`` module in place of the original, peft's names removed."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue
        if ".base_layer." in name:
            layer = name.replace(".base_layer.", ".", 1)
            prefix = key.split(".base_layer.")[0]
            if name.endswith(".weight"):
                a = state_dict[f"{prefix}.lora_A.default.weight"].float()
                b = state_dict[f"{prefix}.lora_B.default.weight"].float()
                value = (value.float() + scaling * (b @ a)).to(value.dtype)
            merged[layer] = value
            continue
        merged[name.replace(".modules_to_save.default.", ".")] = value
    return merged
