"""LoRA adapters through peft, for the recipe's ``lora:`` block.

What trains: low-rank adapters on the ``lora.target_modules`` linear layers of the **language model**
(never the vision tower: its linear layers share names like ``q_proj`` in SigLIP-based families), plus
the modules in ``lora.modules_to_save``, trained in full and saved with the adapter (the projector goes
there when ``model.freeze_projector=false``), plus what ``lora.head`` says of the output head: ``full``
(it joins ``modules_to_save``), ``frozen``, or ``number_rows`` (a delta on the rows of the tokens NTIL
reads: :mod:`ntil_ds.model.head_rows`). The vision tower must be frozen (a full trainable copy of it
inside the adapter is not what LoRA is for): ``model.freeze_vision_tower=true``.

Under ZeRO-3 the base model is already partitioned when peft wraps it (``zero.Init``): the adapters
are created as ordinary tensors and ``deepspeed.initialize`` partitions them with the rest; peft gathers
a partitioned module before copying it for ``modules_to_save``. The checkpoint is DeepSpeed's: adapters,
``modules_to_save`` and their optimizer state; the frozen base is read again from ``model.name_or_path``
on resume (``checkpoint.saves_frozen_weights``).

QLoRA's 4-bit base is :mod:`ntil_ds.model.quantize`; the export of the adapter (and of the merged model)
is :mod:`ntil_ds.export`. The recipe checks that need only the config (``model.freeze_language_model``,
``lora.r`` / ``alpha`` / ``dropout``) are ``config.validate``'s; what needs the model is checked here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from ntil_ds.config import ConfigError, LoraConfig, ModelConfig
from ntil_ds.model.head_rows import attach_number_rows
from ntil_ds.model.parts import expert_modules, has_vision, model_part, num_experts

log = logging.getLogger(__name__)

# Set on the PeftModel by apply_lora: the export reads it (ntil_ds/export.py has no config at hand).
_LORA_CONFIG_ATTR = "ntil_lora_config"


def split_names(value: str) -> list[str]:
    """ "a, b,c" -> ["a", "b", "c"] (recipes write module lists as one comma-separated string)."""
    return [name.strip() for name in value.split(",") if name.strip()]


def lora_target_names(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Full names of the language model's linear layers that get adapters.

    ``target_modules`` holds layer names (``q_proj``) matched against the last part of each module name,
    or ``all-linear``: every linear layer of the language model except the output head.
    """
    wanted = split_names(lora.target_modules)
    vision = has_vision(model.config)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.split(".")[-1] == "lm_head":
            continue
        if vision and model_part(f"{name}.weight") not in ("language_model", "other"):
            continue
        if "all-linear" in wanted or name.split(".")[-1] in wanted:
            names.append(name)
    if not names:
        raise ConfigError(
            f"lora.target_modules={lora.target_modules!r} matches no linear layer of the language model of "
            f"{type(model).__name__}; use layer names like q_proj,v_proj or all-linear"
        )
    return names


def lora_expert_parameters(model: nn.Module, lora: LoraConfig) -> list[str]:
    """With ``lora.experts``: full names of the fused experts' 3-D weights (``...mlp.experts.gate_up_proj``,
    ``down_proj``) that get adapters (peft's ``target_parameters``: one rank-r delta per expert); [] without.
    A model without experts is refused (the key would do nothing)."""
    if not lora.experts:
        return []
    count = num_experts(model.config)
    if not count:
        raise ConfigError(
            f"lora.experts=true but {type(model).__name__} has no experts (a dense model); set lora.experts=false"
        )
    experts = {id(module) for module in expert_modules(model)}
    return [
        f"{name}.{param_name}"
        for name, module in model.named_modules()
        if id(module) in experts
        for param_name, param in module.named_parameters(recurse=False)
        if len(tuple(getattr(param, "ds_shape", None) or param.shape)) == 3
    ]


def _modules_to_save(model: nn.Module, cfg: ModelConfig, lora: LoraConfig) -> list[str]:
    """The head when ``lora.head=full``, ``lora.modules_to_save``, and the projector's outermost modules
    when the recipe trains it."""
    names = split_names(lora.modules_to_save)
    if lora.head == "full" and "lm_head" not in names:
        names.insert(0, "lm_head")
    if has_vision(model.config) and not cfg.freeze_projector:
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


def apply_lora(
    model: nn.Module, cfg: ModelConfig, lora: LoraConfig, number_rows: Sequence[int] | None = None
) -> nn.Module:
    """Wrap ``model`` with LoRA adapters as the recipe's ``lora`` block says; returns the PeftModel.

    ``number_rows``: with ``lora.head=number_rows``, the head rows that train (the token ids NTIL reads:
    ``ntil_ds.loss.number_token_ids``; the trainer finds them in the tokenizer).
    """
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as error:  # peft is a dependency; a hand-made environment may still lack it
        raise ConfigError(
            "lora.enabled=true needs the peft package: pip install -c constraints/cpu.txt peft"
        ) from error
    # (needs the model: whether it has a vision tower; model.freeze_language_model is config.validate's)
    if has_vision(model.config) and not cfg.freeze_vision_tower:
        raise ConfigError(
            "lora.enabled=true trains adapters on the language model only; set model.freeze_vision_tower=true "
            "(a fully trained vision tower would be copied whole into the adapter)"
        )
    if lora.head == "number_rows" and not number_rows:
        raise ValueError("lora.head=number_rows: give the head rows to train (number_rows=token ids)")
    targets = lora_target_names(model, lora)
    expert_weights = lora_expert_parameters(model, lora)
    to_save = _modules_to_save(model, cfg, lora)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # Full module names: an exact list, so nothing outside the language model matches by accident.
        target_modules=targets,
        target_parameters=expert_weights or None,
        modules_to_save=to_save or None,
        bias="none",
        # Tied input/output embeddings (Gemma 3) with lora.head=full: the trained copy of lm_head stays
        # tied to the embedding, as in the base model, so the merged export (which ties them again) keeps
        # the trained head.
        ensure_weight_tying=_ties_embeddings(model) and lora.head == "full",
    )
    # Adapters in the base model's dtype: DeepSpeed's bf16 mode expects one dtype for all parameters.
    peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    if lora.head == "number_rows":  # after peft froze the base: the delta is the one new trained tensor
        attach_number_rows(peft_model.get_base_model(), number_rows)
    setattr(peft_model, _LORA_CONFIG_ATTR, lora)
    trainable = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel for p in _trainable(peft_model))
    log.info(
        "LoRA r=%d alpha=%g on %d linear layers and %d expert weights; trained in full: %s;%s %d trainable "
        "parameters",
        lora.r,
        lora.alpha,
        len(targets),
        len(expert_weights),
        ", ".join(to_save) or "nothing",
        f" the head's rows of {len(number_rows)} number tokens;" if lora.head == "number_rows" else "",
        trainable,
    )
    return peft_model


def _ties_embeddings(model: nn.Module) -> bool:
    config = model.config
    text = config.get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The recipe's lora block a model was wrapped with by :func:`apply_lora`; None for a plain model."""
    return getattr(model, _LORA_CONFIG_ATTR, None)


def is_lora_model(model: nn.Module) -> bool:
    return lora_config_of(model) is not None
