"""The Hugging Face folder people load after training: ``<output_dir>/export/``.

- Full fine-tuning: the model's safetensors weights + config + processor, loadable with plain
  ``from_pretrained`` (no DeepSpeed). The weights are gathered from every rank's ZeRO partition.
- LoRA / QLoRA (:func:`save_lora_export`): the adapter as peft writes it (``adapter_config.json`` +
  ``adapter_model.safetensors``, loads with ``PeftModel.from_pretrained``), and with
  ``lora.merge_on_export=true`` also ``merged/``: the base weights with ``B @ A * alpha / r`` added, a
  plain Hugging Face folder that loads with ``from_pretrained`` and no peft. QLoRA's merged model is a
  plain 16-bit one: the 4-bit base weights dequantized (what the adapters were trained against) with
  the adapters folded in.
- ``lora.head=number_rows``: the head's delta goes into the adapter as peft's own rank-k LoRA on
  ``lm_head`` (so ``PeftModel.from_pretrained`` loads it back, nothing of ntil-ds needed), and into
  ``merged/`` as the base head with the delta added to its rows (tied embeddings untied there:
  :mod:`ntil_ds.model.head_rows`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ntil_ds.dist import barrier
from ntil_ds.model.head_rows import NumberRowsHead, as_peft_lora, fold_delta, number_rows_head
from ntil_ds.model.lora import lora_config_of

if TYPE_CHECKING:  # (the engine imports deepspeed; this module is used without it, e.g. by unit tests)
    from ntil_ds.engine import TrainingEngine

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
_PEFT_PREFIX = "base_model.model."


def export_hf_folder(engine: TrainingEngine, processor: Any, out_dir: str | Path, is_main: bool) -> Path:
    """COLLECTIVE: a Hugging Face folder (safetensors weights + config + processor) that loads with plain
    ``from_pretrained``, no DeepSpeed needed. Weights are gathered from every rank's ZeRO partition."""
    out_dir = Path(out_dir)
    state_dict = engine.consolidated_state_dict()  # every rank must call it; rank 0 gets the weights
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        model = engine.module
        if lora_config_of(model) is not None:  # the adapter (+ merged/ on request)
            save_lora_export(model, state_dict, out_dir)
        else:
            with _without_weight_conversions(model):
                model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out_dir)
        log.info("exported a Hugging Face folder to %s", out_dir)
    barrier()
    return out_dir


def save_lora_export(model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Rank 0: write the adapter to ``out_dir`` and, on request, the merged model to ``out_dir/merged``.

    ``state_dict``: the consolidated (gathered) weights of the PeftModel, adapters and base together.
    """
    lora = lora_config_of(model)
    head = number_rows_head(model)
    with _without_weight_conversions(model):
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if head is not None:
        _add_head_rows_to_adapter(out_dir, head, state_dict[f"{_PEFT_PREFIX}lm_head.delta"])
    if lora.merge_on_export:
        base = model.get_base_model()
        if getattr(base, "hf_quantizer", None) is not None:  # QLoRA
            state_dict = dequantized_state_dict(model, state_dict)
        merged = merged_state_dict(
            state_dict, scaling=lora.alpha / lora.r, param_wrappers=param_wrappers(model)
        )
        if head is not None:
            delta = merged.pop("lm_head.delta")
            merged["lm_head.weight"] = fold_delta(merged["lm_head.weight"], head.rows, delta)
        with (
            _without_weight_conversions(base),
            _seen_as_unquantized(base),
            _untied(base, head is not None),
            _expert_wrappers_removed(base),
        ):
            base.save_pretrained(out_dir / MERGED_DIR, state_dict=merged, safe_serialization=True)
    log.info("exported the LoRA adapter to %s%s", out_dir, " (+ merged/)" if lora.merge_on_export else "")


def _add_head_rows_to_adapter(out_dir: Path, head: NumberRowsHead, delta: torch.Tensor) -> None:
    """Write the number-rows delta into the adapter peft saved, in peft's own format: a LoRA of rank k on
    ``lm_head`` (``lora_A`` the delta, ``lora_B`` the rows' one-hot columns, alpha = r = k: scaling 1),
    so that ``PeftModel.from_pretrained`` loads it back alone. (peft's save picks a model's adapter
    tensors by its LoRA layers, and the head is none: the two files are completed here.)"""
    weights_file, config_file = out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"
    a, b = as_peft_lora(delta, head.rows, head.out_features)
    tensors = load_file(weights_file)
    tensors |= {f"{_PEFT_PREFIX}lm_head.lora_A.weight": a, f"{_PEFT_PREFIX}lm_head.lora_B.weight": b}
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads(config_file.read_text())
    k = len(head.rows)
    config["target_modules"] = sorted({*config["target_modules"], "lm_head"})
    config["rank_pattern"] = {**(config.get("rank_pattern") or {}), "lm_head": k}
    config["alpha_pattern"] = {**(config.get("alpha_pattern") or {}), "lm_head": k}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _untied(model: nn.Module, untie: bool) -> Iterator[None]:
    """With ``untie``, ``model``'s config as a model whose head is its own matrix (the number-rows delta
    changed the head, not the input embedding); otherwise as it is."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()  # (once each)
    tied = [c for c in configs if getattr(c, "tie_word_embeddings", False)] if untie else []
    for c in tied:
        c.tie_word_embeddings = False
    try:
        yield
    finally:
        for c in tied:
            c.tie_word_embeddings = True


@contextlib.contextmanager
def _expert_wrappers_removed(model: nn.Module) -> Iterator[None]:
    """``model`` with peft's ParamWrappers (``lora.experts``) replaced by the experts modules they wrap, for
    the merged save: transformers' save reverts its weight conversions by reading each expert weight's
    shape from the model (``get_parameter``), which a wrapper hides."""
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "ParamWrapper" or ".base_layer" in f".{name}":
            continue  # (the outermost wrapper of each experts module)
        inner = module
        while type(inner).__name__ == "ParamWrapper":
            inner = inner.base_layer
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, inner)
        swapped.append((parent, child, module))
    try:
        yield
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


@contextlib.contextmanager
def _without_weight_conversions(model: nn.Module) -> Iterator[None]:
    """``model`` as ``save_pretrained`` should see it: without transformers' record of renamed weights.

    transformers 5.x records, at from_pretrained, how checkpoint names were renamed and reverts that on
    save. After a ZeRO-3 (zero.Init) load the record makes Qwen2-VL save "model.model.layers.*" instead of
    the hub's "model.layers.*" (transformers reloads both; other tools do not). Without the record,
    save_pretrained uses the model family's default mapping: the hub's names.
    """
    recorded = model.__dict__.pop("_weight_conversions", None)
    try:
        yield
    finally:
        if recorded is not None:
            model._weight_conversions = recorded


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
    import bitsandbytes as bnb  # (only QLoRA exports get here; bitsandbytes is an optional dependency)

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


def param_wrappers(model: nn.Module) -> dict[str, str]:
    """peft's adapters on 3-D expert weights (``lora.experts``: ``ParamWrapper``, nested one per weight on
    the experts module): each wrapper's state-dict prefix -> the name of the weight it adapts."""
    return {
        name: module.parameter_name
        for name, module in model.named_modules()
        if type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name")
    }


def _expert_deltas(state_dict: dict[str, torch.Tensor], wrappers: dict[str, str], scaling: float) -> dict:
    """``{weight's state-dict key: scaling * delta}`` for each adapted [E, out, in] expert weight: expert e's
    delta is ``B_e @ A_e`` with ``A = lora_A [r*E, in]`` as [E, r, in], ``B = lora_B [out, r*E]`` as
    [out, r, E] (peft's ParamWrapper layout)."""
    deltas = {}
    for prefix, param_name in wrappers.items():
        a = state_dict[f"{prefix}.lora_A.default.weight"].double()
        b = state_dict[f"{prefix}.lora_B.default.weight"].double()
        inner = f"{prefix}.base_layer"
        while f"{inner}.{param_name}" not in state_dict:  # the weight sits below the nested wrappers
            inner += ".base_layer"
        key = f"{inner}.{param_name}"
        experts = state_dict[key].shape[0]
        delta = torch.einsum(
            "ore,eri->eoi", b.reshape(b.shape[0], -1, experts), a.reshape(experts, -1, a.shape[-1])
        )
        deltas[key] = scaling * delta
    return deltas


def merged_state_dict(
    state_dict: dict[str, torch.Tensor], scaling: float, param_wrappers: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The PeftModel's weights as the plain model's: ``W + scaling * B @ A`` for each adapted layer (and
    each adapted expert weight: ``param_wrappers``, :func:`param_wrappers` of the model), the trained copy
    of each ``modules_to_save`` module in place of the original, peft's names removed."""
    merged: dict[str, torch.Tensor] = {}
    expert_deltas = _expert_deltas(state_dict, param_wrappers or {}, scaling)
    for key, value in state_dict.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if ".lora_A." in name or ".lora_B." in name or ".original_module." in name:
            continue
        if key in expert_deltas:
            merged[name.replace(".base_layer", "")] = (value.double() + expert_deltas[key]).to(value.dtype)
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
