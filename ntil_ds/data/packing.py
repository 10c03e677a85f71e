"""Sequence packing: several conversations in one row, each still seeing only itself.

`PackedCollator` turns samples into one row ``[1, T]`` (T = the sum of their lengths, no padding), or
into rows of at most ``row_tokens`` tokens, that a Hugging Face model in transformers 5.24 treats as
separate sequences:

- ``position_ids`` restart at 0 for every sample and no ``attention_mask`` is passed to the model: then
  transformers finds the sample boundaries from the position ids (``masking_utils.
  find_packed_sequence_indices``) and builds a block-diagonal causal mask for sdpa/eager, and
  flash-attention 2 runs its varlen kernel on the same boundaries. Attention never crosses samples.
- M-RoPE models (Qwen2-VL / Qwen2.5-VL) get ``position_ids`` of shape ``[4, R, W]``: index 0 the text
  positions above (what transformers builds the mask from), rows 1-3 the model's own 3-D rotary
  positions computed per sample by ``rope_fn`` (the model's ``get_rope_index`` on the samples as a padded
  batch, so each sample gets exactly the positions it gets unpacked).
- Images stay with their sample: per-image tensors are concatenated in sample order, as the model
  consumes them in placeholder order.
- Targets: concatenated as they come. Each sample's targets are already aligned (shifted) on their own
  and end with an ignored position (`ntil_ds.data.encoding.aligned_targets`), so no position is trained
  to predict the next sample's first token and NTIL's digit runs (maximal runs of digit targets) never
  join the numbers of two samples.
- ``unpack_index [S, Lmax]``: the flat position in the row of each sample's tokens (-1 past its end).
  `ntil_ds.loss.NTILLoss` takes it to compute its per-sequence terms per sample, not per row, so the
  packed loss equals the unpacked one.
- ``attention_mask`` (1 on real tokens, 0 on a fake image) stays in the batch for token counting; the
  trainer does not pass it to the model.

`plan_micro_batches` decides which samples share a micro-batch: in sampler order, a new one when the next
sample would exceed the token budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.collate import _fake_image_sample, _image_keys, reads_images_per_row
from ntil_ds.data.dataset import PER_TOKEN_KEYS
from ntil_ds.data.processor import is_multimodal, tokenizer_of
from ntil_ds.data.records import DataError

# Keys of a packed batch that are not model inputs (the trainer strips them, with the targets).
PACKING_KEYS = ("unpack_index",)

# rope_fn(input_ids [S, L], mm_token_type_ids [S, L], attention_mask [S, L], image_tensors) -> [3, S, L]
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Group positions 0..n-1 (in order) into runs of at most `max_tokens` tokens, then split the largest
    groups until there are at least `min_count` (every data-parallel rank must run as many forwards as
    the rank that needs most; a group is never split below one sample)."""
    if min_count > len(lengths):
        raise ValueError(f"cannot make {min_count} micro-batches from {len(lengths)} samples")
    groups: list[list[int]] = []
    used = 0
    for position, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"a sample of {length} tokens exceeds data.max_tokens_per_micro_batch={max_tokens}; "
                f"raise it to at least data.max_seq_len"
            )
        if not groups or used + length > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(position)
        used += length
    while len(groups) < min_count:
        # split the group with the most tokens (of those with 2+ samples) where its halves balance
        splittable = [g for g in groups if len(g) > 1]
        group = max(splittable, key=lambda g: sum(lengths[p] for p in g))
        total, running, cut = sum(lengths[p] for p in group), 0, 1
        for k, p in enumerate(group[:-1]):
            running += lengths[p]
            if running * 2 >= total:
                cut = k + 1
                break
        at = groups.index(group)
        groups[at : at + 1] = [group[:cut], group[cut:]]
    return groups


class PackedCollator:
    """Samples from `ConversationDataset` to packed rows (see the module docstring).

    `row_tokens`: None puts every sample in one row ``[1, T]`` (no padding at all: what flash-attention's
    varlen kernel wants; transformers only reads packing from position ids of a single row there).
    A number: rows of at most that many tokens, right-padded to the longest (for sdpa/eager, whose
    block-diagonal mask still costs time quadratic in the row length). Padding is a segment of its own
    (positions restarting at 0), targets -100 and attention_mask 0, so it touches nothing real.
    `fake_image` as in `Collator`: a batch without any image gets a tiny blank one (its own segment after
    the real samples, no targets, attention_mask 0) so every ZeRO-3 rank runs the vision tower.
    `rope_fn`: for M-RoPE models, the model's per-sample 3-D positions (`ntil_ds.model.packing`).
    """

    def __init__(
        self, processor, fake_image: bool = True, rope_fn: RopeFn | None = None, row_tokens: int | None = None
    ):
        tokenizer = tokenizer_of(processor)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError("the tokenizer has neither a pad nor an eos token to pad rows with")
        self.pad_values = {"input_ids": pad_id, "targets": IGNORE_INDEX}
        if reads_images_per_row(processor):
            raise DataError(
                f"sequence packing is not supported for {type(processor).__name__}: its model reads each "
                "row's images through cross-attention, which packed rows would mix; set "
                "data.max_tokens_per_micro_batch=0"
            )
        self.fake_image = _fake_image_sample(processor) if fake_image and is_multimodal(processor) else None
        self.rope_fn = rope_fn
        self.row_tokens = row_tokens

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        num_real = len(samples)
        segments = list(samples)
        if self.fake_image is not None and not any(_image_keys(s) for s in samples):
            segments.append(self.fake_image)
        lengths = [len(s["input_ids"]) for s in segments]
        # (row, start in row) of each segment: in order, a new row when the next one does not fit
        places, row, used = [], 0, 0
        for n in lengths:
            if self.row_tokens is not None and used and used + n > self.row_tokens:
                row, used = row + 1, 0
            places.append((row, used))
            used += n
        rows = row + 1
        width = max(start + n for (_, start), n in zip(places, lengths, strict=True))

        batch: dict[str, torch.Tensor] = {}
        for key in [*PER_TOKEN_KEYS, "targets"]:
            present = [s[key] for s in segments if key in s]
            if not present:
                continue
            # padding, and a key some segments lack (e.g. mm_token_type_ids: 0 = "text"), take the pad value
            out = torch.full((rows, width), self.pad_values.get(key, 0), dtype=present[0].dtype)
            for sample, (r, start), n in zip(segments, places, lengths, strict=True):
                if key in sample:
                    out[r, start : start + n] = sample[key]
            batch[key] = out
        positions = torch.arange(width).repeat(rows, 1)  # padding: its own segment restarting at 0
        flat_start = []
        for (r, start), n in zip(places, lengths, strict=True):
            positions[r, start : start + n] = torch.arange(n)
            positions[r, start + n :] = torch.arange(width - start - n)
            flat_start.append(r * width + start)
        batch["position_ids"] = positions
        for key in sorted({k for s in segments for k in _image_keys(s)}):
            batch[key] = torch.cat([s[key] for s in segments if key in s])

        real = torch.tensor(lengths[:num_real])
        offsets = torch.arange(int(real.max()))
        index = torch.tensor(flat_start[:num_real])[:, None] + offsets[None, :]
        batch["unpack_index"] = torch.where(offsets[None, :] < real[:, None], index, -1)
        if self.rope_fn is not None:
            batch["position_ids"] = self._mrope_positions(batch, segments, lengths, places)
        return batch

    def _mrope_positions(self, batch, segments, lengths, places) -> torch.Tensor:
        """[4, R, W]: text positions, then the model's 3-D positions computed on the segments as a padded
        batch (the fake image, too, so the image grids are consumed in order) and laid back into the rows."""
        count, longest = len(segments), max(lengths)
        valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        padded = {}
        for key in ("input_ids", "mm_token_type_ids"):
            out = torch.zeros(count, longest, dtype=batch[key].dtype)
            for k, ((r, start), n) in enumerate(zip(places, lengths, strict=True)):
                out[k, :n] = batch[key][r, start : start + n]
            padded[key] = out
        not_images = (*PER_TOKEN_KEYS, *PACKING_KEYS, "targets", "position_ids")
        images = {k: v for k, v in batch.items() if k not in not_images}
        rope = self.rope_fn(padded["input_ids"], padded["mm_token_type_ids"], valid.long(), images)
        text = batch["position_ids"]
        out = torch.zeros(3, *text.shape, dtype=rope.dtype)
        for k, ((r, start), n) in enumerate(zip(places, lengths, strict=True)):
            out[:, r, start : start + n] = rope[:, k, :n]
        return torch.cat([text[None], out], dim=0)
