"""The DeepSpeed JSON and the recipe, merged: what DeepSpeed is told, decided before any process waits.

The recipe (``configs/train/*.yaml``) owns batch sizes, accumulation, clipping, precision, optimizer and
schedule; the DeepSpeed JSON (``configs/deepspeed/*.json``) owns ZeRO stage, offload, buckets and tensor
parallelism. A JSON that sets one of the recipe's keys to something else is an error naming that key,
raised before any model is built. Pure: no deepspeed import (``launch/estimate.py`` and the entry point
read a JSON without paying for it).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from ntil_ds.config import Config, ConfigError, gradient_accumulation_steps, load_config
from ntil_ds.dist import DistInfo, collective_timeout

# Keys whose value the recipe decides; the JSON may repeat them only with the same value (or "auto").
_RECIPE_OWNED_BLOCKS = ("optimizer", "scheduler")
_PRECISION_BLOCKS = {"bfloat16": "bf16", "float16": "fp16"}


def load_deepspeed_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deepspeed={path} does not exist (give a JSON file from configs/deepspeed/)")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed={path} is not valid JSON: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"deepspeed={path} must hold a JSON object")
    return loaded


def tensor_parallel_size(ds_json: dict[str, Any]) -> int:
    """``tensor_parallel.autotp_size`` of a DeepSpeed JSON (1 when absent)."""
    block = ds_json.get("tensor_parallel") or {}
    size = block.get("autotp_size", 1)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel.autotp_size={size!r} in the DeepSpeed JSON must be an int >= 1")
    return size


def merge_deepspeed_config(cfg: Config, ds_json: dict[str, Any], data_parallel_size: int) -> dict[str, Any]:
    """The DeepSpeed config this run uses: the JSON's tuning plus everything the recipe decides.

    Raises :class:`ConfigError` naming the key when the JSON contradicts the recipe, or when the global
    batch does not divide into micro-batches over the data-parallel ranks.
    """
    merged = copy.deepcopy(ds_json)
    gas = gradient_accumulation_steps(cfg, data_parallel_size)
    source = f"the DeepSpeed JSON ({cfg.deepspeed})"

    recipe_values: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (cfg.train.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (gas, "train.global_batch_size / (micro_batch_size x dp ranks)"),
        # DeepSpeed 0.19.8 counts every rank in train_batch_size, tensor-parallel ones included
        # (its batch check uses the full world size when AutoTP is on): global batch x autotp_size.
        "train_batch_size": (
            cfg.train.global_batch_size * tensor_parallel_size(ds_json),
            "train.global_batch_size x tensor_parallel.autotp_size",
        ),
        "gradient_clipping": (cfg.optim.grad_clip, "optim.grad_clip"),
    }
    for key, (value, recipe_key) in recipe_values.items():
        if key in merged and merged[key] != "auto" and merged[key] != value:
            raise ConfigError(
                f"{key}={merged[key]!r} in {source} contradicts the recipe's {recipe_key} (= {value!r}); "
                f"remove {key} from the JSON: the recipe sets it"
            )
        merged[key] = value

    if cfg.lora.enabled and tensor_parallel_size(ds_json) > 1:
        # AutoTP shards nn.Linear layers; peft's adapter layers (and QLoRA's 4-bit ones) are not among
        # the layers it knows, and no test here runs the combination.
        raise ConfigError(
            f"lora.enabled=true with tensor_parallel.autotp_size={tensor_parallel_size(ds_json)} in {source}: "
            "LoRA / QLoRA train under ZeRO-2 or ZeRO-3 without AutoTP; use a DeepSpeed JSON without the "
            "tensor_parallel block (configs/deepspeed/zero3.json)"
        )

    sequence_parallel = cfg.parallel.sequence_parallel_size
    if merged.get("sequence_parallel_size", sequence_parallel) != sequence_parallel:
        raise ConfigError(
            f"sequence_parallel_size={merged['sequence_parallel_size']!r} in {source} contradicts the recipe's "
            f"parallel.sequence_parallel_size={sequence_parallel}; remove it from the JSON: the recipe sets it"
        )
    if sequence_parallel > 1:  # DeepSpeed's batch check at ZeRO-3's model init reads it (no mpu there yet)
        merged["sequence_parallel_size"] = sequence_parallel

    for block in _RECIPE_OWNED_BLOCKS:
        if block in merged:
            raise ConfigError(
                f"{block!r} block in {source}: the recipe's optim section sets the {block}; "
                f"remove {block!r} from the JSON and set optim.* in the recipe instead"
            )

    wanted = _PRECISION_BLOCKS.get(cfg.model.dtype)  # None for float32
    for dtype_name, block in _PRECISION_BLOCKS.items():
        section = merged.get(block)
        enabled = isinstance(section, dict) and section.get("enabled") not in (False, "auto")
        if enabled and block != wanted:
            raise ConfigError(
                f"{block}.enabled=true in {source} contradicts the recipe's model.dtype={cfg.model.dtype!r}; "
                f"remove the {block!r} block or set model.dtype={dtype_name}"
            )
        if block == wanted:
            merged[block] = {**(section if isinstance(section, dict) else {}), "enabled": True}
        elif isinstance(section, dict):
            merged[block] = {**section, "enabled": False}

    optim = cfg.optim
    adam_params = {
        "lr": optim.lr,
        "betas": [optim.beta1, optim.beta2],
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if optim.name == "adamw":
        merged["optimizer"] = {"type": "AdamW", "params": adam_params}
    elif optim.name == "adamw_torch":
        # DeepSpeed passes the params on to torch.optim.AdamW (engine.get_optimizer_configuration); "fused"
        # picks torch's fused kernel, which needs no build either.
        fused = {"fused": True} if optim.fused else {}
        merged["optimizer"] = {"type": "AdamW", "params": {**adam_params, "torch_adam": True, **fused}}
    else:  # adamw_8bit: a client optimizer (bitsandbytes) built in TrainingEngine; DeepSpeed must allow it
        merged["zero_allow_untested_optimizer"] = True
    # The schedule is a client LambdaLR (see lr_ratio): DeepSpeed's WarmupCosineLR cannot do zero
    # warmup steps and starts its warmup at lr 0.
    return merged


def resolve_run(recipe: str | Path, overrides: list[str]) -> tuple[Config, dict[str, Any], DistInfo]:
    """Recipe + overrides -> (config, merged DeepSpeed config, this process's place in the job).

    Every check that needs no process group happens here, so entry points call it first and a bad
    recipe fails in a second with a ConfigError, before any rank waits on another.
    """
    cfg = load_config(recipe, overrides)
    collective_timeout(os.environ)  # a bad NTIL_COLLECTIVE_TIMEOUT_S fails here, not in init_distributed
    ds_json = load_deepspeed_json(cfg.deepspeed)
    dist_info = DistInfo.from_env(
        tp_size=tensor_parallel_size(ds_json), sp_size=cfg.parallel.sequence_parallel_size
    )
    return cfg, merge_deepspeed_config(cfg, ds_json, dist_info.dp_size), dist_info


def write_deepspeed_config(ds_config: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
    return path


def jit_optimizer_op(ds_config: dict[str, Any]) -> str | None:
    """The DeepSpeed op its optimizer block makes DeepSpeed build at ``deepspeed.initialize``: "fused_adam"
    (Adam/AdamW without torch_adam; FusedAdam), "cpu_adam" (the same under optimizer offload; CPUAdam), or
    None (torch_adam: torch.optim.AdamW; a client optimizer). As deepspeed 0.19.8's
    ``DeepSpeedEngine.get_optimizer_configuration`` decides."""
    block = ds_config.get("optimizer")
    if not isinstance(block, dict) or str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    if (block.get("params") or {}).get("torch_adam"):
        return None
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return "cpu_adam" if offload.get("device") in ("cpu", "nvme") else "fused_adam"


# What a JIT build of each op runs (torch.utils.cpp_extension: ninja always; nvcc for CUDA sources).
_BUILD_TOOLS = {"fused_adam": ("ninja", "nvcc"), "cpu_adam": ("ninja", "c++")}


def optimizer_build_problem(ds_config: dict[str, Any], prebuilt: dict[str, bool], find_tool) -> str | None:
    """Why the optimizer DeepSpeed would build cannot be built here (None when nothing is built, it is
    prebuilt, or its tools are present): checked before ``deepspeed.initialize`` on an accelerator, where
    the build would otherwise fail after minutes or in the middle of the start. `find_tool(name)`: the
    tool's path or None (shutil.which, with nvcc also looked for under CUDA_HOME)."""
    op = jit_optimizer_op(ds_config)
    if op is None or prebuilt.get(op):
        return None
    missing = [tool for tool in _BUILD_TOOLS[op] if find_tool(tool) is None]
    if not missing:
        return None
    return (
        f"optim.name=adamw makes DeepSpeed JIT-compile its {op} op at start (minutes), which needs "
        f"{' and '.join(_BUILD_TOOLS[op])}; missing here: {', '.join(missing)}. Use optim.name=adamw_torch "
        "optim.fused=true (torch's fused AdamW, nothing to build; what the GPU recipes use), or install the "
        f"tools, or a deepspeed built with its ops (DS_BUILD_{op.upper()}=1 pip install deepspeed)."
    )
