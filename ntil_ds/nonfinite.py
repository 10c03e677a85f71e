"""A NaN/Inf loss or gradient stops the job, on every rank, with a message that names the step, the rank
and the samples: their ids and where each is (``file:line`` of a JSONL line, ``file:row n`` of a table
row, from the training data's ``sample_name``: each sample's own file under ``data.mixture`` too).
DeepSpeed's optimizers skip a step whose gradients are not finite, so the weights stay those of the step
before and the run can be resumed from its last checkpoint once the cause is found."""

from __future__ import annotations

import math
from typing import NoReturn

from ntil_ds.config import Config
from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import DistInfo, all_gather_objects

_NAMED = 16  # samples named with their file and row in one message (their ids are all listed)
_FIX = "Lower optim.lr, check these samples, or use model.dtype=bfloat16 instead of float16."


class NonFiniteLossError(RuntimeError):
    """A NaN/Inf loss or gradient: raised on every rank, naming step, rank and batch."""


def _samples(data, ids: list[int]) -> str:
    """``[ids] (file:line, file:row n, ...)``: what each sample id of the training data is."""
    names = [data.sample_name(i) for i in ids[:_NAMED]]
    more = f", and {len(ids) - _NAMED} more" if len(ids) > _NAMED else ""
    return f"{ids} ({', '.join(names)}{more})"


def _outcome(step: int, applied: bool) -> str:
    if applied:  # a non-finite loss whose gradients were finite: nothing could stop the update
        return f"the optimizer took this step: the weights after step {step} may be damaged, resume from a checkpoint"
    return f"the optimizer did not take this step, the weights are those after step {step - 1}"


def raise_non_finite_loss(
    step: int,
    cfg: Config,
    dist_info: DistInfo,
    micro_batches: list[MicroBatch],
    loss_sums: list[float],
    data,
    *,
    applied: bool,
) -> NoReturn:
    """COLLECTIVE: every rank raises the same message, listing every offending micro-batch of every rank.
    ``step`` is the 1-based step; ``loss_sums`` this rank's per-micro-batch values; ``applied`` whether
    the optimizer step went through; ``data`` the training data (its ``sample_name(i)``)."""
    local_bad = [
        f"rank {dist_info.rank} (dp rank {dist_info.dp_rank}), micro-batch {index} of the step, "
        f"samples {_samples(data, micro_batch.sample_ids)}: loss_sum={loss_sum}"
        for index, (micro_batch, loss_sum) in enumerate(zip(micro_batches, loss_sums, strict=True))
        if not math.isfinite(loss_sum)
    ]
    where = "\n  ".join(line for lines in all_gather_objects(local_bad) for line in lines)
    raise NonFiniteLossError(
        f"non-finite loss at step {step} (of {cfg.train.max_steps}); {_outcome(step, applied)}.\n  {where}\n{_FIX}"
    )


def raise_non_finite_gradient(
    step: int,
    cfg: Config,
    dist_info: DistInfo,
    micro_batches: list[MicroBatch],
    data,
    loss: float | None = None,
) -> NoReturn:
    """Every rank raises (every rank found the same: the check was collective), naming its own samples."""
    samples = [i for micro_batch in micro_batches for i in micro_batch.sample_ids]
    with_loss = f" with a finite loss ({loss:.6g})" if loss is not None else ""
    raise NonFiniteLossError(
        f"non-finite gradient at step {step} (of {cfg.train.max_steps}){with_loss}; {_outcome(step, False)}. "
        f"Rank {dist_info.rank}'s samples of the step: {_samples(data, samples)}.\nLower optim.lr "
        "or optim.grad_clip, or use model.dtype=bfloat16 instead of float16."
    )
