"""`MicroBatch`: one collated micro-batch, what the model and the loss each take from it, and where it
came from.

Everything the training step needs to know about a micro-batch on the host (how many targets it has,
how many real input tokens) is counted here, on the CPU tensors, where the micro-batch is made (in the
data loader's workers when ``data.num_workers > 0``): the step never reads a device tensor to learn it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.packing import PACKING_KEYS
from ntil_ds.dist import SequenceSlice

# Keys of a collated batch that are not model inputs: the aligned targets, and what only the loss reads.
NOT_MODEL_INPUTS = ("targets", *PACKING_KEYS)


@dataclass
class MicroBatch:
    """A collated micro-batch (``tensors``, CPU or pinned) and its sample ids in the data file."""

    sample_ids: list[int]
    tensors: dict[str, torch.Tensor]  # the collator's output: model inputs, ``targets``, packing keys
    # Sequence parallelism: the tensors are this rank's slice of the collated rows (``slice_sequence``).
    sequence: SequenceSlice | None = None
    # A sliced micro-batch with images: the model inputs of the whole rows. The model runs its vision tower
    # and merges the images into the text embeddings on whole rows, then its language model takes this
    # rank's slice of them (ntil_ds.model.sequence_parallel.slice_after_merge).
    whole_rows: dict[str, torch.Tensor] | None = None
    num_targets: int = field(init=False)  # positions with a target (the loss's token count)
    num_input_tokens: int = field(init=False)  # real input tokens (attention_mask 1): the throughput
    # Flat positions ``b * T + t`` with a target, ascending: where loss.logits=labelled runs the head.
    labelled_rows: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.labelled_rows = (self.tensors["targets"].flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        self.num_targets = self.labelled_rows.numel()
        self.num_input_tokens = int(self.tensors["attention_mask"].sum())

    @property
    def packed(self) -> bool:
        return "unpack_index" in self.tensors

    @property
    def targets(self) -> torch.Tensor:
        """``[B, T]`` token ids aligned with the model's outputs (IGNORE_INDEX where not trained on)."""
        return self.tensors["targets"]

    def model_inputs(self, device: torch.device, float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The model's keyword arguments on ``device`` (asynchronous copies from pinned memory), floating
        tensors (pixels) in the model's dtype. A packed batch goes without attention_mask: transformers
        then separates the samples by their restarting position_ids (ntil_ds/data/packing.py); so does a
        sequence slice, whose attention (DeepSpeed Ulysses) masks causally by the gathered position_ids.
        A sliced micro-batch with images gives the whole rows (``whole_rows``, with their attention_mask:
        multimodal rotary positions are computed from it on the whole row)."""
        if self.whole_rows is not None:
            return _to_device(self.whole_rows, device, float_dtype)
        skip = {*NOT_MODEL_INPUTS, *(("attention_mask",) if self.packed or self.sequence else ())}
        return _to_device({k: v for k, v in self.tensors.items() if k not in skip}, device, float_dtype)

    def loss_inputs(self, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(targets, extra)`` on ``device``: ``extra`` holds ``unpack_index`` for a packed batch (NTIL's
        per-sequence terms per packed sample), nothing otherwise."""
        extra = {
            key: self.tensors[key].to(device, non_blocking=True)
            for key in PACKING_KEYS
            if key in self.tensors
        }
        return self.targets.to(device, non_blocking=True), extra

    def without_targets(self) -> MicroBatch:
        """The same inputs with every target ignored: a filler forward that trains and scores nothing (a
        rank with fewer evaluation samples runs it so every rank runs as many forwards)."""
        tensors = dict(self.tensors, targets=torch.full_like(self.targets, IGNORE_INDEX))
        return MicroBatch(sample_ids=[], tensors=tensors, sequence=self.sequence, whole_rows=self.whole_rows)

    def pin_memory(self) -> MicroBatch:
        """Called by the data loader's pinning thread (``pin_memory=True`` on CUDA)."""

        def pin(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {key: value.pin_memory() for key, value in tensors.items()}

        whole = None if self.whole_rows is None else pin(self.whole_rows)
        return MicroBatch(self.sample_ids, pin(self.tensors), sequence=self.sequence, whole_rows=whole)

    def slice_sequence(self, rank: int, size: int, *, whole_rows: bool = False) -> MicroBatch:
        """This rank's part of the rows split over ``size`` sequence-parallel ranks: every ``[B, T]``
        tensor padded to a multiple of ``size`` (ignored targets, masked tokens) and cut to positions
        ``[rank * L, (rank + 1) * L)``, with the rows' ``position_ids`` (which the attention gathers to
        mask causally). Counts (targets, input tokens) are then this slice's: they add up over the group.
        ``whole_rows`` (a multimodal model): the whole rows' model inputs are kept for the model, which
        slices after merging the images into the text; their pixels and grids are not laid out by position."""
        if self.packed:
            raise ValueError("a packed micro-batch cannot be split on the sequence dimension")
        batch, length = self.targets.shape
        where = SequenceSlice.of(length, rank, size)
        tensors = dict(self.tensors)
        tensors.setdefault("position_ids", torch.arange(length).expand(batch, length))
        local = {}
        for key, value in tensors.items():
            if value.shape[:2] == (batch, length):
                local[key] = where.part(value, fill=IGNORE_INDEX if key == "targets" else 0)
            elif not whole_rows:
                raise ValueError(
                    f"{key} {tuple(value.shape)} is not laid out by position [B={batch}, T={length}, ...]: "
                    "only a multimodal model's micro-batch carries images (whole_rows=True)"
                )
        whole = {k: v for k, v in self.tensors.items() if k not in NOT_MODEL_INPUTS} if whole_rows else None
        return MicroBatch(self.sample_ids, local, sequence=where, whole_rows=whole)


def _to_device(
    tensors: dict[str, torch.Tensor], device: torch.device, float_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Asynchronous copies to ``device`` (from pinned memory), floating tensors (pixels) in ``float_dtype``."""
    return {
        key: value.to(
            device, dtype=float_dtype if value.is_floating_point() else value.dtype, non_blocking=True
        )
        for key, value in tensors.items()
    }
