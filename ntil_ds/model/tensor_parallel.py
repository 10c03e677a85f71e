"""Where this rank's slice of the vocabulary lives after DeepSpeed AutoTP sharded the output head.

With ``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}`` DeepSpeed (0.19.8)
replaces the model's ``lm_head`` (or ``embed_out``) by a ``VocabParallelLinear`` that keeps its output
rank-local: each rank of a tensor-parallel group gets logits ``[B, T, vocab_end - vocab_start]`` for
the rows ``[vocab_start, vocab_end)`` of the vocabulary (uneven splits allowed: V=1003 on 2 ranks is
502 + 501). The module carries ``is_vocab_parallel_lm_head``, ``vocab_start_index``,
``vocab_end_index``, ``vocab_size`` (the full V), ``tp_world_size`` and ``mp_group`` (the group to
reduce over). This module only *reads* those attributes, so it needs no deepspeed import.

The trainer passes the result to the loss::

    shard = find_vocab_shard(engine.module, autotp_size)
    loss_fn(logits, labels,
            process_group=shard.process_group if shard else None,
            vocab_start=shard.vocab_start if shard else 0,
            generator=gumbel_generator)  # seeded the same on every rank of the TP group

Without ``vocab_parallel_lm_head`` AutoTP all-gathers the head's output, so every rank would hold the
full-vocabulary logits: with ``autotp_size > 1`` that is refused here, at start.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn

from ntil_ds.config import ConfigError

# The names DeepSpeed AutoTP recognises as a vocabulary head (module_inject/auto_tp.py).
_HEAD_NAMES = ("lm_head", "embed_out")


class VocabShard(NamedTuple):
    """This rank's vocabulary rows ``[vocab_start, vocab_end)`` and the group that holds the others."""

    process_group: Any  # torch.distributed.ProcessGroup of the tensor-parallel group
    vocab_start: int
    vocab_end: int


def output_head(model: nn.Module) -> nn.Module:
    """The module that produces the logits: ``get_output_embeddings()``, else a child named lm_head."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None:
        return head
    found = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in _HEAD_NAMES]
    if len(found) != 1:
        raise ValueError(
            f"cannot find the output head of {type(model).__name__}: expected one module named "
            f"{' or '.join(_HEAD_NAMES)}, found {len(found)}"
        )
    return found[0]


def find_vocab_shard(model: nn.Module, autotp_size: int) -> VocabShard | None:
    """The vocabulary shard of the AutoTP-built output head, or None when the head is not sharded.

    ``model`` is the module DeepSpeed wraps (``engine.module``), after ``deepspeed.initialize``.
    ``autotp_size`` is ``tensor_parallel.autotp_size`` of the DeepSpeed config (1 or absent: no TP).
    Raises :class:`ConfigError` when ``autotp_size > 1`` but the head was not made vocab-parallel,
    and ``ValueError`` when the head's attributes contradict ``autotp_size``.
    """
    head = output_head(model)
    if not getattr(head, "is_vocab_parallel_lm_head", False):
        if autotp_size > 1:
            raise ConfigError(
                f"tensor_parallel.autotp_size={autotp_size} but the output head "
                f"({type(head).__name__}) is not vocab-parallel: every rank would compute the "
                'full-vocabulary logits. Add "vocab_parallel_lm_head": true to "tensor_parallel" in the '
                "DeepSpeed JSON (see configs/deepspeed/zero3_autotp.json)"
            )
        return None

    missing = [a for a in ("vocab_start_index", "vocab_end_index", "mp_group") if not hasattr(head, a)]
    if missing:
        raise ValueError(
            f"the vocab-parallel head {type(head).__name__} lacks {', '.join(missing)}: this DeepSpeed "
            "version builds AutoTP heads differently from 0.19.8, which this code was written against"
        )
    start, end = int(head.vocab_start_index), int(head.vocab_end_index)
    tp_world_size = int(getattr(head, "tp_world_size", autotp_size))
    if head.mp_group is None or tp_world_size != autotp_size:
        raise ValueError(
            f"the vocab-parallel head is split over {tp_world_size} ranks (group {head.mp_group!r}) but "
            f"tensor_parallel.autotp_size={autotp_size}"
        )
    if not 0 <= start < end:
        raise ValueError(
            f"the vocab-parallel head has an empty or negative vocabulary slice [{start}, {end})"
        )
    return VocabShard(process_group=head.mp_group, vocab_start=start, vocab_end=end)
