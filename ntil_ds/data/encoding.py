"""A conversation to token ids and labels, with the model's own chat template and processor.

Labels: -100 everywhere except the assistant answers and the end-of-turn text the template puts right
after each answer (e.g. Qwen's `<|im_end|>`, LLaVA's `</s>`), so the model learns to stop. A template
that puts nothing after an answer gets the tokenizer's eos token inserted there. Image placeholder
tokens are never labels.

How: the template is rendered for the whole conversation and, for each assistant turn, for the part
before it (with the generation prompt); the difference locates the answer in the text. The text is
tokenized once with offsets (one placeholder token per image), tokens overlapping an answer become
labels, then each placeholder is expanded to the number of tokens its image takes in this model, which
the processor computes from the image size alone. No pixels are processed here, so a large dataset is
checked and measured quickly at the start. `__getitem__` later runs the full processor and checks that
its ids equal these.

Targets: the labels aligned with the model's outputs, made here once per sample (:func:`aligned_targets`):
position t is trained to predict token t+1, so ``targets = labels[1:] + [IGNORE_INDEX]``. Nothing
downstream shifts again (the trainer, the loss, packing and evaluation all read ``targets``), and a
sample's last target is always ignored, so samples packed into one row never train one sample's last
position on the next sample's first token, and NTIL's digit runs never join two samples' numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.processor import is_multimodal, tokenizer_of
from ntil_ds.data.records import BadSample, Conversation, DataError, open_image, text_of


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids (image placeholders expanded) and labels, both already cut to `max_seq_len`, and the
    rendered text they come from (one placeholder per image: what the processor is given)."""

    text: str
    input_ids: np.ndarray  # int64 [T]
    labels: np.ndarray  # int64 [T], IGNORE_INDEX where not trained on
    truncated: bool  # text after max_seq_len was cut off (whole answers only)


def aligned_targets(labels: np.ndarray) -> np.ndarray:
    """The training targets of one sample: ``labels`` shifted one to the left (position t predicts token
    t+1), the last position ignored. The (small) labels move, never the (large) logits."""
    return np.concatenate([labels[1:], np.array([IGNORE_INDEX], dtype=labels.dtype)])


def template_messages(processor, messages: list[dict]) -> list[dict]:
    """Messages as the processor's chat template expects them: content parts for an MLLM processor,
    plain strings for a text-only tokenizer (whose templates, like Qwen2's, concatenate strings)."""
    if is_multimodal(processor):
        return messages
    return [{"role": m["role"], "content": text_of(m)} for m in messages]


def render(processor, messages: list[dict], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages` (one placeholder per image)."""
    return processor.apply_chat_template(
        template_messages(processor, messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(processor, conversation: Conversation, max_seq_len: int) -> EncodedConversation:
    """Encode one checked conversation (raises `BadSample` for a conversation that cannot be used)."""
    if conversation.images and not is_multimodal(processor):
        if getattr(processor, "images_refused_because", None):  # (no on_bad_sample=skip: every image is)
            raise DataError(f"{conversation.source}: has an image, but {processor.images_refused_because}")
        raise BadSample(
            conversation.source,
            "image_for_text_model",
            f"has {len(conversation.images)} image(s) but the model's processor is a text-only tokenizer",
        )
    text, label_spans = _text_and_label_spans(processor, conversation)
    if conversation.images and not expands_to_image_tokens_only(processor):
        return _encode_expanded(processor, conversation, text, label_spans, max_seq_len)
    tokenizer = tokenizer_of(processor)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    # turn[t] = k+1 when token t belongs to the k-th answer span, 0 otherwise
    turn = np.zeros(len(ids), dtype=np.int64)
    for k, (start, end) in enumerate(label_spans):
        turn[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = k + 1

    repeats = np.ones(len(ids), dtype=np.int64)
    if is_multimodal(processor):
        placeholders = np.flatnonzero(ids == processor.image_token_id)
        if len(placeholders) != len(conversation.images):
            raise BadSample(
                conversation.source,
                "image_marker_mismatch",
                f"the text has {len(placeholders)} image placeholder(s) ({processor.image_token!r}) but the line "
                f"has {len(conversation.images)} image(s); remove literal placeholders from the text",
            )
        if turn[placeholders].any():
            raise BadSample(conversation.source, "bad_schema", "an image placeholder falls inside an answer")
        repeats[placeholders] = image_token_counts(processor, conversation)

    input_ids = np.repeat(ids, repeats)
    turn = np.repeat(turn, repeats)
    labels = np.where(turn > 0, input_ids, IGNORE_INDEX)
    if len(input_ids) <= max_seq_len:
        return EncodedConversation(text, input_ids, labels, truncated=False)
    in_image = is_multimodal(processor) & (input_ids == getattr(processor, "image_token_id", -1))
    return _truncate(conversation, text, input_ids, labels, turn, in_image, max_seq_len)


def expands_to_image_tokens_only(processor) -> bool:
    """True when the processor replaces each image placeholder by N copies of one token (Qwen-VL, LLaVA);
    False when the expansion has other text around them (Gemma 3: "\\n\\n<start_of_image>" + N soft tokens +
    "<end_of_image>\\n\\n"; SmolVLM/InternVL: start/end markers). Measured once on a blank image."""
    cached = getattr(processor, "_ntil_pure_image_expansion", None)
    if cached is None:
        replacement = image_replacement(processor, (28, 28))
        cached = replacement.replace(processor.image_token, "") == "" and replacement != ""
        processor._ntil_pure_image_expansion = cached
    return cached


def image_replacement(processor, size: tuple[int, int]) -> str:
    """The text the processor puts in place of one image placeholder, for an image of `size` (h, w).

    The expansion depends on the image size only (crops, tiles), so a blank image of that size gives it;
    one per distinct size is computed and kept on the processor."""
    cache = processor.__dict__.setdefault("_ntil_image_replacements", {})
    if size not in cache:
        out = processor(
            text=[processor.image_token],
            images=[Image.new("RGB", (size[1], size[0]), (0, 0, 0))],
            return_text_replacement_offsets=True,
            add_special_tokens=False,
        )
        if "text_replacement_offsets" in out:
            (replacement,) = [
                r["replacement"] for r in out["text_replacement_offsets"][0] if r["type"] == "image"
            ]
        elif list(out["input_ids"][0]).count(processor.image_token_id) == 1:
            # not expanded: Llama 3.2 Vision reads the image by cross-attention (its processor adds a bos
            # after a text's leading image tokens, hence the count)
            replacement = processor.image_token
        else:
            raise DataError(
                f"{type(processor).__name__} neither reports how it expands an image placeholder "
                "(return_text_replacement_offsets) nor keeps it as one token; this family is not supported"
            )
        cache[size] = replacement
    return cache[size]


def _encode_expanded(processor, conversation, text, label_spans, max_seq_len) -> EncodedConversation:
    """Families whose image expansion has text around the image tokens: expand the placeholders in the
    text exactly as the processor does (same strings, same order), then tokenize the expanded text once,
    so the ids equal the processor's even where the inserted text merges with its neighbours."""
    placeholder = processor.image_token
    starts = []
    at = text.find(placeholder)
    while at >= 0:
        starts.append(at)
        at = text.find(placeholder, at + len(placeholder))
    if len(starts) != len(conversation.images):
        raise BadSample(
            conversation.source,
            "image_marker_mismatch",
            f"the text has {len(starts)} image placeholder(s) ({placeholder!r}) but the line "
            f"has {len(conversation.images)} image(s); remove literal placeholders from the text",
        )
    if any(s < end and start < s + len(placeholder) for s in starts for start, end in label_spans):
        raise BadSample(conversation.source, "bad_schema", "an image placeholder falls inside an answer")
    pieces, image_spans, shift, last = [], [], 0, 0
    for start, replacement in zip(starts, _replacements(processor, conversation), strict=True):
        pieces += [text[last:start], replacement]
        image_spans.append((start + shift, start + shift + len(replacement)))
        shift += len(replacement) - len(placeholder)
        last = start + len(placeholder)
    expanded = "".join([*pieces, text[last:]])

    replacements = _replacements(processor, conversation)
    deltas = [(s, len(r) - len(placeholder)) for s, r in zip(starts, replacements, strict=True)]

    def moved(position: int) -> int:  # a position of `text` in `expanded`
        return position + sum(delta for s, delta in deltas if s < position)

    tokenizer = tokenizer_of(processor)
    encoded = tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    turn = np.zeros(len(input_ids), dtype=np.int64)
    for k, (start, end) in enumerate(label_spans):
        turn[(offsets[:, 0] < moved(end)) & (offsets[:, 1] > moved(start))] = k + 1
    in_image = np.zeros(len(input_ids), dtype=bool)
    for start, end in image_spans:
        in_image |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    labels = np.where(turn > 0, input_ids, IGNORE_INDEX)
    if len(input_ids) <= max_seq_len:
        return EncodedConversation(text, input_ids, labels, truncated=False)
    return _truncate(conversation, text, input_ids, labels, turn, in_image, max_seq_len)


def _replacements(processor, conversation) -> list[str]:
    return [image_replacement(processor, tuple(size)) for size in conversation.image_sizes]


def image_token_counts(processor, conversation: Conversation) -> list[int]:
    """How many placeholder tokens each image of the conversation takes in this model."""
    sizes = [list(size) for size in conversation.image_sizes]
    if hasattr(processor, "_get_num_multimodal_tokens"):  # Qwen-VL, LLaVA and most MLLM processors
        return list(processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens)
    counts = []  # other processors: run them on each image alone and count
    for path in conversation.images:
        with open_image(path) as image:
            out = processor(text=[processor.image_token], images=[image.convert("RGB")], return_tensors="np")
        counts.append(int((out["input_ids"] == processor.image_token_id).sum()))
    return counts


def _text_and_label_spans(processor, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans to label: each answer + its end-of-turn text."""
    messages = conversation.messages
    text = render(processor, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    insert_eos_at: list[int] = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(processor, messages[:index], add_generation_prompt=True)
        upto = render(processor, messages[: index + 1], add_generation_prompt=False)
        if not (text.startswith(upto) and upto.startswith(prompt)):
            raise DataError(
                f"{conversation.source}: the chat template renders a conversation differently from its "
                "beginning (with the generation prompt), so the answer cannot be located; "
                "use a template whose turns are appended in order"
            )
        answer = text_of(message)
        segment = upto[len(prompt) :]
        at = segment.find(answer)
        if at < 0 or segment[:at].strip():
            raise DataError(
                f"{conversation.source}: the chat template changes the assistant's text "
                f"(rendered {segment!r} for answer {answer!r}); labels would not match the answer"
            )
        start = len(prompt) + at
        end = start + len(answer)
        after = segment[at + len(answer) :]
        end_of_turn = after.strip()
        if end_of_turn:
            end += after.index(end_of_turn) + len(end_of_turn)
        else:
            insert_eos_at.append(end)
        spans.append((start, end))
    return _insert_eos(processor, text, spans, insert_eos_at)


def _insert_eos(processor, text: str, spans, insert_at: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """A template that ends answers with nothing (e.g. llava-1.5-hf's) gets the eos token after each."""
    if not insert_at:
        return text, spans
    eos = tokenizer_of(processor).eos_token
    if not eos:
        raise DataError(
            "the chat template puts no end-of-turn text after answers and the tokenizer has no eos token"
        )
    for position in sorted(insert_at, reverse=True):
        text = text[:position] + eos + text[position:]
    shifted = []
    for start, end in spans:
        before = sum(1 for p in insert_at if p < start)  # eos tokens inserted before this span
        own = 1 if end in insert_at else 0
        shifted.append((start + before * len(eos), end + (before + own) * len(eos)))
    return text, shifted


def _truncate(conversation, text, input_ids, labels, turn, in_image, max_seq_len) -> EncodedConversation:
    """Cut to `max_seq_len`, never through an image and never keeping half an answer (`in_image`: the
    tokens that belong to an image's expansion)."""
    length = len(input_ids)
    if in_image[max_seq_len:].any():
        raise BadSample(
            conversation.source,
            "too_long",
            f"{length} tokens > data.max_seq_len={max_seq_len} and cutting would cut an image; "
            f"raise data.max_seq_len to at least {length}",
        )
    cut_turn = turn[max_seq_len - 1]
    answer_is_cut = cut_turn > 0 and turn[max_seq_len] == cut_turn
    input_ids, labels, turn = input_ids[:max_seq_len], labels[:max_seq_len].copy(), turn[:max_seq_len]
    if answer_is_cut:
        labels[turn == cut_turn] = IGNORE_INDEX  # the cut answer: trained on whole or not at all
    if not (labels != IGNORE_INDEX).any():
        raise BadSample(
            conversation.source,
            "too_long",
            f"{length} tokens > data.max_seq_len={max_seq_len} leaves no complete answer; "
            f"raise data.max_seq_len to at least {length}",
        )
    return EncodedConversation(text, input_ids, labels, truncated=True)
