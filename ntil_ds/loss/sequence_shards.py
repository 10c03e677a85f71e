"""The loss of a micro-batch split on the sequence dimension over the ranks of a sequence-parallel group
(DeepSpeed Ulysses, ``parallel.sequence_parallel_size``).

Each rank holds the logits of its slice of every row: positions ``[rank * L, (rank + 1) * L)`` of the
row padded to ``size * L``. Cross-entropy is a sum over positions, but NTIL's sequence terms are not: a
number whose digits fall on two ranks must get one REL/MAG term, and its EMD place weights depend on the
digits after it. So stage 1 of the loss (the vocabulary stage: per-position CE, the digit columns, the
row max) runs on the local slice, and its small per-position results (``2 + C`` numbers a position, not
the vocabulary) are gathered along the sequence with a differentiable all-gather; stage 2 and the
combination then run on the whole rows, on every rank of the group, exactly as on one process. The
gather's backward returns to each rank the gradient of its own positions, summed over the ranks' losses.

Each rank reports ``1 / size`` of the micro-batch's summed loss (and CE): the shares of the group add up
to the one-process value, and the trainer treats the ranks of a group like data-parallel ranks. The
Gumbel noise is drawn for the whole rows (the unpadded length) from the same generator on every rank
and sliced, so it does not depend on the sequence-parallel size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ntil_ds.constants import IGNORE_INDEX


@dataclass(frozen=True)
class SequenceShard:
    """A micro-batch's slice on this rank (``slice``) and the group of ranks holding the others."""

    group: Any  # torch.distributed.ProcessGroup of the sequence-parallel ranks
    slice: Any  # ntil_ds.dist.SequenceSlice (not imported: the loss runs without the config stack)

    @property
    def local_length(self) -> int:
        return self.slice.local_length

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``full [B, length, ...]`` (padded with zeros to the padded length)."""
        return self.slice.part(full)

    def gather(self, local: torch.Tensor, *, differentiable: bool) -> torch.Tensor:
        """COLLECTIVE over the group: ``[B, local_length, ...]`` of every rank -> ``[B, length, ...]``, the
        whole unpadded rows. ``differentiable``: the gradient flows back to each rank's own slice."""
        if differentiable:
            pieces = AllGatherInGroup.apply(local.contiguous(), self.group)
        else:
            pieces = [torch.empty_like(local) for _ in range(self.slice.size)]
            dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces, dim=1)[:, : self.slice.length]


class AllGatherInGroup(torch.autograd.Function):
    """All-gather over a group whose backward gives each rank the sum of every rank's gradient for its own
    piece (one all-reduce of the pieces' gradients: small tensors, the stage-1 results here, a vision
    tower's features in ``model.sequence_parallel``; not the vocabulary).
    torch.distributed.nn's all_gather cannot serve here: on gloo its backward falls back to scatters that
    take the group rank i for the global rank i, which fails for every group but the one holding ranks
    0..size-1 (the second group of a data-parallel x sequence-parallel layout)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        return tuple(pieces)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        like = next(g for g in grads if g is not None)
        stacked = torch.stack([torch.zeros_like(like) if g is None else g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def noise_for_slice(
    draw, batch: int, shard: SequenceShard, generator: torch.Generator | None
) -> torch.Tensor | None:
    """This rank's ``[batch * local_length, P]`` part of the noise ``draw(num_positions, generator)`` makes
    for the whole unpadded rows (None when ``draw`` draws none)."""
    noise = draw(batch * shard.slice.length, generator)
    if noise is None:
        return None
    local = shard.local_part(noise.reshape(batch, shard.slice.length, -1))
    return local.reshape(batch * shard.local_length, -1)


def loss_over_shards(
    combine,
    labels: torch.Tensor,
    ce: torch.Tensor,
    columns: torch.Tensor,
    row_max: torch.Tensor,
    noise: torch.Tensor | None,
    shard: SequenceShard,
) -> Any:  # the NTILOutput that combine returns, with this rank's shares
    """This rank's share of the micro-batch's loss from its slice's stage-1 results (``[B*L]`` ce and row
    max, ``[B*L, C]`` columns, ``[B*L, P]`` noise over ``[B, L]`` local labels): the stats of the whole
    rows gathered, then ``combine(labels, ce, columns, row_max, noise)`` on them (the one-process loss)."""
    batch = labels.shape[0]

    def whole(values: torch.Tensor, differentiable: bool) -> torch.Tensor:
        local = values.reshape(batch, shard.local_length, *values.shape[1:])
        rows = shard.gather(local, differentiable=differentiable)
        return rows.reshape(batch * shard.slice.length, *values.shape[1:])

    full_labels = shard.gather(labels.long(), differentiable=False)
    local_count = (labels != IGNORE_INDEX).sum()
    out = combine(
        full_labels,
        whole(ce, ce.requires_grad),
        whole(columns, columns.requires_grad),
        whole(row_max.detach(), False),
        None if noise is None else whole(noise.detach(), False),
    )
    size = shard.slice.size
    # Every rank of the group holds the whole micro-batch's loss; each reports (and differentiates) its
    # share, so the group's shares sum to it and its gradient reaches every rank's positions once.
    return dataclasses.replace(
        out, loss_sum=out.loss_sum / size, ce_sum=out.ce_sum / size, num_tokens=local_count
    )
