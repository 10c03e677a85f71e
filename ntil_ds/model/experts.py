"""Which of transformers 5.24's implementations runs a mixture-of-experts layer's fused experts
(``model.experts_implementation``), chosen per device.

transformers fuses a layer's experts into one module with 3-D weights and dispatches its forward through
``config._experts_implementation`` (``transformers.integrations.moe``):

- ``eager``: the model's own forward, a Python loop over the experts that got tokens (one pair of
  matmuls per expert, a host sync for the loop's bounds);
- ``batched_mm``: every (token, chosen expert) pair gathers its expert's weights and runs one batched
  matmul (``torch.bmm``): no loop and no sync, but a weight copy per assignment;
- ``grouped_mm``: the assignments sorted by expert, one grouped matmul (``torch.nn.functional.grouped_mm``;
  on CUDA sm80+, on CPU a reference kernel in torch 2.13).

``auto`` takes what ``python -m benchmarks.moe_speed`` measured fastest for forward+backward of one MoE
layer (docs/training.md has the table): ``grouped_mm`` on CPU (0.26x the loop's time; ``batched_mm``
14x) and on CUDA sm80+ (the kernel's requirement; ``batched_mm`` below sm80).
"""

from __future__ import annotations

from typing import Any

import torch

from ntil_ds.config import ConfigError

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def resolve_experts_implementation(requested: str, device: torch.device | None = None) -> str:
    """``auto`` -> the measured fastest for the device the model trains on (None: CUDA if available)."""
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if requested == "auto":
        if not on_cuda:
            return CPU_AUTO
        index = device.index if device is not None and device.index is not None else 0
        return "grouped_mm" if torch.cuda.get_device_capability(index) >= (8, 0) else "batched_mm"
    if requested not in EXPERTS_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.experts_implementation={requested!r}: choose auto or one of {', '.join(EXPERTS_IMPLEMENTATIONS)}"
        )
    return requested


# What benchmarks/moe_speed.py measured fastest on CPU (forward + backward of one layer).
CPU_AUTO = "grouped_mm"


def experts_kwargs(
    hf_config: Any, requested: str, device: torch.device | None, auto_class: type | None = None
) -> dict[str, str]:
    """``from_pretrained`` / ``from_config`` arguments: the resolved implementation for a model with
    experts, ``{}`` for a dense one (its classes have no experts to dispatch) and for a family whose expert
    class has no dispatch (``auto_class`` builds a class transformers cannot set it on: Llama 4's
    ``Llama4TextExperts`` runs its own batched matmul over all experts); an explicit choice for such a
    family is refused."""
    from ntil_ds.model.parts import num_experts

    if not num_experts(hf_config):
        return {}
    model_class = (
        auto_class._model_mapping.get(type(hf_config), None) if auto_class is not None else None
    )  # (None for remote code: transformers decides)
    if model_class is not None and not model_class._can_set_experts_implementation():
        if requested != "auto":
            raise ConfigError(
                f"model.experts_implementation={requested}: {model_class.__name__}'s experts have one "
                "implementation of their own (transformers cannot dispatch them); set model.experts_implementation=auto"
            )
        return {}
    return {"experts_implementation": resolve_experts_implementation(requested, device)}


def refuse_tensor_parallel_experts(hf_config: Any, ds_config: dict[str, Any] | None) -> None:
    """AutoTP with a mixture of experts is refused before any weight is read. Measured with DeepSpeed
    0.19.8 and transformers 5.24 (Qwen3-VL-MoE, 2 ranks): ``deepspeed.initialize`` rejects the model's
    own tensor-parallel plan, whose fused experts are split with styles it does not implement
    (``moe_tp_experts``, ``packed_colwise``), after the whole model has loaded."""
    from ntil_ds.model.parts import num_experts

    # (ds_config.tensor_parallel_size checks the value when the run starts; model/ stays below it)
    size = ((ds_config or {}).get("tensor_parallel") or {}).get("autotp_size", 1)
    if size > 1 and num_experts(hf_config):
        raise ConfigError(
            f"tensor_parallel.autotp_size={size} with a mixture-of-experts model ({num_experts(hf_config)} "
            "experts): DeepSpeed 0.19.8's AutoTP cannot split fused experts (it rejects transformers' "
            "tensor-parallel plan: 'moe_tp_experts', 'packed_colwise'); use a DeepSpeed JSON without the "
            "tensor_parallel block (configs/deepspeed/zero3.json): ZeRO-3 partitions the experts instead"
        )
