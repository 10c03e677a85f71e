"""`ResumableDistributedSampler`: a seeded sample order, sharded over data-parallel ranks, resumable.

The order is one endless stream: epoch after epoch, each a permutation of the dataset drawn from
(seed, epoch). Data-parallel rank r of D takes stream positions r, r+D, r+2D, ...; so within any D
consecutive positions the ranks get different samples, every epoch covers every sample exactly once over
all ranks, and no sample is dropped or repeated at an epoch's end whatever the dataset size. Ranks of one
tensor-parallel group pass the same `dp_rank` and so get identical samples (DeepSpeed's AutoTP requires it).

Resuming: the position advances when an index is yielded (or by `skip`). The trainer's data-loader
workers read future indices with `indices_at` (which moves nothing) and the trainer `skip`s past each
step it trained, so the position never counts prefetched samples.
`state_dict()` holds the number of samples consumed over all data-parallel ranks together; after
`load_state_dict`, the next yielded index is the first sample not yet seen, also on a different number
of data-parallel ranks when that count divides by it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


class ResumableDistributedSampler:
    """Endless, deterministic, sharded sample indices (see the module docstring)."""

    def __init__(
        self,
        num_samples: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        epoch_order: Callable[[int, int, bool], np.ndarray] | None = None,
    ):
        """`epoch_order(seed, epoch, shuffle)`: an epoch's `num_samples` indices in order, instead of a
        permutation of range(num_samples) (weighted sources: ntil_ds/data/weighted.py)."""
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_order = epoch_order
        self.consumed_per_rank = 0  # indices this rank has yielded (equal on all ranks at a step boundary)
        self._order_epoch = -1
        self._order = np.arange(num_samples)

    @property
    def consumed_samples(self) -> int:
        """Samples consumed over all data-parallel ranks: the position in the stream."""
        return self.consumed_per_rank * self.dp_size

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return (self.consumed_samples + self.dp_rank) // self.num_samples

    def __iter__(self) -> Iterator[int]:
        while True:
            position = self.consumed_samples + self.dp_rank
            epoch, offset = divmod(position, self.num_samples)
            index = int(self._epoch_order(epoch)[offset])
            self.consumed_per_rank += 1
            yield index

    def skip(self, count: int) -> None:
        """Advance past `count` samples of this rank (those a step trained on, prepared elsewhere)."""
        self.consumed_per_rank += count

    def indices_at(self, consumed_samples: int, count: int, dp_rank: int | None = None) -> list[int]:
        """The `count` indices `dp_rank` (default: this rank) takes from stream position `consumed_samples`
        on, without moving this sampler: what iterating from that position would yield. Lets a data-loader
        worker prepare a future step (and see the other ranks' samples of it) while training runs."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        out = []
        for j in range(count):
            epoch, offset = divmod(consumed_samples + j * self.dp_size + rank, self.num_samples)
            out.append(int(self._epoch_order(epoch)[offset]))
        return out

    @classmethod
    def for_dataset(cls, dataset, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True):
        """The sampler of `dataset`: its own epoch order when it has one (`WeightedSources`)."""
        order = getattr(dataset, "epoch_order", None)
        length = getattr(dataset, "epoch_length", None) or len(dataset)
        return cls(length, dp_rank, dp_size, seed, shuffle, epoch_order=order)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self.epoch_order is not None:
            if epoch != self._order_epoch:
                self._order = np.asarray(self.epoch_order(self.seed, epoch, self.shuffle))
                self._order_epoch = epoch
            return self._order
        if self.shuffle and epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after `state["consumed_samples"]` samples (raises if the data or seed changed)."""
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the sample order: checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; resume with the same data file and train.seed"
                )
        consumed = int(state["consumed_samples"])
        if consumed % self.dp_size:
            raise ValueError(
                f"checkpoint consumed {consumed} samples, not a multiple of the {self.dp_size} data-parallel "
                "ranks of this run; resume with a data-parallel size that divides it"
            )
        self.consumed_per_rank = consumed // self.dp_size
