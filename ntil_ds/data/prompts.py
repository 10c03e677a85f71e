"""Prompts for generation: a conversation up to its last answer, batched with left padding."""

from __future__ import annotations

import torch

from ntil_ds.data.dataset import load_rgb
from ntil_ds.data.encoding import render
from ntil_ds.data.processor import is_multimodal, tokenizer_of
from ntil_ds.data.records import Conversation


def split_last_answer(conversation: Conversation) -> tuple[list[dict], list, str]:
    """(messages before the last assistant turn, the images they show, the last answer)."""
    last = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
    messages = conversation.messages[:last]
    n_images = sum(part["type"] == "image" for m in messages for part in m["content"])
    return messages, conversation.images[:n_images], conversation.answers()[-1]


def prompt_batch(processor, conversations: list[Conversation]) -> dict[str, torch.Tensor]:
    """Model inputs for `model.generate`: each conversation's prompt (generation prompt appended),
    left-padded so that every row's new tokens start at the same column."""
    texts, images = [], []
    for conversation in conversations:
        messages, image_paths, _ = split_last_answer(conversation)
        texts.append(render(processor, messages, add_generation_prompt=True))
        images.extend(load_rgb(path, conversation.source) for path in image_paths)
    tokenizer = tokenizer_of(processor)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        if is_multimodal(processor):
            batch = processor(
                text=texts, images=images or None, padding=True, return_tensors="pt", add_special_tokens=False
            )
        else:
            batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    return dict(batch)
