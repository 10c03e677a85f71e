"""Data pipeline with tiny offline processors: label masking, truncation, collation and the fake image,
bad-input errors and skip counts. (Sampler: test_data_sampler.py; synthetic tasks: test_data_synthetic.py.)"""

import json
import logging
import shutil

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from ntil_ds.data import (
    IGNORE_INDEX,
    BadSample,
    Collator,
    ConversationDataset,
    DataError,
    is_multimodal,
    load_processor,
    tokenizer_of,
)
from ntil_ds.data.encoding import encode, expands_to_image_tokens_only
from ntil_ds.tiny import TINY_KINDS, build_tiny_model_folder

# (llama, the text-only Llama 3 of the grouped comparison, is mllama's tokenizer and template without images)
KINDS = tuple(k for k in TINY_KINDS if k != "llama")

MLLM_KINDS = ("qwen2_vl", "qwen2_5_vl", "llava", "qwen3_vl", "gemma3", "internvl", "smolvlm")
END_OF_TURN = {
    "qwen2_vl": "<|im_end|>",
    "qwen2_5_vl": "<|im_end|>",
    "llava": "</s>",
    "qwen2": "<|im_end|>",
    "qwen3_vl": "<|im_end|>",
    "gemma3": "<end_of_turn>",
    "internvl": "<|im_end|>",
    "smolvlm": "<end_of_utterance>",
    "qwen3_vl_moe": "<|im_end|>",
    "qwen3_5": "<|im_end|>",
    "mllama": "<|eot_id|>",
    "glm4v": "<|endoftext|>",
    "qwen3_5_moe": "<|im_end|>",
    "glm4v_moe": "<|endoftext|>",
    "mistral3": "</s>",
    "llama4": "<|eot|>",  # (its processor is the tokenizer where torchvision is missing: text only)
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def processors(folders):
    return {kind: load_processor(folder) for kind, folder in folders.items()}


def _user(text, images=()):
    return {
        "role": "user",
        "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}],
    }


def _write(tmp_path, rows, name="data.jsonl"):
    """JSONL rows (dicts, or raw strings written as they are) next to two small images."""
    Image.new("RGB", (64, 48), (200, 20, 20)).save(tmp_path / "red.png")
    Image.new("RGB", (100, 60), (20, 20, 200)).save(tmp_path / "blue.png")
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _labelled_text(tokenizer, sample):
    targets = sample["targets"]
    return tokenizer.decode(targets[targets != IGNORE_INDEX])


def _runs(mask):
    """Contiguous runs of True, as (start, end) pairs."""
    runs, start = [], None
    for i, value in enumerate([*mask.tolist(), False]):
        if value and start is None:
            start = i
        if not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ----------------------------------------------------------------------------------------------------
# labels (as aligned targets: position t is trained to predict token t+1)


@pytest.mark.parametrize("kind", KINDS)
def test_labels_are_exactly_the_answers_and_their_end_of_turn(tmp_path, processors, kind):
    processor = processors[kind]
    tokenizer = tokenizer_of(processor)
    images = [] if not is_multimodal(processor) else ["red.png"]  # (qwen2; llama4 without torchvision)
    rows = [
        {"messages": [_user("What time is it?", images), {"role": "assistant", "content": "10:42"}]},
        {  # multi-turn, with a system prompt: both answers, and only them
            "messages": [
                {"role": "system", "content": "Answer with digits."},
                _user("What is 12+30?"),
                {"role": "assistant", "content": "42"},
                _user("And 1000-1?"),
                {"role": "assistant", "content": [{"type": "text", "text": "999"}]},
            ]
        },
    ]
    dataset = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=512)
    eot = END_OF_TURN[kind]
    first, second = dataset[0], dataset[1]
    assert _labelled_text(tokenizer, first) == f"10:42{eot}"
    assert _labelled_text(tokenizer, second) == f"42{eot}999{eot}"
    for sample in (first, second):
        targets, input_ids = sample["targets"], sample["input_ids"]
        labelled = targets != IGNORE_INDEX
        # aligned in the data: the target of position t is the next token, and the last is never trained
        assert torch.equal(targets[:-1][labelled[:-1]], input_ids[1:][labelled[:-1]])
        assert not labelled[-1]
        # each labelled run ends with the end-of-turn token and is preceded by the prompt
        for start, end in _runs(labelled):
            assert tokenizer.convert_ids_to_tokens(int(targets[end - 1])) == eot
            assert start > 0 and not labelled[start - 1]
    if images:
        image_tokens = first["input_ids"] == _expanded_image_token_id(processor)
        # (Llama 3.2 Vision: one <|image|> token, the image is read by cross-attention)
        assert (
            image_tokens.sum() > (0 if kind == "mllama" else 1)
            and not (first["targets"] == _expanded_image_token_id(processor)).any()
        )
        # the whole image sits in one run of placeholders the processor expanded; SmolVLM: one run of
        # image_seq_len tokens per tile it cut (the 64x48 image, scaled to 84x64: 3x3 tiles + the whole image)
        runs = _runs(image_tokens)
        if kind == "smolvlm":
            assert len(runs) == first["pixel_values"].shape[1] == 3 * 3 + 1
            assert {end - start for start, end in runs} == {processor.image_seq_len}
        elif kind == "mistral3":
            # Pixtral: a row of [IMG] per patch row, each ended by [IMG_BREAK] / [IMG_END]
            rows = torch.isin(first["input_ids"], torch.tensor(processor.image_token_ids))
            assert len(runs) > 1 and len(_runs(rows)) == 1
            assert int(first["input_ids"][_runs(rows)[0][1] - 1]) == processor.image_end_token_id
        else:
            assert len(runs) == 1


def _expanded_image_token_id(processor) -> int:
    """The token an image's features replace: Gemma 3 writes <start_of_image> (processor.image_token) but
    expands it to <image_soft_token> x N between markers; the others repeat the placeholder itself."""
    return getattr(tokenizer_of(processor), "image_token_id", None) or processor.image_token_id


# (width, height) -> the tiles the tiny SmolVLM cuts, by its rule written out: scale the longest edge to 84,
# round each side up to a multiple of the 28-pixel tile, rows x columns tiles + the whole image (if > 1).
# 200x50 -> 84x22 -> 1x3 + 1; 300x240 -> 84x68 -> 3x3 + 1; 100x60 -> 84x50 -> 2x3 + 1; a 20x20 is scaled up.
SMOLVLM_TILES = {(28, 28): 10, (20, 20): 10, (200, 50): 4, (50, 200): 4, (300, 240): 10, (100, 60): 7}
IMAGE_SIZES = list(SMOLVLM_TILES)


@pytest.mark.parametrize("kind", MLLM_KINDS)
def test_image_tokens_equal_the_processors_for_every_image_size(tmp_path, processors, kind):
    # encode() measures ids and labels without pixels (once per image size); the processor run on the real
    # image must give the same ids, whatever the resizing or tiling the size leads to.
    processor = processors[kind]
    for i, size in enumerate(IMAGE_SIZES):
        Image.new("RGB", size, (40 * i, 120, 200)).save(tmp_path / f"{i}.png")
    rows = [
        {"messages": [_user("What time is it?", [f"{i}.png"]), {"role": "assistant", "content": "10:42"}]}
        for i in range(len(IMAGE_SIZES))
    ]
    dataset = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=4096)
    for size, conversation in zip(IMAGE_SIZES, dataset.conversations, strict=True):
        encoded = encode(processor, conversation, max_seq_len=4096)
        with Image.open(conversation.images[0]) as image:
            out = processor(
                text=[encoded.text],
                images=[image.convert("RGB")],
                return_tensors="pt",
                add_special_tokens=False,
            )
        assert torch.equal(torch.from_numpy(encoded.input_ids), out["input_ids"][0])
        if kind == "smolvlm":  # the tiles cut, each with its image_seq_len tokens
            n_image = int((out["input_ids"] == processor.image_token_id).sum())
            assert out["pixel_values"].shape[1] == SMOLVLM_TILES[size]
            assert n_image == processor.image_seq_len * SMOLVLM_TILES[size]


def test_template_without_end_of_turn_gets_eos_after_the_answer(tmp_path, folders):
    # llava-1.5-hf's own template ends answers with nothing: the model would never learn to stop.
    folder = tmp_path / "llava_hf_template"
    shutil.copytree(folders["llava"], folder)
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
        "{% for c in message['content'] %}{% if c['type'] == 'image' %}{{ '<image>\\n' }}"
        "{% else %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    )
    processor = load_processor(folder)
    rows = [{"messages": [_user("What time is it?", ["red.png"]), {"role": "assistant", "content": "10:42"}]}]
    sample = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=512)[0]
    tokenizer = tokenizer_of(processor)
    assert _labelled_text(tokenizer, sample) == "10:42</s>"
    assert tokenizer.decode(sample["input_ids"]).endswith("ASSISTANT: 10:42</s> ")


def test_sharegpt_layout_is_converted(tmp_path, processors):
    processor = processors["qwen2_vl"]
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "<image>\nHow many shapes?"},
                {"from": "gpt", "value": "7"},
                {"from": "human", "value": "And here <image> ?"},
                {"from": "gpt", "value": "12"},
            ],
            "images": ["red.png", "blue.png"],
        },
        {"conversations": [{"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"}]},
    ]
    dataset = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=512)
    first = dataset.conversations[0]
    assert [m["role"] for m in first.messages] == ["user", "assistant", "user", "assistant"]
    assert first.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]
    assert [p.name for p in first.images] == ["red.png", "blue.png"]
    sample = dataset[0]
    assert sample["image_grid_thw"].shape == (2, 3)
    assert len(_runs(sample["input_ids"] == processor.image_token_id)) == 2
    assert _labelled_text(tokenizer_of(processor), sample) == "7<|im_end|>12<|im_end|>"
    assert _labelled_text(tokenizer_of(processor), dataset[1]) == "2<|im_end|>"


# ----------------------------------------------------------------------------------------------------
# truncation


def test_truncation_keeps_whole_answers_and_never_cuts_an_image(tmp_path, processors):
    processor = processors["qwen2_vl"]
    tokenizer = tokenizer_of(processor)
    long_question = "Please think about this question carefully. " * 4
    rows = [
        {  # fits
            "messages": [_user("1+1?"), {"role": "assistant", "content": "2"}]
        },
        {  # two answers; the cut falls inside the second: only the first is trained on
            "messages": [
                _user("What is 12+30?"),
                {"role": "assistant", "content": "42"},
                _user(long_question),
                {"role": "assistant", "content": "123456789"},
            ]
        },
        {  # the image lies past the cut: cannot be truncated
            "messages": [
                _user(long_question * 3),
                _user("Now look.", ["red.png"]),
                {"role": "assistant", "content": "1"},
            ]
        },
    ]
    path = _write(tmp_path, rows)
    full = ConversationDataset(path, processor, max_seq_len=4096)
    full_lengths = [len(full[i]["input_ids"]) for i in range(3)]
    second_answer_end = full_lengths[1]
    # the targets "4", "2", "<|im_end|>" sit one position before their tokens
    first_answer_end = int(torch.nonzero(full[1]["targets"] != IGNORE_INDEX)[2]) + 2
    max_len = second_answer_end - 3  # cuts the second answer
    assert first_answer_end < max_len < full_lengths[2]

    with pytest.raises(BadSample, match=rf"{path}:3: .*tokens > data.max_seq_len={max_len} .*cut an image"):
        ConversationDataset(path, processor, max_seq_len=max_len)
    dataset = ConversationDataset(path, processor, max_seq_len=max_len, on_bad_sample="skip")
    assert len(dataset) == 2 and dataset.report.skipped == {"too_long": 1}
    assert dataset.report.truncated == 1
    cut = dataset[1]
    assert len(cut["input_ids"]) == max_len
    assert torch.equal(cut["input_ids"], full[1]["input_ids"][:max_len])
    assert _labelled_text(tokenizer, cut) == "42<|im_end|>"

    # cut before the first answer ends: nothing to train on -> too long
    with pytest.raises(BadSample, match="leaves no complete answer"):
        ConversationDataset(path, processor, max_seq_len=first_answer_end - 1)


# ----------------------------------------------------------------------------------------------------
# collation, padding, fake image


def _model(folder, kind):
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    cls = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    return cls.from_config(config).eval()


def _forward(model, batch):
    return model(**{k: v for k, v in batch.items() if k != "targets"}).logits


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava", "qwen3_vl", "gemma3", "internvl", "smolvlm"])
def test_padded_mixed_batch_equals_one_by_one(tmp_path, folders, processors, kind):
    processor = processors[kind]
    rows = [
        {"messages": [_user("What time is it?", ["red.png"]), {"role": "assistant", "content": "10:42"}]},
        {"messages": [_user("What is 12+30?"), {"role": "assistant", "content": "42"}]},
        {
            "messages": [
                _user("Which two?", ["blue.png", "red.png"]),
                {"role": "assistant", "content": "[1, 2]"},
            ]
        },
    ]
    dataset = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=512)
    samples = [dataset[i] for i in range(3)]
    collator = Collator(processor, fake_image=True)
    batch = collator(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape == (3, max(lengths))
    pad = tokenizer_of(processor).pad_token_id
    for row, length in enumerate(lengths):
        assert (batch["attention_mask"][row, :length] == 1).all() and (
            batch["attention_mask"][row, length:] == 0
        ).all()
        assert (batch["input_ids"][row, length:] == pad).all() and (
            batch["targets"][row, length:] == IGNORE_INDEX
        ).all()
    model = _model(folders[kind], kind)
    with torch.no_grad():
        together = _forward(model, batch)
        for row, sample in enumerate(samples):
            alone = _forward(model, Collator(processor, fake_image=False)([sample]))
            torch.testing.assert_close(together[row, : lengths[row]], alone[0], rtol=1e-5, atol=1e-5)


def _internvl_tiles(width: int, height: int, tile: int, max_tiles: int) -> int:
    """InternVL's tiling rule (its dynamic_preprocess), written independently of transformers: the grid of
    at most `max_tiles` tiles whose aspect ratio is closest to the image's, a tie going to the larger grid
    when the image covers more than half of its area; more than one tile adds a thumbnail tile."""
    grids = sorted(
        {(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if c * r <= max_tiles},
        key=lambda g: g[0] * g[1],
    )
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(width / height - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * c * r:
            best = (c, r)
    n = best[0] * best[1]
    return n + 1 if n > 1 else n


def test_tiled_images_take_as_many_tokens_as_the_processor_gives(tmp_path, folders, processors):
    # InternVL's processor cuts each image into tiles (the tiny one: up to 4 of 28x28 + a thumbnail), so an
    # image's token count depends on its size. The encoder measures it without pixels; dataset[i] checks
    # those ids against the processor's, and the model (one feature per token) would refuse a mismatch.
    processor = processors["internvl"]
    image_processor = processor.image_processor
    tile, max_tiles = image_processor.size["height"], image_processor.max_patches
    model = _model(folders["internvl"], "internvl")
    tiles_seen = set()
    for width, height in [(28, 28), (64, 48), (100, 60), (30, 200)]:
        Image.new("RGB", (width, height), (90, 200, 30)).save(tmp_path / f"{width}x{height}.png")
        row = {
            "messages": [
                _user("What time?", [f"{width}x{height}.png"]),
                {"role": "assistant", "content": "1"},
            ]
        }
        path = tmp_path / f"{width}x{height}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        sample = ConversationDataset(path, processor, max_seq_len=512)[0]
        tiles = _internvl_tiles(width, height, tile, max_tiles)
        assert sample["pixel_values"].shape[0] == tiles
        n_image_tokens = int((sample["input_ids"] == processor.image_token_id).sum())
        assert n_image_tokens == tiles * processor.image_seq_length
        with torch.no_grad():
            _forward(model, Collator(processor, fake_image=False)([sample]))
        tiles_seen.add(tiles)
    assert tiles_seen == {1, 3, 5}  # the sizes above exercise 1x1, 2x1 and 2x2 / 1x4 grids


@pytest.mark.parametrize("kind", MLLM_KINDS)
def test_fake_image_runs_the_vision_tower_without_changing_the_text(tmp_path, folders, processors, kind):
    processor = processors[kind]
    rows = [
        {"messages": [_user("What is 12+30?"), {"role": "assistant", "content": "42"}]},
        {"messages": [_user("What is 100+1?"), {"role": "assistant", "content": "101"}]},
    ]
    dataset = ConversationDataset(_write(tmp_path, rows), processor, max_seq_len=512)
    samples = [dataset[0], dataset[1]]
    plain = Collator(processor, fake_image=False)(samples)
    batch = Collator(processor, fake_image=True)(samples)
    assert "pixel_values" not in plain and "pixel_values" in batch
    if kind == "smolvlm":  # one tile: the fake image is not split (a real SmolVLM2 would cut 4x4 + 1)
        assert batch["pixel_values"].shape[:2] == batch["pixel_attention_mask"].shape[:2] == (1, 1)
    n_real = len(samples[0]["input_ids"])
    fake = slice(n_real, None)
    image_id = _expanded_image_token_id(processor)
    fake_is_image = batch["input_ids"][0, fake] == image_id
    # Qwen/LLaVA: image tokens only; Gemma 3: its image tokens between "\n\n<start_of_image>" and
    # "<end_of_image>\n\n"; InternVL: between "<img>" and "</img>"; SmolVLM: between
    # <fake_token_around_image> markers
    assert fake_is_image.any() and (batch["attention_mask"][0, fake] == 0).all()
    assert bool(fake_is_image.all()) == expands_to_image_tokens_only(processor)
    assert (batch["targets"][0, fake] == IGNORE_INDEX).all()
    assert torch.equal(batch["targets"][0, :n_real], samples[0]["targets"])
    if "mm_token_type_ids" in batch:
        assert (batch["mm_token_type_ids"][0, fake] == 1).all()
    if "token_type_ids" in batch:  # Gemma 3 marks its image tokens (bidirectional attention among them)
        assert torch.equal(batch["token_type_ids"][0, fake].bool(), fake_is_image)

    model = _model(folders[kind], kind)
    logits = _forward(model, batch)
    reference = _forward(model, plain)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        torch.testing.assert_close(logits[row, :n], reference[row, :n], rtol=1e-5, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    vision = [
        p
        for n, p in model.named_parameters()
        if any(part in n for part in ("visual", "vision_tower", "vision_model")) and p.grad is not None
    ]
    assert vision, "the vision tower did not run"
    assert all(float(p.grad.abs().max()) == 0.0 for p in vision)  # ran, but the loss does not depend on it


def test_text_only_tokenizer_gets_no_fake_image(tmp_path, processors):
    tokenizer = processors["qwen2"]
    rows = [{"messages": [_user("What is 12+30?"), {"role": "assistant", "content": "42"}]}]
    dataset = ConversationDataset(_write(tmp_path, rows), tokenizer, max_seq_len=64)
    batch = Collator(tokenizer, fake_image=True)([dataset[0]])
    assert set(batch) == {"input_ids", "attention_mask", "targets"}


# ----------------------------------------------------------------------------------------------------
# bad input


BAD_LINES = {
    "malformed_json": ('{"messages": [', "not valid JSON"),
    "missing_image": (
        {"messages": [_user("?", ["nowhere.png"]), {"role": "assistant", "content": "1"}]},
        "image 'nowhere.png' not found",
    ),
    "unreadable_image": (
        {"messages": [_user("?", ["broken.png"]), {"role": "assistant", "content": "1"}]},
        "image 'broken.png' cannot be read",
    ),
    "no_assistant_turn": ({"messages": [_user("What time is it?")]}, "no assistant turn"),
    "empty_answer": ({"messages": [_user("?"), {"role": "assistant", "content": "  "}]}, "answer is empty"),
    "bad_schema": ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
}


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_is_an_error_naming_file_and_line(tmp_path, processors, reason):
    bad_line, message = BAD_LINES[reason]
    good = {"messages": [_user("What time is it?", ["red.png"]), {"role": "assistant", "content": "10:42"}]}
    path = _write(tmp_path, [good, good, bad_line])
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(BadSample, match=rf"^{path}:3: .*{message}.*on_bad_sample=skip") as error:
        ConversationDataset(path, processors["qwen2_vl"], max_seq_len=256)
    assert error.value.reason == reason


def test_skip_counts_every_bad_line_and_logs_them(tmp_path, processors, caplog):
    good = {"messages": [_user("What time is it?", ["red.png"]), {"role": "assistant", "content": "10:42"}]}
    rows = [good, *(line for line, _ in BAD_LINES.values()), "", good]  # a blank line is not a sample
    rows.append(
        {"conversations": [{"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "1"}]}
    )
    path = _write(tmp_path, rows)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with caplog.at_level(logging.WARNING):
        dataset = ConversationDataset(path, processors["qwen2_vl"], max_seq_len=256, on_bad_sample="skip")
    assert len(dataset) == 2 == dataset.report.kept
    expected = dict.fromkeys(BAD_LINES, 1)
    expected["bad_schema"] += 1  # the ShareGPT line: 2 markers, 0 images
    assert dict(dataset.report.skipped) == expected
    assert dataset.report.num_skipped == 7
    assert "7 skipped" in caplog.text and f"{path}:2:" in caplog.text


def test_bad_file_and_options_are_clear_errors(tmp_path, processors):
    with pytest.raises(DataError, match="data file not found"):
        ConversationDataset(tmp_path / "nope.jsonl", processors["qwen2"])
    with pytest.raises(DataError, match="on_bad_sample must be 'error' or 'skip'"):
        ConversationDataset(tmp_path / "nope.jsonl", processors["qwen2"], on_bad_sample="ignore")
    only_bad = _write(tmp_path, ['{"oops"'])
    with pytest.raises(DataError, match="no usable samples"):
        ConversationDataset(only_bad, processors["qwen2"], on_bad_sample="skip")
    with_image = _write(
        tmp_path, [{"messages": [_user("?", ["red.png"]), {"role": "assistant", "content": "1"}]}]
    )
    with pytest.raises(BadSample, match="text-only tokenizer"):
        ConversationDataset(with_image, processors["qwen2"])
