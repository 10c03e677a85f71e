"""The router's load-balancing loss and the experts' load, for mixture-of-experts models.

The loss is the family's own: transformers computes it in the model's forward when asked for the
router logits (``output_router_logits=True``: Switch Transformer's ``num_experts * sum_e f_e * P_e``
over the micro-batch's unpadded tokens, ``load_balancing_loss_func``), and the family's coefficient is
its config's ``router_aux_loss_coef`` (Qwen3-VL-MoE: 0.001) unless ``model.router_aux_loss_coef`` sets
one. Transformers would add ``coef * aux`` to its own per-micro-batch mean loss; here it enters under
the project's normalisation contract instead (trainer.train_step): each micro-batch contributes
``coef * aux * (its labelled tokens)`` to the step's sum, which is divided by the step's global count
of labelled tokens, like the loss itself. So the step's aux loss is the token-weighted mean of the
micro-batches' (logged as ``train/aux_loss``, without the coefficient); ``train/loss`` stays the data
loss alone, comparable with a dense model's.

The load: per MoE layer, the share of the step's top-k assignments (unpadded tokens, all micro-batches
and ranks) each expert got, as the router itself chose them: where the family's router returns its
chosen experts (transformers' top-k routers: ``(logits, weights, indices)``), a forward hook keeps those
indices, so GLM-4.5V's choice (sigmoid of the logits plus the trained ``e_score_correction_bias``, top-k
within the best groups) is counted as made, not re-derived from the raw logits; a router that returns no
indices (Llama 4's: scores and logits) is counted from the top-k of its logits (its own choice); logged as the smallest and largest share over all layers and experts
(``1 / num_experts`` each when balanced) and the number of (layer, expert) pairs that got no token, so
a collapsing router shows. Everything stays on the device until the step's one read.

A family whose modeling code computes no load-balancing loss (transformers 5.24's Llama 4: its forward
returns the router logits but no ``aux_loss``, its module has no ``load_balancing_loss_func``) trains
without one: the expert load is still logged, ``train/aux_loss`` is not, and a recipe that sets a non-zero
``model.router_aux_loss_coef`` for it is refused at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ntil_ds.model.parts import num_experts, text_config_of


@dataclass
class RouterTerms:
    """What a MoE model's forwards add to the step: the aux loss and the experts' load."""

    coef: float
    num_experts: int
    top_k: int
    has_aux: bool = True  # False: the family's forward computes no aux loss (then coef is 0)
    last_aux: torch.Tensor | None = field(default=None, repr=False)
    last_counts: torch.Tensor | None = field(default=None, repr=False)  # [MoE layers, experts]
    # the routers' chosen experts, appended by forward hooks (None: the family's router returns none)
    chosen: list[torch.Tensor] | None = field(default=None, repr=False)

    # the forward is asked for the router logits (and so computes its aux loss)
    forward_kwargs: ClassVar[dict[str, bool]] = {"output_router_logits": True}

    def record(self, output: Any, attention_mask: torch.Tensor | None) -> None:
        """After a forward: its aux loss (with its graph) and its expert counts (no graph)."""
        aux, router_logits = getattr(output, "aux_loss", None), getattr(output, "router_logits", None)
        if (aux is None and self.has_aux) or not router_logits:
            raise RuntimeError(
                f"{type(output).__name__} has no aux_loss / router_logits although the forward was asked "
                "for them (output_router_logits=True)"
            )
        self.last_aux = aux
        chosen = None
        if self.chosen and len(self.chosen) >= len(router_logits):
            chosen = tuple(self.chosen[-len(router_logits) :])  # this forward's, one per MoE layer
        self.last_counts = expert_counts(router_logits, self.top_k, self.num_experts, attention_mask, chosen)

    def objective_sum(self, loss_sum: torch.Tensor, num_targets: int) -> torch.Tensor:
        """The last forward's summed loss plus its aux term, both over its labelled tokens (the trainer
        divides by the step's global count). Added even at coef 0: then it changes no gradient."""
        return loss_sum + self.coef * self.last_aux * num_targets if self.has_aux else loss_sum

    def add_sums(self, sums: dict[str, torch.Tensor], num_targets: int) -> None:
        """The last forward's aux term and counts into the step's device sums."""
        parts = {"expert_counts": self.last_counts}
        if self.has_aux:
            parts["aux_sum"] = self.last_aux.detach().double() * num_targets
        for name, value in parts.items():
            sums[name] = sums[name] + value if name in sums else value


def router_terms_for(model: torch.nn.Module, coef: float | None) -> RouterTerms | None:
    """The router terms of a MoE model (None for a dense one); ``coef``: the recipe's, None for the
    family's own (its config's ``router_aux_loss_coef``)."""
    count = num_experts(model.config)
    if not count:
        return None
    text = text_config_of(model.config)
    if not computes_aux_loss(model):
        if coef:
            raise ValueError(
                f"model.router_aux_loss_coef={coef}: {type(_base(model)).__name__}'s forward computes no "
                "router load-balancing loss in this transformers (its modeling code has no "
                "load_balancing_loss_func); remove model.router_aux_loss_coef (the expert load is still logged)"
            )
        return RouterTerms(
            coef=0.0,
            num_experts=count,
            top_k=int(text.num_experts_per_tok),
            has_aux=False,
            chosen=record_chosen_experts(model),
        )
    own = getattr(text, "router_aux_loss_coef", None)
    if coef is None and own is None:
        raise ValueError(
            f"{type(model).__name__} has experts but its config names no router_aux_loss_coef; "
            "set model.router_aux_loss_coef"
        )
    return RouterTerms(
        coef=float(own if coef is None else coef),
        num_experts=count,
        top_k=int(text.num_experts_per_tok),
        chosen=record_chosen_experts(model),
    )


def record_chosen_experts(model: torch.nn.Module) -> list[torch.Tensor] | None:
    """A list that forward hooks on the model's routers fill with each forward's chosen experts
    (``[tokens, top_k]`` per MoE layer, in layer order), or None when its routers return no indices.

    The routers are the modules transformers records ``router_logits`` from (the model's
    ``_can_record_outputs``); a router's output whose last element is an integer tensor is its choice
    (transformers' top-k routers end ``return router_logits, weights, indices``)."""
    router_classes = set()
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            router_classes.add(recorder.target_class)
    routers = [m for m in model.modules() if type(m) in router_classes]
    if not routers:
        return None
    chosen: list[torch.Tensor] = []

    def keep(module, inputs, output) -> None:
        last = output[-1] if isinstance(output, tuple) else None
        if isinstance(last, torch.Tensor) and not last.is_floating_point():
            chosen.append(last.detach())  # (a router returning no indices appends nothing)

    for router in routers:
        router.register_forward_hook(keep)
    # each forward starts empty (an evaluation forward records nothing; a checkpointed layer's recompute
    # in the backward appends after the forward was recorded)
    model.register_forward_pre_hook(lambda module, inputs: chosen.clear())
    return chosen


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself without one)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def computes_aux_loss(model: torch.nn.Module) -> bool:
    """Whether the model's own modeling code computes the router's load-balancing loss (transformers
    defines ``load_balancing_loss_func`` in each MoE family's modeling module that has one)."""
    import sys

    module = sys.modules.get(type(_base(model)).__module__)
    return module is not None and hasattr(module, "load_balancing_loss_func")


def expert_counts(
    router_logits: tuple[torch.Tensor, ...],
    top_k: int,
    experts: int,
    attention_mask: torch.Tensor | None,
    chosen_by_router: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``[layers, experts]``: how many top-k assignments of the unpadded tokens each expert got:
    ``chosen_by_router`` (each layer's ``[tokens, top_k]`` as the router chose), else the top-k of the
    logits (the choice of a softmax or plain sigmoid router)."""
    counts = []
    for index, layer in enumerate(router_logits):
        if chosen_by_router is not None:
            chosen = chosen_by_router[index].reshape(-1, top_k)
        else:
            chosen = layer.detach().topk(top_k, dim=-1).indices  # [tokens, top_k]
        weight = torch.ones(chosen.shape[0], dtype=torch.float64, device=chosen.device)
        if attention_mask is not None:
            weight = attention_mask.reshape(-1).to(chosen.device, torch.float64)
        zeros = torch.zeros(experts, dtype=torch.float64, device=chosen.device)
        counts.append(zeros.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k)))
    return torch.stack(counts)


def router_metrics(host: dict[str, Any], labelled: float, tp: int, experts: int) -> dict[str, float]:
    """The step's ``aux_loss`` and expert load from its summed host values (empty for a dense model)."""
    if "expert_counts" not in host:
        return {}
    counts = torch.tensor(host["expert_counts"], dtype=torch.float64).reshape(-1, experts) / tp
    shares = counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)
    aux = {"aux_loss": host["aux_sum"] / tp / max(labelled, 1.0)} if "aux_sum" in host else {}
    return {
        **aux,
        "expert_share_min": float(shares.min()),
        "expert_share_max": float(shares.max()),
        "experts_unused": float((counts == 0).sum()),
    }
