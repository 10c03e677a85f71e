"""Per-GPU memory of a training run, from its recipe: will it fit on N GPUs of G GB?

The model is built on PyTorch's ``meta`` device from its config (no weights, no memory), with the
recipe's freeze flags or LoRA applied, so parameter counts are exact for any family transformers knows.
The config comes from ``config.json`` when ``model.name_or_path`` is a local folder, else from
:data:`ntil_ds.model.known_configs.KNOWN_CONFIGS` (the Hub ``config.json`` numbers of the models the
recipes name: nothing is downloaded).

Bytes per GPU, bf16 mixed precision with DeepSpeed (P = all parameters, T = trainable, N = data-parallel
GPUs, L = the largest module's own parameters):

- weights: 2 P (ZeRO-2, every GPU holds them all) or 2 P / N (ZeRO-3); 0 with parameter offload.
  QLoRA: the quantized linear weights take 0.5 B + 1/64 B (nf4 + double-quantized block scales).
- gradients: ZeRO-2 6 T / N (a bf16 and an fp32 partition), ZeRO-3 4 T / N (reduced into the partition
  the optimizer reads); 0 with optimizer offload.
- optimizer states: fp32 master weights 4 T / N + AdamW's m and v, 8 T / N (8-bit AdamW: 2 T / N);
  0 with optimizer offload. These three are DeepSpeed's own accounting
  (``estimate_zero{2,3}_model_states_mem_needs``: 2 P + 18 P / N and 4 L + 18 P / N), which the tests
  check this against.
- ZeRO-3 live parameters: 2 B x ``stage3_max_live_parameters`` (what DeepSpeed may keep gathered; at
  least 4 L, the largest module with its gradient, as its estimators count it) plus the prefetch bucket
  (2 B x ``stage3_prefetch_bucket_size``).
- logits and loss with ``loss.logits=labelled`` (the default): one chunk of the labelled rows' logits
  (``labelled_head.CHUNK_ELEMENTS`` = 2**27 elements at most, fewer when the micro-batch has fewer
  positions), recomputed in the backward with its gradient in fp32 and once more in the model's dtype:
  chunk x (2 B + 4 B + 2 B) in bf16, 1 GiB at most; from the code, not yet measured on a GPU.
- teacher-forced evaluation (``train.eval_every`` with ``data.eval_file``), a peak of its own: the model
  states and the logits of every position (its predictions are read from them; of each rank's slice under
  sequence parallelism) with the loss's as much again, no activations kept (``torch.no_grad``). A recipe
  fits when both its training step and its evaluation do.
- with ``loss.logits=all``: micro_batch x max_seq_len x vocab x 2 B for the bf16 logits, and as much again for
  NTIL's forward + backward (measured on an H200 at [4, 2048, 151936] in bf16: NTILLoss's forward +
  backward peaked 2386 MiB above the 2374 MiB of logits, i.e. 1.0x). ``lora.head=number_rows`` adds its
  delta to the logits out of place: one more logits-sized tensor for a moment, inside that budget (the
  one it replaces is freed at once); its k x H delta counts as trained, the head as frozen.
- activations of the language model, per token and layer, measured with saved-tensor hooks on Qwen2
  layers in bf16 (tests/unit/test_memory_estimate.py): 20 h + 4 kv + 8 i bytes (h hidden, kv the key/value
  width, i the MLP width); with gradient checkpointing only each layer's input is kept (2 h bytes) plus
  one layer's full set while it is recomputed. The vision tower's activations are not counted (a frozen
  tower keeps none; a trained one adds roughly its share of tokens).

It fits when the sum is at most the GPU's memory less 1.5 GiB (CUDA context, NCCL buffers) and less 10 %
for allocator fragmentation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ntil_ds.config import Config, ConfigError
from ntil_ds.ds_config import tensor_parallel_size
from ntil_ds.loss.build import head_on_labelled_rows
from ntil_ds.loss.labelled_head import CHUNK_ELEMENTS
from ntil_ds.loss.tokenizer import DIGITS
from ntil_ds.model.known_configs import KNOWN_CONFIGS
from ntil_ds.model.loading import freeze_parts
from ntil_ds.model.lora import apply_lora
from ntil_ds.model.parts import (
    EXPERTS_SEE_EVERY_TOKEN,
    auto_model_class,
    expert_modules,
    num_experts,
    text_config_of,
)
from ntil_ds.model.quantize import is_quantized_linear

GIB = 2**30
CUDA_CONTEXT_GIB = 1.5
FRAGMENTATION = 0.10
NTIL_PEAK_OVER_LOGITS = 1.0  # measured (2386 / 2374 MiB), see the module docstring
# bytes per token per layer in bf16 (measured; see the module docstring)
_ACT_PER_HIDDEN, _ACT_PER_KV, _ACT_PER_MLP = 20, 4, 8
# a MoE layer's MLP instead (bf16, measured on Qwen3-MoE blocks): per active expert's width, per active
# expert's copy of the hidden state, per router logit
_ACT_PER_EXPERT_MLP, _ACT_PER_EXPERT_INPUT, _ACT_PER_ROUTER_LOGIT = 14, 4, 6
_NF4_BYTES = 0.5 + 1 / 64


def hf_config_for(name_or_path: str):
    """The model's transformers config: its local config.json, or the :data:`KNOWN_CONFIGS` numbers."""
    from transformers import AutoConfig  # (lazy: the CLI's argument errors come before its import time)

    if (Path(name_or_path) / "config.json").is_file():
        return AutoConfig.from_pretrained(name_or_path)
    if name_or_path not in KNOWN_CONFIGS:
        raise ConfigError(
            f"model.name_or_path={name_or_path!r} is neither a local folder with a config.json nor one of the "
            f"models whose dimensions ship with ntil-ds ({', '.join(sorted(KNOWN_CONFIGS))}); download its "
            "config.json into a folder and give that folder"
        )
    raw = copy.deepcopy(KNOWN_CONFIGS[name_or_path])
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


@dataclass
class ParamCounts:
    total: int  # every parameter once (tied ones once)
    trainable: int
    largest_module: int  # the most parameters any single module holds itself (DeepSpeed's "largest layer")
    quantized: int = 0  # QLoRA: frozen linear weights stored in 4 bits
    # mixture of experts (0 for a dense model): the parameters one token's forward uses (every
    # parameter but the routed experts it is not sent to), and one layer's fused expert block, which
    # ZeRO-3 partitions like any parameter and gathers whole when the layer runs
    active: int = 0
    expert_block: int = 0


def expert_parameter_counts(model: nn.Module, hf_config: Any) -> tuple[int, int]:
    """``(parameters a token's forward leaves out, the largest expert block)`` of a MoE model (0, 0 when
    dense): each fused expert module holds ``E`` experts of which a token uses ``top_k``."""
    experts = num_experts(hf_config)
    if not experts:
        return 0, 0
    top_k = text_config_of(hf_config).num_experts_per_tok
    blocks = [sum(p.numel() for p in m.parameters(recurse=False)) for m in expert_modules(model)]
    return sum(b * (experts - top_k) // experts for b in blocks), max(blocks, default=0)


def count_parameters(cfg: Config) -> tuple[ParamCounts, Any]:
    """Exact counts for the recipe's model, freeze flags and LoRA block, on the meta device."""
    hf_config = hf_config_for(cfg.model.name_or_path)
    auto_class = auto_model_class(cfg.model.kind, hf_config)
    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
    unused_experts, expert_block = expert_parameter_counts(model, hf_config)
    quantized = 0
    if cfg.lora.enabled:
        if cfg.lora.quantize == "nf4":  # the language model's linear layers (the rule the 4-bit load follows)
            quantized = sum(
                m.weight.numel()
                for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and is_quantized_linear(n, cfg.lora)
            )
        # lora.head=number_rows: as many head rows as the tokens NTIL reads (which ids they are does not
        # change a count)
        rows = list(range(len(DIGITS) + cfg.loss.signed_numbers + cfg.loss.decimal_numbers))
        with torch.device("meta"):
            model = apply_lora(model, cfg.model, cfg.lora, rows if cfg.lora.head == "number_rows" else None)
    else:
        freeze_parts(model, cfg.model)
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    active = total - unused_experts if expert_block else 0
    return ParamCounts(total, trainable, largest, quantized, active, expert_block), hf_config


@dataclass
class Estimate:
    """Bytes per GPU, by what holds them."""

    weights: float
    gradients: float
    optimizer_states: float
    zero3_live_parameters: float
    logits_and_loss: float
    activations: float
    activations_other_setting: float  # the same with gradient checkpointing toggled
    counts: ParamCounts
    gpus: int
    gpu_memory_gb: float
    stage: int
    offload: str
    method: str
    gradient_checkpointing: bool
    dtype: str = "bfloat16"
    # Teacher-forced evaluation (train.eval_every with an eval file): no activations kept, but the logits
    # of every position of a micro-batch (of its slice under sequence parallelism) and the loss on them.
    evaluation_logits: float = 0.0

    @property
    def evaluation_peak(self) -> float:
        return self.model_states() + self.evaluation_logits

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer_states
            + self.zero3_live_parameters
            + self.logits_and_loss
            + self.activations
        )

    @property
    def usable(self) -> float:
        return (self.gpu_memory_gb * 1e9 - CUDA_CONTEXT_GIB * GIB) * (1 - FRAGMENTATION)

    @property
    def fits(self) -> bool:
        return max(self.total, self.evaluation_peak) <= self.usable

    def model_states(self) -> float:
        """What DeepSpeed's estimators cover: weights, gradients, optimizer states, live parameters."""
        return self.weights + self.gradients + self.optimizer_states + self.zero3_live_parameters

    def report(self) -> str:
        c = self.counts
        other = "on" if not self.gradient_checkpointing else "off"
        rows = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            ("ZeRO-3 live parameters", self.zero3_live_parameters),
            ("logits and loss", self.logits_and_loss),
            (
                f"activations (checkpointing {'on' if self.gradient_checkpointing else 'off'})",
                self.activations,
            ),
        ]
        lines = [
            f"{self.method}, ZeRO-{self.stage}{' + ' + self.offload + ' offload' if self.offload != 'none' else ''}, "
            f"{self.gpus} GPUs x {self.gpu_memory_gb:g} GB",
            f"parameters {c.total / 1e9:.2f} B, trainable {c.trainable / 1e9:.3f} B"
            + (f", 4-bit {c.quantized / 1e9:.2f} B" if c.quantized else "")
            + (f", active per token {c.active / 1e9:.2f} B" if c.expert_block else ""),
        ]
        if c.expert_block:  # ZeRO-3 partitions it over the GPUs; a layer's forward gathers it whole
            lines.append(
                f"  one layer's expert block: {c.expert_block / 1e6:.1f} M parameters, "
                f"{c.expert_block * _dtype_bytes(self.dtype) / GIB:.2f} GiB gathered"
            )
        lines += [f"  {name:<40} {value / GIB:8.2f} GiB" for name, value in rows]
        lines.append(f"  {'total per GPU':<40} {self.total / GIB:8.2f} GiB")
        if self.evaluation_logits:
            lines.append(
                f"  (teacher-forced evaluation: {self.evaluation_peak / GIB:.2f} GiB, the model states and "
                f"{self.evaluation_logits / GIB:.2f} GiB of logits and loss, every position)"
            )
        lines.append(
            f"  (activations with checkpointing {other}: {self.activations_other_setting / GIB:.2f} GiB)"
        )
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(
            f"{verdict}: {max(self.total, self.evaluation_peak) / GIB:.1f} GiB of {self.usable / GIB:.1f} GiB usable per GPU "
            f"({self.gpu_memory_gb:g} GB less {CUDA_CONTEXT_GIB} GiB context and {FRAGMENTATION:.0%} headroom)"
        )
        return "\n".join(lines)


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def activation_bytes_per_token(hf_config: Any, dtype: str, checkpointing: bool) -> tuple[float, float]:
    """``(kept for backward per token over all layers, one layer's full set per token)``."""
    text = hf_config.get_text_config()
    h, i, layers = text.hidden_size, getattr(text, "intermediate_size", 0), text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
    kv = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * head_dim  # width of k
    scale = _dtype_bytes(dtype) / 2
    mlp = _ACT_PER_MLP * i
    if experts := num_experts(hf_config):  # every layer sparse (Qwen3-VL-MoE: decoder_sparse_step 1)
        # the active experts' widths per token, their gathered inputs, the router's logits (measured on
        # transformers 5.24's fused experts within 5 %: tests/unit/test_memory_estimate.py)
        k, width = text.num_experts_per_tok, getattr(text, "moe_intermediate_size", None) or i
        if text.model_type in EXPERTS_SEE_EVERY_TOKEN:  # (Llama 4: its experts' bmm takes every token)
            k = experts
        mlp = (
            _ACT_PER_EXPERT_MLP * k * width + _ACT_PER_EXPERT_INPUT * k * h + _ACT_PER_ROUTER_LOGIT * experts
        )
        # a shared expert (Qwen3.5-MoE, GLM-4.5V) is a dense MLP beside them (not measured on its own)
        shared = getattr(text, "shared_expert_intermediate_size", 0) or width * getattr(
            text, "n_shared_experts", 1 if text.model_type in EXPERTS_SEE_EVERY_TOKEN else 0
        )  # (Llama 4: one shared expert of the routed ones' width, no config field for it)
        mlp += _ACT_PER_MLP * shared
    per_layer = (_ACT_PER_HIDDEN * h + _ACT_PER_KV * kv + mlp) * scale
    if checkpointing:
        return layers * 2 * h * scale, per_layer
    return layers * per_layer, 0.0


def estimate(cfg: Config, ds_json: dict[str, Any], gpus: int, gpu_memory_gb: float) -> Estimate:
    """Per-GPU memory of ``cfg`` with DeepSpeed config ``ds_json`` on ``gpus`` GPUs of ``gpu_memory_gb``."""
    if gpus < 1 or gpu_memory_gb <= 0:
        raise ConfigError(f"--gpus {gpus} and --gpu-memory-gb {gpu_memory_gb} must be positive")
    counts, hf_config = count_parameters(cfg)
    zero = ds_json.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    tp = tensor_parallel_size(ds_json)
    dp = max(1, gpus // tp)
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    offload_par = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
    offload = "optimizer+param" if offload_opt and offload_par else "optimizer" if offload_opt else "none"
    wbytes = _dtype_bytes(cfg.model.dtype)

    dense = counts.total - counts.quantized
    weights = dense * wbytes + counts.quantized * _NF4_BYTES
    weights /= tp  # AutoTP splits the layers' weights
    if stage >= 3:
        weights = 0.0 if offload_par else weights / dp
    t = counts.trainable / tp
    shard = dp if stage >= 1 else 1
    # DeepSpeed's accounting: ZeRO-2 keeps a bf16 and an fp32 gradient partition (2 + 4 B), ZeRO-3 reduces
    # straight into the partition the optimizer reads (4 B).
    grad_bytes = 4 if stage >= 3 else wbytes + 4
    gradients = 0.0 if offload_opt else grad_bytes * t / shard
    state_bytes = 4 + (2 if cfg.optim.name == "adamw_8bit" else 8)
    optimizer = 0.0 if offload_opt else state_bytes * t / shard
    live = 0.0
    if stage >= 3:
        # DeepSpeed keeps up to stage3_max_live_parameters gathered (default 1e9) and prefetches a bucket
        # ahead; at least the largest module is gathered with its gradient (its estimators' 4 L).
        max_live = min(int(zero.get("stage3_max_live_parameters", 1e9)), counts.total) / tp
        prefetch = int(zero.get("stage3_prefetch_bucket_size", 5e7))
        live = max(4 * counts.largest_module, wbytes * max_live) + wbytes * prefetch

    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len
    if cfg.data.max_tokens_per_micro_batch:  # packing: one row of at most this many tokens
        tokens = cfg.data.max_tokens_per_micro_batch
    # Sequence parallelism: each rank holds its slice of the rows (Ulysses' all-to-all gives attention the
    # whole rows for 1/sp of the heads: as many values as the slice for all of them).
    tokens = -(-tokens // cfg.parallel.sequence_parallel_size)
    vocab = hf_config.get_text_config().vocab_size
    logits = tokens * vocab * wbytes * (1 + NTIL_PEAK_OVER_LOGITS) / tp
    if head_on_labelled_rows(cfg):  # a bound: the labelled rows are at most every position
        logits = min(tokens * vocab / tp, CHUNK_ELEMENTS) * (2 * wbytes + 4)

    # teacher-forced evaluation reads every position's logits (its predictions), with no activations kept
    evaluating = bool(cfg.train.eval_every and cfg.data.eval_file)
    evaluation = tokens * vocab * wbytes * (1 + NTIL_PEAK_OVER_LOGITS) / tp if evaluating else 0.0

    def activations(checkpointing: bool) -> float:
        kept, recompute = activation_bytes_per_token(hf_config, cfg.model.dtype, checkpointing)
        return tokens * (kept + recompute) / tp

    ckpt = cfg.model.gradient_checkpointing
    method = "full fine-tuning"
    if cfg.lora.enabled:
        method = "QLoRA" if cfg.lora.quantize == "nf4" else "LoRA"
    return Estimate(
        weights=weights,
        gradients=gradients,
        optimizer_states=optimizer,
        zero3_live_parameters=live,
        logits_and_loss=logits,
        activations=activations(ckpt),
        activations_other_setting=activations(not ckpt),
        counts=counts,
        gpus=gpus,
        gpu_memory_gb=gpu_memory_gb,
        stage=stage,
        offload=offload,
        method=method,
        gradient_checkpointing=ckpt,
        dtype=cfg.model.dtype,
        evaluation_logits=evaluation,
    )


def estimate_as_dict(e: Estimate) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(e).items() if k != "counts"}
    out.update(counts=dataclasses.asdict(e.counts), total=e.total, usable=e.usable, fits=e.fits)
    out.update(evaluation_peak=e.evaluation_peak)
    return json.loads(json.dumps(out))
