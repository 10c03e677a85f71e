"""QLoRA's 4-bit base (``lora.quantize=nf4``): which linear layers load as bitsandbytes nf4, the
``from_pretrained`` arguments that do it, and the check after the load.

The language model's linear layers load as bitsandbytes 4-bit layers, packed into tensors of the training
dtype so that ZeRO-3 partitions them like any other weight; the output head, ``lora.modules_to_save``,
projector and vision tower stay 16-bit (a 4-bit weight gets no gradient). Works under ZeRO-2 and ZeRO-3.
The adapters on top are :mod:`ntil_ds.model.lora`'s; the merged export dequantizes (:mod:`ntil_ds.export`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from ntil_ds.config import ConfigError, LoraConfig, ModelConfig
from ntil_ds.model.lora import split_names
from ntil_ds.model.parts import DTYPES, PROJECTOR_MARKERS, VISION_MARKERS

log = logging.getLogger(__name__)


def unquantized_module_patterns(lora: LoraConfig) -> list[str]:
    """Module-name patterns that QLoRA keeps in 16 bits (transformers' ``llm_int8_skip_modules`` syntax:
    a regex matched from the start of the full module name, up to a module boundary).

    Only the language model's linear layers go to 4 bits: a 4-bit weight gets no gradient, so whatever
    trains in full (the output head, ``lora.modules_to_save``, the projector) must stay 16-bit, and the
    frozen vision tower is small next to the language model and loses accuracy in 4 bits.
    """
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
    (bitsandbytes); ``{}`` without QLoRA. (``lora.quantize=nf4`` needs ``model.init=pretrained``:
    ``config.validate`` refuses anything else.)

    Double quantization (the block scales in 8 bits), compute in the training dtype, and the packed
    4-bit weights stored in that dtype too: DeepSpeed's bf16/fp16 modes expect one dtype for every
    parameter, and ZeRO-3 partitions the packed weights like any other tensor of that dtype.
    """
    if lora is None or not lora.enabled or lora.quantize == "none":
        return {}
    try:
        import bitsandbytes  # noqa: F401  (transformers needs it for the 4-bit layers)
    except ImportError as error:
        raise ConfigError(
            "lora.quantize=nf4 needs bitsandbytes: pip install -c constraints/cpu.txt bitsandbytes"
        ) from error
    from transformers import BitsAndBytesConfig

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
