"""`Collator`: dataset samples to one padded micro-batch, with a fake image where ZeRO-3 needs one."""

from __future__ import annotations

import torch
from PIL import Image

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.dataset import PER_TOKEN_IMAGE_KEYS, PER_TOKEN_KEYS
from ntil_ds.data.processor import is_multimodal, tokenizer_of
from ntil_ds.data.records import DataError


class Collator:
    """Pad samples from `ConversationDataset` into a batch for `model(**batch_without_targets)`.

    Per-token tensors are right-padded (input_ids with the pad token, targets with -100, attention_mask and
    the rest with 0); per-image tensors (Qwen-VL's flattened patches and `image_grid_thw`, LLaVA's
    `(N, 3, H, W)` pixels) are concatenated in sample order, matching the placeholder order.

    `fake_image=True` (MLLM processors only): a micro-batch without any image gets one tiny blank image
    appended to its first sample, its placeholder tokens with attention_mask 0 and targets -100. Under
    ZeRO-3 every rank must run the same modules (each forward all-gathers the vision tower's parameters);
    a rank that skipped the vision tower would hang or crash the job. The fake tokens come after all real
    tokens of their row, so causal attention keeps them from changing any real token's output.

    Cross-attention families (Llama 3.2 Vision: the processor gives a per-token `cross_attention_mask`)
    read the images per row, so every row carries image tensors, zero-padded to the batch's most images
    exactly as the processor pads a batch (a row without an image: all padding, cross-attention mask 0).
    A micro-batch without any image gets the blank image's tensors in its first row, and no tokens: its
    cross-attention mask stays 0. (transformers' Mllama then still adds the gated cross-attention output
    over the padded or blank tiles to such rows, as in its own padded batches; only a batch given no
    pixel_values at all skips the cross-attention layers, which ZeRO-3 cannot do on one rank alone.)
    """

    def __init__(self, processor, fake_image: bool = True):
        tokenizer = tokenizer_of(processor)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise DataError("the tokenizer has neither a pad nor an eos token to pad batches with")
        self.pad_values = {"input_ids": pad_id, "targets": IGNORE_INDEX}
        self.fake_image = _fake_image_sample(processor) if fake_image and is_multimodal(processor) else None
        # (a cross-attention family needs the blank image's tensors even with fake_image=False)
        self.blank_row = _fake_image_sample(processor) if reads_images_per_row(processor) else None

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        samples = list(samples)
        if self.blank_row is not None:
            blank = {k: self.blank_row[k] for k in _image_keys(self.blank_row)}
            none = {
                k: v[:, :0] for k, v in blank.items()
            }  # no image: zero-padded below, as the processor pads
            if not any(_image_keys(s) for s in samples):
                samples[0] = {**samples[0], **blank}
            samples = [s if _image_keys(s) else {**s, **none} for s in samples]
        elif self.fake_image is not None and not any(_image_keys(s) for s in samples):
            samples[0] = _append(samples[0], self.fake_image)
        length = max(len(s["input_ids"]) for s in samples)
        batch = {}
        for key in [*PER_TOKEN_KEYS, "targets"]:
            present = [s[key] for s in samples if key in s]
            if not present:
                continue
            # a key some samples lack (e.g. mm_token_type_ids) is 0 = "text" there, like padding
            padded = torch.full((len(samples), length), self.pad_values.get(key, 0), dtype=present[0].dtype)
            for row, sample in enumerate(samples):
                if key in sample:
                    padded[row, : len(sample[key])] = sample[key]
            batch[key] = padded
        for key in PER_TOKEN_IMAGE_KEYS:
            present = [s[key] for s in samples if key in s]
            if not present and self.blank_row is not None and key in self.blank_row:
                present = [self.blank_row[key][:0]]  # no row has an image: all 0, the blank one unread
            if present:  # [B, T, images, tiles]: 0 (reads nothing) for padding and rows without the key
                shape = [max(t.shape[d] for t in present) for d in range(1, present[0].dim())]
                padded = torch.zeros((len(samples), length, *shape), dtype=present[0].dtype)
                for row, sample in enumerate(samples):
                    if key in sample:
                        padded[(row, *(slice(0, n) for n in sample[key].shape))] = sample[key]
                batch[key] = padded
        for key in sorted({k for s in samples for k in _image_keys(s)}):
            batch[key] = _concat_images([s[key] for s in samples if key in s])
        return batch


def reads_images_per_row(processor) -> bool:
    """Whether the model reads each row's images through cross-attention (its processor gives a per-token
    image key such as Llama 3.2 Vision's `cross_attention_mask`), not as image tokens in the sequence."""
    if not is_multimodal(processor):
        return False
    cached = processor.__dict__.get("_ntil_reads_images_per_row")
    if cached is None:
        cached = any(k in PER_TOKEN_IMAGE_KEYS for k in _fake_image_sample(processor))
        processor._ntil_reads_images_per_row = cached
    return cached


def _concat_images(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The samples' per-image tensors, concatenated in sample order. Where they differ beyond the first
    dimension (SmolVLM's pixels (1, tiles, 3, H, W) and pixel_attention_mask (1, tiles, H, W): one row per
    sample, a varying number of tiles), each is zero-padded to the largest first, as the processor pads a
    batch; SmolVLM skips all-zero tiles."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for tensor in tensors:
        if list(tensor.shape[1:]) != shape:
            grown = tensor.new_zeros((tensor.shape[0], *shape))
            grown[tuple(slice(0, n) for n in tensor.shape)] = tensor
            tensor = grown
        padded.append(tensor)
    return torch.cat(padded)


def _image_keys(sample: dict) -> list[str]:
    return [k for k in sample if k not in (*PER_TOKEN_KEYS, *PER_TOKEN_IMAGE_KEYS, "targets")]


# Image-processor settings that keep the fake image to a single tile in families that would split it
# (SmolVLM resizes every image up and splits it: 17 tiles of 81 tokens in SmolVLM2-2.2B; 1 without).
# Applied where the image processor has the setting.
_FAKE_IMAGE_ONE_TILE = {"do_image_splitting": False}


def _fake_image_sample(processor) -> dict[str, torch.Tensor]:
    """The processor's output for one small blank image alone: its placeholder tokens and pixels."""
    image = Image.new("RGB", (28, 28), (0, 0, 0))  # the processor resizes it to its smallest size
    one_tile = {k: v for k, v in _FAKE_IMAGE_ONE_TILE.items() if hasattr(processor.image_processor, k)}
    out = processor(
        text=[processor.image_token],
        images=[image],
        return_tensors="pt",
        add_special_tokens=False,
        **one_tile,
    )
    per_token = (*PER_TOKEN_KEYS, *PER_TOKEN_IMAGE_KEYS)
    sample = {k: (v[0] if k in per_token else v) for k, v in out.items() if isinstance(v, torch.Tensor)}
    sample["attention_mask"] = torch.zeros_like(sample["input_ids"])
    sample["targets"] = torch.full_like(sample["input_ids"], IGNORE_INDEX)
    return sample


def _append(sample: dict[str, torch.Tensor], fake: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sample` (text only) followed by the fake image's tokens; a per-token key one side lacks is 0 there."""
    n_real, n_fake = len(sample["input_ids"]), len(fake["input_ids"])
    merged = dict(fake)  # the image tensors, and per-token keys only the fake has
    for key in {*sample, *fake} - set(_image_keys(fake)):
        real = sample.get(key, torch.zeros(n_real, dtype=fake[key].dtype if key in fake else torch.long))
        extra = fake.get(key, torch.zeros(n_fake, dtype=real.dtype))
        merged[key] = torch.cat([real, extra.to(real.dtype)])
    return merged
