"""Build the model from ``cfg.model``: pretrained or random, LLM or MLLM, frozen parts.

Under ZeRO-3 the model must be partitioned while it is constructed (a 7B model does not fit on one
rank first): :func:`load_model` creates ``HfDeepSpeedConfig`` before ``from_pretrained`` /
``from_config`` so transformers wraps construction in ``deepspeed.zero.Init`` and still applies its own
weight init. transformers keeps only a weak reference to that object, so :class:`LoadedModel` holds it
for as long as the model lives. The processor is loaded by ``ntil_ds.data.load_processor`` (the data
pipeline owns it); the trainer brings the two together.

transformers, peft and bitsandbytes are imported inside the functions that need them: importing this
module (the entry point's checks, the memory estimator's vocabulary) must not cost their import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ntil_ds.config import ConfigError, LoraConfig, ModelConfig
from ntil_ds.model.experts import experts_kwargs, refuse_tensor_parallel_experts
from ntil_ds.model.kernels import apply_kernels, require_kernels
from ntil_ds.model.lora import apply_lora
from ntil_ds.model.parts import DTYPES, Kind, auto_model_class, has_vision, model_kind, model_part
from ntil_ds.model.quantize import check_quantized, quantization_kwargs

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A built model with what belongs with it."""

    model: nn.Module
    kind: Kind
    dtype: torch.dtype
    attn_implementation: str
    # The fused experts' implementation (ntil_ds/model/experts.py); "" for a dense model.
    experts_implementation: str = ""
    # HfDeepSpeedConfig: must outlive the model under ZeRO-3 (transformers holds a weakref).
    zero3_config: Any = field(default=None, repr=False)


def resolve_attn_implementation(requested: str, device: torch.device | None = None) -> str:
    """``auto`` -> flash_attention_2 when flash-attn is importable and the model trains on a CUDA device
    (``device``; None: wherever CUDA is available), else sdpa.

    Not flex_attention without flash-attn: on CPU it cannot train (no backward in torch 2.13) and compiles
    for ~10-30 s, the Qwen-VL classes of transformers 5.24 do not support it, and on CUDA no GPU has
    measured it against sdpa yet (``python -m benchmarks.attention_speed --device cuda``; docs/training.md).
    """
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    flash_ok = importlib.util.find_spec("flash_attn") is not None and on_cuda
    if requested == "auto":
        return "flash_attention_2" if flash_ok else "sdpa"
    if requested == "flex_attention" and not on_cuda:
        raise ConfigError(
            "model.attn_implementation=flex_attention needs a CUDA GPU: torch's FlexAttention has no backward "
            "on CPU; set model.attn_implementation=auto (sdpa) to train on CPU"
        )
    if requested == "flash_attention_2" and not flash_ok:
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package and a CUDA GPU; "
            "install flash-attn (pip install flash-attn) or set model.attn_implementation=auto"
        )
    return requested


def load_model(
    cfg: ModelConfig,
    ds_config: dict[str, Any] | None = None,
    device: torch.device | None = None,
    lora: LoraConfig | None = None,
    number_rows: Sequence[int] | None = None,
) -> LoadedModel:
    """Build the model described by ``cfg`` (random weights come from torch's global RNG: seed first).

    ``ds_config``: the merged DeepSpeed config; with ZeRO stage 3 the parameters are partitioned over
    the ranks as they are created. None: a plain single-process model (evaluation, export checks).
    ``number_rows``: the head rows ``lora.head=number_rows`` trains (the token ids NTIL reads).
    ``device``: where the model trains; random weights are created there unless ZeRO-3 partitions them.
    """
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    require_kernels(cfg.kernels)  # a missing package fails here, before minutes of model loading
    # Created before the model, kept alive in the result: this is what turns on zero.Init.
    zero3_config = HfDeepSpeedConfig(ds_config) if ds_config is not None else None

    hf_config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    # model.kind against the checkpoint: a contradiction is a ConfigError here, before any weight is read.
    auto_class = auto_model_class(cfg.kind, hf_config)
    refuse_tensor_parallel_experts(hf_config, ds_config)
    kind = model_kind(cfg.kind, hf_config)
    attn = resolve_attn_implementation(cfg.attn_implementation, device)
    dtype = DTYPES[cfg.dtype]
    common = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": cfg.trust_remote_code}
    common |= experts_kwargs(hf_config, cfg.experts_implementation, device, auto_class)
    if cfg.init == "random":
        # Built where it trains (not under ZeRO-3, whose zero.Init places the parameters itself): a 2B
        # model's init on the CPU is tens of seconds, single-threaded. That device's generator, seeded
        # with the rest, draws the weights, so every job of a benchmark still gets the same ones.
        on_device = device is not None and device.type != "cpu" and not is_deepspeed_zero3_enabled()
        with torch.device(device) if on_device else contextlib.nullcontext():
            model = auto_class.from_config(hf_config, **common)
    else:
        # QLoRA: 4-bit base weights, else nothing
        quantization = quantization_kwargs(cfg, lora, device, partitioned=is_deepspeed_zero3_enabled())
        model = auto_class.from_pretrained(cfg.name_or_path, config=hf_config, **common, **quantization)
        if quantization:
            check_quantized(model, lora)
    log.info(
        "model %s (%s, %s, init=%s) attention=%s%s",
        cfg.name_or_path,
        type(model).__name__,
        cfg.dtype,
        cfg.init,
        attn,
        f" experts={model.config._experts_implementation}" if "experts_implementation" in common else "",
    )

    # Fused Liger kernels when model.kernels=liger (ntil_ds/model/kernels.py).
    apply_kernels(model, cfg.kernels)
    if cfg.gradient_checkpointing:
        # Non-reentrant: works with frozen inputs (a frozen embedding under a trained LM) and ZeRO-3.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    use_lora = lora is not None and lora.enabled
    frozen = {} if use_lora else freeze_parts(model, cfg)
    if frozen:
        log.info("frozen: %s", ", ".join(f"{part} ({n} tensors)" for part, n in frozen.items()))
    if use_lora:
        # ``lora``: the recipe's lora block; the model comes back wrapped in peft (ntil_ds/model/lora.py):
        # the base frozen, adapters, lora.modules_to_save and what lora.head says trained.
        model = apply_lora(model, cfg, lora, number_rows)
    return LoadedModel(
        model=model,
        kind=kind,
        dtype=dtype,
        attn_implementation=attn,
        experts_implementation=experts_kwargs(hf_config, cfg.experts_implementation, device, auto_class).get(
            "experts_implementation", ""
        ),
        zero3_config=zero3_config,
    )


def freeze_parts(model: nn.Module, cfg: ModelConfig) -> dict[str, int]:
    """Apply ``model.freeze_*``; returns how many tensors each part froze.

    A flag that matches no parameter is an error (e.g. freeze_vision_tower on a text-only model): it
    would silently train what the recipe meant to freeze. For an LLM, every parameter is the language
    model.
    """
    wanted = {
        "vision_tower": cfg.freeze_vision_tower,
        "projector": cfg.freeze_projector,
        "language_model": cfg.freeze_language_model,
    }
    vision = has_vision(model.config)
    counts: dict[str, int] = {part: 0 for part, on in wanted.items() if on}
    for name, param in model.named_parameters():
        part = model_part(name) if vision else "language_model"
        if part == "other" and vision:
            # Embeddings / norms outside named sub-models belong to the language model.
            part = "language_model"
        if wanted.get(part, False):
            param.requires_grad_(False)
            counts[part] += 1
    for part, n in counts.items():
        if n == 0:
            raise ConfigError(
                f"model.freeze_{part}=true but {type(model).__name__} has no {part.replace('_', ' ')} "
                f"parameters; set model.freeze_{part}=false"
            )
    return counts
