"""The recipe's LoRA / QLoRA keys checked against each other and the model keys (part of
``config.validate``; what needs the loaded model is checked in ``ntil_ds/model/lora.py``)."""

from __future__ import annotations

from typing import Any

from ntil_ds.typed_config import ConfigError


def validate_lora(cfg: Any) -> None:  # a config.Config (not imported: config builds on this module)
    lora = cfg.lora
    if not lora.enabled:
        if lora.quantize != "none":
            raise ConfigError(
                f"lora.quantize={lora.quantize} needs lora.enabled=true (QLoRA is LoRA on 4-bit weights)"
            )
        if lora.experts:
            raise ConfigError(
                "lora.experts=true needs lora.enabled=true (it puts LoRA adapters on the experts)"
            )
        if lora.head != "full":
            raise ConfigError(
                f"lora.head={lora.head} needs lora.enabled=true (full fine-tuning trains the whole head; "
                "model.freeze_language_model=true freezes it with the language model)"
            )
        return
    if lora.head != "full" and "lm_head" in [m.strip() for m in lora.modules_to_save.split(",")]:
        raise ConfigError(
            f"lora.modules_to_save={lora.modules_to_save!r} trains the whole output head, which contradicts "
            f"lora.head={lora.head}; remove lm_head from lora.modules_to_save (lora.head decides the head)"
        )
    if lora.experts and lora.dropout:
        raise ConfigError(
            f"lora.experts=true adapts the experts' weights directly (peft's target_parameters), which cannot "
            f"apply dropout: set lora.dropout=0 (it is {lora.dropout})"
        )
    if lora.experts and lora.quantize != "none":
        raise ConfigError(
            "lora.experts=true with lora.quantize=nf4: bitsandbytes 4-bit covers linear layers only, not the "
            "experts' 3-D weights (they would stay 16-bit); set lora.quantize=none, or lora.experts=false "
            "to put QLoRA on attention with the experts frozen in 16 bits"
        )
    if lora.r <= 0 or lora.alpha <= 0:
        raise ConfigError(f"lora.r={lora.r} and lora.alpha={lora.alpha} must be > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lora.dropout} must be in [0, 1)")
    if cfg.model.freeze_language_model:
        raise ConfigError(
            "lora.enabled=true trains adapters in the language model: set model.freeze_language_model=false"
        )
    if lora.quantize != "none" and cfg.model.init != "pretrained":
        raise ConfigError(
            f"lora.quantize={lora.quantize} quantizes pretrained weights as they load: set model.init=pretrained "
            "(for a random model, save it with save_pretrained first and train from that folder)"
        )
