"""A NaN/Inf loss or gradient stops the job before the optimizer step, on every rank, with a message that
names the step, the rank and the samples: the weights stay those of the step before, so the run can be
resumed from its last checkpoint once the cause is found."""

from __future__ import annotations

import math
from typing import NoReturn

from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import DistInfo, all_gather_objects

_ADVICE = "Lower optim.lr, check these samples, or use model.dtype=bfloat16 instead of float16."


class NonFiniteLossError(RuntimeError):
    """A NaN/Inf loss or gradient: raised on every rank before the optimizer step, naming step, rank and
    batch."""


def raise_non_finite_loss(
    step: int,
    max_steps: int,
    train_file: str,
    dist_info: DistInfo,
    micro_batches: list[MicroBatch],
    loss_sums: list[float],
) -> NoReturn:
    """COLLECTIVE: every rank raises the same message, listing every offending micro-batch of every rank.
    ``step`` is the 1-based step that was refused; ``loss_sums`` this rank's per-micro-batch values."""
    local_bad = [
        f"rank {dist_info.rank} (dp rank {dist_info.dp_rank}), micro-batch {index} of the step, "
        f"samples {micro_batch.sample_ids} of {train_file}: loss_sum={loss_sum}"
        for index, (micro_batch, loss_sum) in enumerate(zip(micro_batches, loss_sums, strict=True))
        if not math.isfinite(loss_sum)
    ]
    where = "\n  ".join(line for lines in all_gather_objects(local_bad) for line in lines)
    raise NonFiniteLossError(
        f"non-finite loss at step {step} (of {max_steps}); the optimizer did not take this step, the "
        f"weights are those after step {step - 1}.\n  {where}\n{_ADVICE}"
    )


def raise_non_finite_gradient(
    step: int,
    max_steps: int,
    train_file: str,
    dist_info: DistInfo,
    micro_batches: list[MicroBatch],
    loss: float,
) -> NoReturn:
    """Every rank raises (the gradient check was collective), naming its own samples of the step."""
    samples = [i for micro_batch in micro_batches for i in micro_batch.sample_ids]
    raise NonFiniteLossError(
        f"non-finite gradient at step {step} (of {max_steps}) with a finite loss ({loss:.6g}); the "
        f"optimizer did not take this step, the weights are those after step {step - 1}. Rank "
        f"{dist_info.rank}'s samples of the step: {samples} of {train_file}.\nLower optim.lr or "
        "optim.grad_clip, or use model.dtype=bfloat16 instead of float16."
    )
