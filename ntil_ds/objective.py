"""What one micro-batch costs: the model's forward and the loss on its output, for the trainer to
differentiate and for evaluation to score.

The model is called without ``labels=`` (Hugging Face would compute its own loss on full-vocabulary
logits, which may not exist here); its logits are this rank's vocabulary slice under AutoTP's
vocab-parallel head (:class:`~ntil_ds.model.tensor_parallel.VocabShard`), and the loss works on that
slice. The targets come aligned from the data (``MicroBatch.targets``): nothing here shifts.

The loss's Gumbel noise comes from :func:`gumbel_generator`: a function of (seed, step, micro-batch,
data-parallel rank) only, so every rank of a tensor-parallel group draws the same noise and a resumed run
draws what the first run drew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import all_gather_tensors
from ntil_ds.engine import TrainingEngine
from ntil_ds.loss import NTILOutput
from ntil_ds.model.tensor_parallel import VocabShard


@dataclass
class Objective:
    """The forward and the loss of a micro-batch on this rank."""

    engine: TrainingEngine
    loss_fn: Any  # NTILLoss or NTLLoss: __call__(logits, targets, ...) -> NTILOutput
    vocab_shard: VocabShard | None
    device: torch.device
    dtype: torch.dtype  # the model's floating dtype: pixels are cast to it

    def loss(self, micro_batch: MicroBatch, generator: torch.Generator | None) -> NTILOutput:
        """Forward + loss (under ZeRO-3: one gather of every parameter)."""
        return self.loss_of_logits(self.logits(micro_batch), micro_batch, generator)

    def logits(self, micro_batch: MicroBatch) -> torch.Tensor:
        """``[B, T, V_local]``: this rank's vocabulary slice of the logits."""
        return self.engine.forward(
            **micro_batch.model_inputs(self.device, self.dtype), use_cache=False
        ).logits

    def loss_of_logits(
        self, logits: torch.Tensor, micro_batch: MicroBatch, generator: torch.Generator | None
    ) -> NTILOutput:
        targets, extra = micro_batch.loss_inputs(self.device)
        shard = self.vocab_shard
        return self.loss_fn(
            logits,
            targets,
            process_group=shard.process_group if shard else None,
            vocab_start=shard.vocab_start if shard else 0,
            generator=generator,
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
