"""What one micro-batch costs: the model's forward and the loss on its output, for the trainer to
differentiate and for evaluation to score.

With ``loss.logits=labelled`` (the default) the output head runs only at the positions with a target,
fused with the loss's vocabulary stage (:mod:`ntil_ds.labelled_forward`); with ``all`` the model returns
its logits at every position and the loss reads them. Both give the same loss and gradients.

The model is called without ``labels=`` (Hugging Face would compute its own loss on full-vocabulary
logits, which may not exist here); its logits are this rank's vocabulary slice under AutoTP's
vocab-parallel head (:class:`~ntil_ds.model.tensor_parallel.VocabShard`), and the loss works on that
slice. The targets come aligned from the data (``MicroBatch.targets``): nothing here shifts.

The loss's Gumbel noise comes from :func:`gumbel_generator`: a function of (seed, step, micro-batch,
data-parallel rank) only, so every rank of a tensor-parallel group draws the same noise and a resumed run
draws what the first run drew.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import all_gather_tensors
from ntil_ds.engine import TrainingEngine
from ntil_ds.labelled_forward import (
    applied_softcap,
    head_module,
    head_returns_row_stats,
    loss_from_rows,
    row_inputs,
)
from ntil_ds.loss import NTILLoss, NTILOutput
from ntil_ds.loss.sequence_shards import AllGatherInGroup, SequenceShard
from ntil_ds.model.parts import has_vision
from ntil_ds.model.sequence_parallel import slice_after_merge
from ntil_ds.model.tensor_parallel import VocabShard
from ntil_ds.moe import RouterTerms, router_metrics


@dataclass
class Objective:
    """The forward and the loss of a micro-batch on this rank."""

    engine: TrainingEngine
    loss_fn: Any  # NTILLoss or NTLLoss: __call__(logits, targets, ...) -> NTILOutput
    vocab_shard: VocabShard | None
    device: torch.device
    dtype: torch.dtype  # the model's floating dtype: pixels are cast to it
    labelled_head: bool = True  # loss.logits=labelled (the loss must be NTILLoss)
    router: RouterTerms | None = None  # a mixture of experts: its aux loss and expert load (moe.py)
    # parallel.sequence_parallel_size > 1: the ranks holding the other slices of a sliced micro-batch's rows
    sequence_group: Any | None = None

    def __post_init__(self) -> None:
        # under sequence parallelism a multimodal model takes whole rows and slices after merging images
        self.multimodal = has_vision(self.engine.module.config)
        if self.labelled_head:
            if not isinstance(self.loss_fn, NTILLoss):
                raise TypeError(f"loss.logits=labelled needs NTILLoss, got {type(self.loss_fn).__name__}")
            model = self.engine.module
            self.head, self.softcap = head_module(model), applied_softcap(model)

    def loss(
        self, micro_batch: MicroBatch, generator: torch.Generator | None, step: int | None = None
    ) -> NTILOutput:
        """Forward + loss (under ZeRO-3: one gather of every parameter). ``step``: the 0-based optimizer
        step being taken, which the loss's lambda ramp reads (None: evaluation, the full lambda)."""
        if not self.labelled_head:
            return self.loss_of_logits(self.logits(micro_batch), micro_batch, generator, step)
        labels, extra = micro_batch.loss_inputs(self.device)
        rows = micro_batch.labelled_rows.to(self.device, non_blocking=True)
        sequence = self.sequence_shard(micro_batch)
        targets, noise, payload = row_inputs(
            self.loss_fn, labels, rows, self.dtype, generator, self.vocab_shard is not None, sequence
        )
        model = self.engine.module
        with head_returns_row_stats(
            model, self.head, self.loss_fn, rows, targets, payload, self.vocab_shard, self.softcap
        ):
            row_stats = self.logits(micro_batch)
        unpack_index = extra.get("unpack_index")
        return loss_from_rows(self.loss_fn, labels, rows, row_stats, noise, unpack_index, step, sequence)

    def sequence_shard(self, micro_batch: MicroBatch) -> SequenceShard | None:
        """Where the rest of a sliced micro-batch's rows is (None: it holds whole rows)."""
        if micro_batch.sequence is None:
            return None
        return SequenceShard(self.sequence_group, micro_batch.sequence)

    def logits(self, micro_batch: MicroBatch) -> torch.Tensor:
        """``[B, T, V_local]``: this rank's vocabulary slice of the logits."""
        inputs = micro_batch.model_inputs(self.device, self.dtype)
        extra = self.router.forward_kwargs if self.router is not None else {}
        # A multimodal model's sliced micro-batch: whole rows in, the language model takes this rank's slice.
        whole_rows = micro_batch.whole_rows is not None
        sliced = slice_after_merge(
            self.engine.module, micro_batch.sequence, self.sequence_group, AllGatherInGroup.apply
        )
        with sliced if whole_rows else nullcontext():
            output = self.engine.forward(**inputs, use_cache=False, **extra)
        if self.router is not None:
            self.router.record(output, inputs.get("attention_mask"))
        return output.logits

    def step_sum(self, out: NTILOutput, micro_batch: MicroBatch) -> torch.Tensor:
        """What the trainer differentiates for the last micro-batch (before its division by the step's
        count): the summed loss, plus a MoE model's aux term over the same tokens."""
        if self.router is None:
            return out.loss_sum
        return self.router.objective_sum(out.loss_sum, micro_batch.num_targets)

    def add_router_sums(self, sums: dict[str, torch.Tensor], micro_batch: MicroBatch) -> None:
        if self.router is not None:
            self.router.add_sums(sums, micro_batch.num_targets)

    def router_metrics(self, host: dict[str, Any], labelled: float, tp: int) -> dict[str, float]:
        """A MoE model's aux loss and expert load of the step (nothing for a dense model)."""
        return {} if self.router is None else router_metrics(host, labelled, tp, self.router.num_experts)

    def loss_of_logits(
        self,
        logits: torch.Tensor,
        micro_batch: MicroBatch,
        generator: torch.Generator | None,
        step: int | None = None,
    ) -> NTILOutput:
        targets, extra = micro_batch.loss_inputs(self.device)
        if micro_batch.sequence is not None:  # NTILLoss: the config refuses the others
            extra["sequence"] = self.sequence_shard(micro_batch)
        shard = self.vocab_shard
        return self.loss_fn(
            logits,
            targets,
            process_group=shard.process_group if shard else None,
            vocab_start=shard.vocab_start if shard else 0,
            generator=generator,
            step=step,
            **extra,  # unpack_index: NTIL's per-sequence terms per packed sample
        )

    def argmax_over_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The predicted token id at every position, over the whole vocabulary."""
        values, index = logits.max(dim=-1)
        shard = self.vocab_shard
        if shard is None:
            return index
        # Vocab-parallel: each rank knows the best token of its slice; the group picks the best slice.
        all_values = all_gather_tensors(values, shard.process_group)
        all_index = all_gather_tensors(index + shard.vocab_start, shard.process_group)
        best = torch.stack(all_values).argmax(dim=0, keepdim=True)
        return torch.stack(all_index).gather(0, best).squeeze(0)


def gumbel_generator(
    seed: int, step: int, micro_index: int, dp_rank: int, device: torch.device, *, evaluation: bool = False
) -> torch.Generator:
    """The loss's noise source for one micro-batch: equal on the ranks of a tensor-parallel group, and the
    same after a resume (see the module docstring)."""
    purpose = 1 if evaluation else 0
    sequence = np.random.SeedSequence([seed, purpose, step, micro_index, dp_rank])
    generator = torch.Generator(device=device)
    generator.manual_seed(int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1))
    return generator
