"""Stage 1 of the loss from the hidden states, at the labelled positions only, in chunks: the output head
and the vocabulary stage fused, so that no logits tensor bigger than a chunk ever exists.

Fine-tuning data for numeric answers is mostly prompt (a clock sample: ~310 tokens, a 5-7 token answer),
so the head runs on the rows that have a target. :func:`labelled_position_stats` takes their hidden
states ``[R, H]`` and the head (:class:`OutputHead`: weight, bias, what the family applies after it) and
returns what :func:`ntil_ds.loss.vocab_stats.position_stats` returns for the same rows of the full
logits: per row the cross-entropy, the digit (and minus) column logits, the row max and the payload.

- Forward: for each chunk of ``chunk_rows`` rows, its logits ``[chunk, V_local]`` are computed, reduced to
  per-row numbers (the torch tiles or the Triton kernels of the vocabulary stage) and dropped. On a
  vocabulary shard the ranks combine all rows in the stage's two all-reduces once, not per chunk.
- Backward: each chunk's logits are recomputed (one extra matmul), turned into their gradient from the
  rows' CE and column gradients and dropped after giving the gradients of the hidden states, the head
  weight, its bias and the row delta. On a shard the hidden states' gradient is summed over the group
  (the head is column-parallel: each rank saw its slice of the vocabulary).
- Extra memory: one chunk's logits and their gradient, whatever the number of rows.
- The head's weight must be whole during the backward: under ZeRO-3 the caller runs this inside the head
  module's forward, so DeepSpeed's own hooks gather the weight for the forward and again when the
  gradient reaches the module's output (:mod:`ntil_ds.labelled_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ntil_ds.loss.vocab_stats import (
    compute_dtype,
    full_row_stats,
    kernel_wanted,
    logits_gradient,
    reduce_rows,
    row_partials,
)

# Rows per chunk: 2**27 logits elements (256 MiB in bf16, 512 MiB in fp32) at most at Qwen2-VL's
# vocabulary of 151,936 that is 883 rows; at least 1 row, whatever the vocabulary.
CHUNK_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class OutputHead:
    """How the model turns a final hidden state into logits, as the labelled head computes it:
    ``softcap(h @ weight.T + bias)``, with ``row_delta`` added to the rows it names first.

    ``weight`` is this rank's ``[V_local, H]`` (the parameter itself: its gradient reaches it through
    autograd); ``row_delta``: ``(local row ids [k], delta [k, H])`` (lora.head=number_rows trains only
    the digit rows as a delta on a frozen head); ``softcap``: a family's final logit softcapping
    ``cap * tanh(z / cap)`` (Gemma's ``final_logit_softcapping``), None for none."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    row_delta: tuple[torch.Tensor, torch.Tensor] | None = None
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, V_local]`` logits of ``[R, H]`` hidden states, in the hidden states' dtype."""
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.row_delta is not None:
            rows, delta = self.row_delta
            logits = logits.index_add(1, rows, hidden @ delta.t())
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def chunk_rows_for(local_vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, local_vocab))


def labelled_position_stats(
    hidden: torch.Tensor,
    head: OutputHead,
    targets: torch.Tensor,
    column_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    process_group: dist.ProcessGroup | None = None,
    payload: torch.Tensor | None = None,
    kernel: str = "auto",
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row cross-entropy, column logits, row max and payload of ``head.logits(hidden)``, never
    holding those logits whole (see the module docstring). ``hidden`` ``[R, H]``; the other arguments as
    :func:`ntil_ds.loss.vocab_stats.position_stats`'s."""
    if payload is not None and process_group is not None and dist.get_rank(process_group) != 0:
        payload = torch.zeros_like(payload)
    rows, delta = head.row_delta if head.row_delta is not None else (None, None)
    chunk = chunk_rows or chunk_rows_for(head.weight.shape[0])
    return _LabelledHeadStats.apply(
        hidden, head.weight, head.bias, delta, rows, head, targets, column_ids, vocab_start,
        process_group, payload, kernel, chunk,
    )  # fmt: skip


class _LabelledHeadStats(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, delta, delta_rows, head, targets, column_ids, vocab_start, process_group,
        payload, kernel_choice, chunk,
    ):  # fmt: skip
        # As in vocab_stats._PositionStats: outputs without a gradient arrive as None, not zero tensors.
        ctx.set_materialize_grads(False)
        num_rows = hidden.shape[0]
        kernel = kernel_wanted(hidden, kernel_choice)  # the logits have the hidden states' dtype and device
        # No labelled row (a rank's micro-batch can have none) is one empty chunk: the head still gets its
        # (zero) gradient, which ZeRO reduces on every rank alike.
        spans = [(start, min(start + chunk, num_rows)) for start in range(0, num_rows, chunk)] or [(0, 0)]
        pieces = []
        for start, stop in spans:
            logits = head.logits(hidden[start:stop])
            if process_group is None:
                pieces.append(full_row_stats(logits, targets[start:stop], column_ids, kernel))
            else:
                pieces.append(row_partials(logits, targets[start:stop], column_ids, vocab_start, kernel))
            del logits
        if process_group is None:
            ce, columns, row_max, log_sum_exp = (_cat(part) for part in zip(*pieces, strict=True))
            payload_out = None if payload is None else payload.to(ce.dtype, copy=True)
        else:
            local_max, packed = (_cat(part) for part in zip(*pieces, strict=True))
            ce, columns, row_max, log_sum_exp, payload_out = reduce_rows(
                local_max, packed, targets, column_ids.numel(), process_group, payload
            )
        ctx.head, ctx.kernel, ctx.spans = head, kernel, spans
        ctx.vocab_start, ctx.process_group = vocab_start, process_group
        ctx.save_for_backward(hidden, log_sum_exp, targets, column_ids)
        ctx.mark_non_differentiable(row_max, *([] if payload_out is None else [payload_out]))
        return ce, columns, row_max, payload_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ce, grad_columns, _grad_row_max, _grad_payload):
        hidden, log_sum_exp, targets, column_ids = ctx.saved_tensors
        head: OutputHead = ctx.head
        want_hidden, want_weight, want_bias, want_delta = ctx.needs_input_grad[:4]
        weight = head.weight
        rows, delta = head.row_delta if head.row_delta is not None else (None, None)
        # Gradients summed over chunks are summed in fp32 (fp64 for fp64), each chunk's product rounded
        # once into it; with one chunk the product is the gradient, rounded once as on whole logits.
        acc = compute_dtype(hidden.dtype) if len(ctx.spans) > 1 else hidden.dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None  # each row written once
        grad_weight = grad_bias = grad_delta = None
        for start, stop in ctx.spans:
            h = hidden[start:stop]
            logits = head.logits(h)
            grad = logits_gradient(
                logits, log_sum_exp[start:stop], targets[start:stop], column_ids, ctx.vocab_start,
                None if grad_ce is None else grad_ce[start:stop],
                None if grad_columns is None else grad_columns[start:stop], ctx.kernel,
            )  # fmt: skip
            if head.softcap is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2 = 1 - (logits / cap)^2
                grad = grad * (1 - (logits.to(grad.dtype) / head.softcap) ** 2)
            grad = grad.to(h.dtype)
            if grad_hidden is not None:
                part = grad @ weight
                if rows is not None:
                    part = part + grad.index_select(1, rows) @ delta
                grad_hidden[start:stop] = part
            if want_weight:
                grad_weight = _accumulate(grad_weight, _product_in(acc, grad.t(), h))
            if want_bias:
                grad_bias = _accumulate(grad_bias, grad.to(compute_dtype(h.dtype)).sum(dim=0))
            if want_delta:
                grad_delta = _accumulate(grad_delta, _product_in(acc, grad.index_select(1, rows).t(), h))
            del logits, grad
        if grad_hidden is not None and ctx.process_group is not None:
            # column-parallel head: each rank's part of dL/dh comes from its slice of the vocabulary
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.process_group)
        pairs = (
            (grad_hidden, hidden),
            (grad_weight, head.weight),
            (grad_bias, head.bias),
            (grad_delta, delta),
        )
        grads = [None if g is None else g.to(like.dtype) for g, like in pairs]
        return (*grads, None, None, None, None, None, None, None, None, None)


def _accumulate(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total.add_(part)


def _product_in(acc: torch.dtype, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` rounded once, in ``acc``: a chunk's contribution to a gradient summed over chunks
    must not be rounded to bf16 first (that rounding, once per chunk, is what the whole-logits matmul
    avoids). CUDA multiplies bf16 into fp32 directly; elsewhere the operands are upcast."""
    if left.dtype == acc:
        return left @ right
    if left.is_cuda:
        return torch.mm(left, right, out_dtype=acc)
    return left.to(acc) @ right.to(acc)


def _cat(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def rows_of(positions_per_row: torch.Tensor, length: int) -> torch.Tensor:
    """Flat position ids ``b * length + t`` of ``[B, K]`` per-row positions (for gathering per-position
    tensors drawn over the whole batch, such as the Gumbel noise, at the labelled rows)."""
    batch = positions_per_row.shape[0]
    return (
        positions_per_row + length * torch.arange(batch, device=positions_per_row.device)[:, None]
    ).flatten()
