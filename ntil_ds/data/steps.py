"""Each optimizer step's micro-batches, prepared off the training loop's critical path.

`StepBatches[k]` is this rank's list of micro-batches for the k-th step after a fixed start position of
the sample stream: a pure function of (k, start), so a `torch.utils.data.DataLoader` with worker
processes prepares the next steps (reading images, running the processor, packing, pinning memory)
while the current one trains, and the order stays exactly the sampler's. The trainer never lets the
loader move its `ResumableDistributedSampler`: it advances that one by the samples of each step it
actually trained (`ResumableDistributedSampler.skip`), so a checkpoint records what was trained, not
what was prefetched, and resuming stays exact.

A step takes `samples_per_rank` samples on every data-parallel rank (global_batch_size / dp ranks).
Without packing they form `samples_per_rank / micro_batch_size` padded micro-batches, as before. With
packing (`max_tokens > 0`) they are packed in order into rows of at most `max_tokens` tokens; every
rank must run the same number of forwards (ZeRO-3 gathers parameters collectively), so each rank plans
every rank's rows (the sampler tells it their samples, the dataset their lengths; no communication)
and splits its own until it has as many as the rank that needs most.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ntil_ds.data.batch import MicroBatch
from ntil_ds.data.dataset import ConversationDataset
from ntil_ds.data.packing import plan_micro_batches
from ntil_ds.data.sampler import ResumableDistributedSampler


class StepBatches(torch.utils.data.Dataset):
    """Item k: this rank's micro-batches of the k-th step after stream position `start_consumed`."""

    def __init__(
        self,
        dataset: ConversationDataset,
        sampler: ResumableDistributedSampler,
        collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
        *,
        samples_per_rank: int,
        micro_batch_size: int,
        max_tokens: int = 0,
        sequence_slice: tuple[int, int] | None = None,
        multimodal: bool = False,
    ) -> None:
        """``sequence_slice``: (rank, size) of this rank in its sequence-parallel group: every micro-batch
        is this rank's slice of the rows (``MicroBatch.slice_sequence``), keeping the whole rows' model
        inputs for a ``multimodal`` model (it slices after merging the images)."""
        if max_tokens == 0 and samples_per_rank % micro_batch_size:
            raise ValueError(
                f"{samples_per_rank} samples per step do not split into micro-batches of {micro_batch_size}"
            )
        self.dataset = dataset
        self.sampler = sampler
        self.collate = collate
        self.samples_per_rank = samples_per_rank
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.sequence_slice = sequence_slice
        self.multimodal = multimodal
        self.start_consumed = sampler.consumed_samples  # frozen: items are a function of k alone

    def step_groups(self, k: int) -> list[list[int]]:
        """The sample ids of each micro-batch of step k (no processing: cheap)."""
        consumed = self.start_consumed + k * self.samples_per_rank * self.sampler.dp_size
        own = self.sampler.indices_at(consumed, self.samples_per_rank)
        if not self.max_tokens:
            size = self.micro_batch_size
            return [own[i : i + size] for i in range(0, len(own), size)]
        most = max(
            len(
                plan_micro_batches(
                    self._lengths(self.sampler.indices_at(consumed, len(own), rank)), self.max_tokens
                )
            )
            for rank in range(self.sampler.dp_size)
        )
        groups = plan_micro_batches(self._lengths(own), self.max_tokens, min_count=most)
        return [[own[p] for p in group] for group in groups]

    def _lengths(self, ids: list[int]) -> list[int]:
        return [self.dataset.num_tokens(i) for i in ids]

    def __getitem__(self, k: int) -> list[MicroBatch]:
        batches = [
            MicroBatch(ids, self.collate([self.dataset[i] for i in ids])) for ids in self.step_groups(k)
        ]
        if self.sequence_slice is None:
            return batches
        return [batch.slice_sequence(*self.sequence_slice, whole_rows=self.multimodal) for batch in batches]

    def __len__(self) -> int:  # endless; DataLoader only asks when it has no sampler
        raise TypeError("StepBatches is endless")


class _Steps(torch.utils.data.Sampler):
    def __iter__(self) -> Iterator[int]:
        return itertools.count()


def _as_is(item: Any) -> Any:
    return item


def step_loader(steps: StepBatches, num_workers: int, pin_memory: bool) -> Iterator[list[MicroBatch]]:
    """Steps 0, 1, 2, ... in order; with workers, the next `2 * num_workers` steps are prepared ahead."""
    loader = torch.utils.data.DataLoader(
        steps,
        batch_size=None,
        sampler=_Steps(),
        num_workers=num_workers,
        collate_fn=_as_is,
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=num_workers > 0,
    )
    return iter(loader)
