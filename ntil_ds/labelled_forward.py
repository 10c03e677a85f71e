"""The model's forward with the loss's first stage in place of its logits (``loss.logits=labelled``).

Fine-tuning data for numeric answers is mostly prompt: ~2 % of a clock sample's positions carry a target.
Here the model runs as always up to its last hidden state; then, instead of its output head's logits at
every position, the head module returns the vocabulary stage of the loss at the labelled positions only,
computed chunk by chunk (:func:`ntil_ds.loss.labelled_head.labelled_position_stats`: no logits tensor
bigger than a chunk exists, the backward recomputes each chunk).

Why inside the head module's forward: ZeRO-3 gathers a module's parameters around that module's call
and again when the gradient reaches the module's output. Computing the statistics there, and returning
them as the module's output, keeps the head weight's gather, release and gradient reduction exactly
DeepSpeed's own (once per micro-batch, not per chunk), for tied embeddings too. Under AutoTP the head
module is DeepSpeed's vocab-parallel linear: each rank computes its slice's statistics and the ranks
combine them in the stage's two all-reduces, as for full logits.

The head module returns ``[1, R, 2 + C (+ P)]``: per labelled row the cross-entropy, the C column logits
(digits, minus), the row max and the payload (the Gumbel noise a vocabulary shard receives from its
group's first rank). :func:`loss_from_rows` puts them back at their positions ``[B*T]`` (zeros
elsewhere, where nothing reads them), so the number stage sees the same tensors as on full logits:
numbers stay whole and two numbers never join, whatever lies between them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ntil_ds.config import ConfigError
from ntil_ds.loss import NTILLoss, NTILOutput
from ntil_ds.loss.labelled_head import OutputHead, labelled_position_stats
from ntil_ds.loss.sequence_shards import SequenceShard
from ntil_ds.loss.vocab_stats import compute_dtype
from ntil_ds.model.head_rows import NumberRowsHead
from ntil_ds.model.tensor_parallel import VocabShard, output_head


def head_module(model: nn.Module) -> nn.Module:
    """The module whose call computes the logits: the output head, or under ``lora.head=full`` peft's
    trained copy of it (the wrapper calls that copy, whose parameters are the ones trained)."""
    head = output_head(model)
    copies = getattr(head, "modules_to_save", None)  # peft's ModulesToSaveWrapper
    if copies is not None:
        active = getattr(head, "active_adapters", None) or [head.active_adapter]
        head = copies[active[0]]
    if not (isinstance(head, nn.Linear) or getattr(head, "is_vocab_parallel_lm_head", False)):
        raise ConfigError(
            f"loss.logits=labelled computes the output head itself and knows a linear head (also "
            f"lora.head=number_rows and AutoTP's vocab-parallel head); this model's is {type(head).__name__}: "
            "set loss.logits=all"
        )
    return head


def applied_softcap(model: nn.Module) -> float | None:
    """A final logit softcapping the model class applies after its head (Gemma's ``cap * tanh(z / cap)``,
    read from ``config.final_logit_softcapping`` of the causal-LM class itself; transformers' MLLM
    wrappers of those families do not apply it)."""
    config = getattr(_transformers_model(model), "config", None)
    cap = vars(config).get("final_logit_softcapping") if config is not None else None
    return None if cap is None else float(cap)


def _transformers_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft's PeftModel
    return get_base() if callable(get_base) else model


@contextlib.contextmanager
def head_returns_row_stats(
    model: nn.Module,
    head: nn.Module,
    loss_fn: NTILLoss,
    rows: torch.Tensor,
    targets: torch.Tensor,
    payload: torch.Tensor | None,
    shard: VocabShard | None,
    softcap: float | None,
) -> Iterator[None]:
    """Within: the head module's forward returns the row statistics of ``rows`` (flat positions of the
    ``[B, T]`` hidden states) instead of logits; the model's own softcapping is off (the head applies it)."""
    column_ids = loss_fn.column_ids_on(rows.device)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        row_delta = (head.rows, head.delta) if isinstance(head, NumberRowsHead) else None
        spec = OutputHead(weight=head.weight, bias=head.bias, row_delta=row_delta, softcap=softcap)
        return row_stats(hidden, spec, rows, targets, column_ids, shard, payload, loss_fn.kernel)

    config = getattr(_transformers_model(model), "config", None)
    own_forward = vars(head).get("forward")  # an instance attribute someone else set, kept
    head.forward = forward
    if softcap is not None:
        config.final_logit_softcapping = None
    try:
        yield
    finally:
        if own_forward is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own_forward
        if softcap is not None:
            config.final_logit_softcapping = softcap


def row_stats(
    hidden: torch.Tensor,
    head: OutputHead,
    rows: torch.Tensor,
    targets: torch.Tensor,
    column_ids: torch.Tensor,
    shard: VocabShard | None,
    payload: torch.Tensor | None,
    kernel: str,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``[1, R, 2 + C (+ P)]``: the statistics of the hidden states ``[..., H]`` at the flat ``rows``
    (``chunk_rows``: rows per chunk, by default as many as fit ``CHUNK_ELEMENTS`` logits)."""
    ce, columns, row_max, received = labelled_position_stats(
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),
        head,
        targets,
        column_ids,
        vocab_start=shard.vocab_start if shard else 0,
        process_group=shard.process_group if shard else None,
        payload=payload,
        kernel=kernel,
        chunk_rows=chunk_rows,
    )
    parts = [ce[:, None], columns, row_max[:, None], *([] if received is None else [received])]
    return torch.cat(parts, dim=1)[None]


def row_inputs(
    loss_fn: NTILLoss,
    labels: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    generator: torch.Generator | None,
    vocab_parallel: bool,
    sequence: SequenceShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(targets at rows, noise [B*T, 20] or None, payload at rows or None)``. The noise is drawn over
    every position as on full logits (same generator use, same numbers); a vocabulary shard sends its
    labelled rows' noise from the group's first rank inside the stage's all-reduce. ``sequence``: the
    labels are this rank's slice of rows split over a sequence-parallel group."""
    targets, noise = loss_fn.position_targets_and_noise(labels, compute_dtype(dtype), generator, sequence)
    payload = noise.index_select(0, rows) if vocab_parallel and noise is not None else None
    return targets.index_select(0, rows), noise, payload


def loss_from_rows(
    loss_fn: NTILLoss,
    labels: torch.Tensor,
    rows: torch.Tensor,
    row_stats: torch.Tensor,
    noise: torch.Tensor | None,
    unpack_index: torch.Tensor | None,
    step: int | None = None,
    sequence: SequenceShard | None = None,
) -> NTILOutput:
    """The loss from the head module's output ``[1, R, 2 + C (+ P)]`` (see the module docstring); ``step``:
    the optimizer step, for the loss's lambda ramp; ``sequence``: this rank's share of rows split over a
    sequence-parallel group."""
    stats = row_stats[0]
    num_columns = loss_fn.column_ids_on(labels.device).numel()
    num_positions = labels.numel()

    def at_positions(values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        shape = (num_positions, *values.shape[1:])
        return values.new_full(shape, fill).index_put((rows,), values)

    ce = at_positions(stats[:, 0])
    columns = at_positions(stats[:, 1 : 1 + num_columns])
    # +inf where unlabelled (columns 0 above): the contract of vocab_stats.unlabelled_rows_filled, which the
    # full path fills in the same way; no column reaches +inf, so no such position reads as a minus sign.
    row_max = at_positions(stats[:, 1 + num_columns].detach(), float("inf"))
    if stats.shape[1] > 2 + num_columns:  # the payload: the noise as the group's first rank drew it
        noise = at_positions(stats[:, 2 + num_columns :].detach())
    return loss_fn.from_position_stats(labels, ce, columns, row_max, noise, unpack_index, step, sequence)
