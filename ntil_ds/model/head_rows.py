"""``lora.head=number_rows``: of the output head, only the rows of the tokens NTIL reads train, as a delta.

Why: ``lora.head=full`` (peft's ``modules_to_save``) trains every row of the head, V x H parameters
(0.62 B in Qwen3-VL-8B) with their gradients and optimizer states, and peft keeps a frozen copy of the
original next to the trained one. NTIL reads the head's rows of the ten digits (and of ``-`` and ``.``
when ``loss.signed_numbers`` / ``loss.decimal_numbers`` make it read them), and its gradient reaches the
adapters through a frozen head anyway. Here the head stays frozen and a trained ``[k, H]`` delta is
added to those k rows: ``logits[..., rows] += hidden @ delta.T``, i.e. the head ``W + scatter(rows, delta)``.
The delta's gradient is the full head's gradient restricted to those rows; no other row changes.

- The head module keeps its name and weight (``lm_head.weight``; the tied matrix itself for tied
  embeddings), with the delta next to it (``lm_head.delta``): an ordinary parameter that
  ``deepspeed.initialize`` partitions under ZeRO-3 like the adapters, and that checkpoints hold with
  its optimizer state. QLoRA keeps the head 16-bit (``quantize.unquantized_module_patterns``).
- Tied input/output embeddings (Gemma 3): the delta changes the head's output only, not the input
  embedding, so the merged export unties them (``tie_word_embeddings: false``, its own ``lm_head.weight``).
- Memory: the head's output passes through one out-of-place ``index_add`` (a logits-sized tensor for a
  moment, the one it replaces is freed at once; within the estimator's 2 x logits for logits and loss).
- Export (:mod:`ntil_ds.export`): ``merged/`` holds ``W`` with the delta added to its rows. The adapter
  folder holds the delta in peft's own format, as a LoRA of rank k on ``lm_head``: ``lora_A`` the delta,
  ``lora_B`` the one-hot ``[V, k]`` matrix of the rows, alpha = r = k (scaling 1), so that
  ``PeftModel.from_pretrained`` loads it back with nothing of ntil-ds (:func:`as_peft_lora`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class NumberRowsHead(nn.Linear):
    """The frozen output head (same weight and bias parameters) plus a trained delta on ``rows``."""

    def __init__(self, head: nn.Linear, rows: Sequence[int]) -> None:
        # Built on the meta device, then given the head's own parameters: no copy of a V x H matrix (and
        # under ZeRO-3 the head's weight is already partitioned; it stays that same parameter).
        with torch.device("meta"):
            super().__init__(head.in_features, head.out_features, bias=head.bias is not None)
        self.weight = head.weight
        self.bias = head.bias
        rows = list(rows)
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < head.out_features for r in rows):
            raise ValueError(
                f"lora.head=number_rows needs distinct token ids below the vocabulary ({head.out_features}), "
                f"got {rows}"
            )
        device = head.weight.device
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.long, device=device), persistent=False)
        self.delta = nn.Parameter(
            torch.zeros(len(rows), head.in_features, dtype=head.weight.dtype, device=device)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        return logits.index_add(-1, self.rows, F.linear(hidden, self.delta).to(logits.dtype))


def attach_number_rows(model: nn.Module, rows: Sequence[int]) -> NumberRowsHead:
    """Replace ``model``'s output head (a transformers model: ``lm_head``) by a :class:`NumberRowsHead`;
    the head's own parameters stay frozen as they were."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"lora.head=number_rows needs a linear output head; {type(model).__name__} has {type(head)}"
        )
    wrapped = NumberRowsHead(head, rows)
    model.set_output_embeddings(wrapped)
    return wrapped


def number_rows_head(model: nn.Module) -> NumberRowsHead | None:
    return next((m for m in model.modules() if isinstance(m, NumberRowsHead)), None)


def fold_delta(weight: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``weight`` with ``delta`` added to its ``rows`` (in fp32, then back to the weight's dtype)."""
    return (
        weight.float().index_add(0, rows.to(weight.device), delta.float().to(weight.device)).to(weight.dtype)
    )


def as_peft_lora(delta: torch.Tensor, rows: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lora_A, lora_B)`` of a rank-k LoRA on the head that adds exactly ``delta`` to ``rows`` at
    scaling 1: ``B @ A = scatter(rows, delta)`` (B one-hot, so every product is exact)."""
    k = len(rows)
    one_hot = torch.zeros(vocab, k, dtype=delta.dtype)
    one_hot[rows.cpu(), torch.arange(k)] = 1
    return delta.detach().cpu().clone(), one_hot
