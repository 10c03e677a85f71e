"""Sequence parallelism for the multimodal families: with ``slice_after_merge`` the language model of each
family takes, on each rank, its slice of what the model built on the whole rows. The ranks' slices put
back together are the whole rows exactly: the merged text+image embeddings, the rotary positions (Qwen's
3-D mrope positions computed on the whole row, which a slice alone would number from its own start), and
Qwen3-VL's deepstack image features with their positions. Batches of 4 rows of different lengths with
images (and a text-only row), cut into 2 and 3 slices so that images straddle the cuts.

One process: the forward stops where the language model would start (its attention needs every rank).
The distributed parity of Qwen2-VL at SP=2 against one process is tests/distributed/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from ntil_ds.data import Collator, ConversationDataset, load_processor
from ntil_ds.data.batch import MicroBatch
from ntil_ds.model.sequence_parallel import SLICED_AFTER_MERGE, language_model_of, slice_after_merge
from ntil_ds.tiny import build_tiny_model_folder
from tests.distributed.training_runs import write_mixed_arithmetic_data

KINDS = SLICED_AFTER_MERGE


class _Reached(Exception):
    """Raised by the capture hook: the language model's inputs are all the test reads."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sp_multimodal")


def _language_model_inputs(model, micro_batch: MicroBatch, where=None) -> dict:
    """What the language model is called with (after ``slice_after_merge`` for ``where``)."""
    seen = {}

    def capture(module, args, kwargs):
        seen.update(kwargs)
        raise _Reached

    inputs = micro_batch.model_inputs(torch.device("cpu"), torch.float32)
    with slice_after_merge(model, where) if where is not None else _nothing():
        handle = language_model_of(model).register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with pytest.raises(_Reached), torch.no_grad():
                model(**inputs, use_cache=False)
        finally:
            handle.remove()
    return seen


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("kind", KINDS)
def test_each_family_slices_the_merged_rows_the_ranks_put_back_together(root, kind):
    folder = build_tiny_model_folder(kind, root / kind / "model")
    data = write_mixed_arithmetic_data(root / kind / "data", n=8, image_size=112)
    processor = load_processor(folder)
    dataset = ConversationDataset(data, processor, max_seq_len=512)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.from_pretrained(folder), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ids = [0, 1, 2, 3]  # image, text, image, text: rows of different lengths
    whole_batch = MicroBatch(ids, Collator(processor, fake_image=True)([dataset[i] for i in ids]))
    whole = _language_model_inputs(model, whole_batch)
    batch, length = whole_batch.targets.shape
    image_token = model.config.image_token_id if hasattr(model.config, "image_token_id") else None
    if image_token is None:
        image_token = model.config.image_token_index
    is_image = whole_batch.tensors["input_ids"] == image_token

    def straddles(size: int) -> bool:
        """Whether an image's tokens lie on both sides of a cut between ``size`` slices in some row (within
        2 tokens of it: Mistral 3 puts a break token after each row of patches)."""
        step = -(-length // size)
        near = [
            is_image[:, cut - 2 : cut].any(1) & is_image[:, cut : cut + 2].any(1)
            for cut in range(step, length, step)
        ]
        return any(n.any() for n in near)

    # 2 slices, and the fewest that cut through an image (the test must see one cut so)
    straddling = next((size for size in range(2, 9) if straddles(size)), None)
    assert straddling is not None, (kind, is_image.nonzero().tolist())
    for size in sorted({2, straddling}):
        parts = []
        for rank in range(size):
            sliced = whole_batch.slice_sequence(rank, size, whole_rows=True)
            parts.append(_language_model_inputs(model, sliced, sliced.sequence))

        assert all(p["attention_mask"] is None for p in parts)  # Ulysses masks by the gathered positions
        embeds = torch.cat([p["inputs_embeds"] for p in parts], dim=1)
        assert torch.equal(embeds[:, :length], whole["inputs_embeds"]), (kind, size)
        positions = torch.cat([p["position_ids"] for p in parts], dim=-1)[..., :length]
        text_positions = torch.arange(length).expand(batch, length)
        if whole["position_ids"] is None:  # 1-D rotary positions: the row's
            assert torch.equal(positions, text_positions), (kind, size)
        else:  # Qwen / GLM: the text positions, then the 3-D positions computed on the whole row
            assert torch.equal(positions[0], text_positions)
            assert torch.equal(positions[1:], whole["position_ids"][-3:]), (kind, size)
            # the image patches' positions are not the row's token positions: what a slice would get wrong
            assert not torch.equal(positions[1][is_image], text_positions[is_image])
        if whole.get("visual_pos_masks") is not None:  # Qwen3-VL's deepstack
            masks = torch.cat([p["visual_pos_masks"] for p in parts], dim=1)[:, :length]
            assert torch.equal(masks, whole["visual_pos_masks"])
            for layer, features in enumerate(whole["deepstack_visual_embeds"]):
                placed = []  # each rank's features at its slice's image positions, the slices side by side
                for part in parts:
                    local = part["visual_pos_masks"]
                    at = features.new_zeros(*local.shape, features.shape[-1])
                    at[local] = part["deepstack_visual_embeds"][layer]
                    placed.append(at)
                joined = torch.cat(placed, dim=1)[:, :length][whole["visual_pos_masks"]]
                assert torch.equal(joined, features), (kind, size, layer)


def test_a_family_whose_language_model_takes_other_inputs_by_position_is_stopped(root):
    """The hook refuses, rather than passing uncut, a [B, T] input it does not know."""
    from ntil_ds.dist import SequenceSlice

    layer = torch.nn.Module()
    layer.language_model = torch.nn.Identity()
    with (
        slice_after_merge(layer, SequenceSlice.of(6, 0, 2)),
        pytest.raises(RuntimeError, match="token_type_ids"),
    ):
        layer.language_model(inputs_embeds=torch.zeros(1, 6, 4), token_type_ids=torch.zeros(1, 6))
