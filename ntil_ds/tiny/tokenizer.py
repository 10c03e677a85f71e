"""The tiny folders' tokenizers: a byte-level BPE trained here, deterministically, on a small fixed
English corpus, wrapped as a transformers fast tokenizer with the family's special tokens and chat
template; and the text-model dimensions every tiny family shares.

The BPE spells numbers digit by digit (like Qwen's), holds every byte, so any text encodes, and keeps the
model family's special tokens (bos/eos/pad, image and vision markers) inside its small vocabulary.
"""

from __future__ import annotations

from importlib.resources import files

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Tiny vocab: 256 bytes + special tokens + merges learned on the corpus below.
TINY_VOCAB_SIZE = 512

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Fixed training text for the BPE merges: the prompts of the synthetic tasks and common English, so
# typical prompts take few tokens. Digits never merge (they are split before BPE sees them).
_CORPUS = """
You are a helpful assistant. What time is it? What time does the clock show? Answer as HH:MM.
Where is the red square? Where is the blue circle? Where is the green triangle? Answer with the box
[x1, y1, x2, y2] in pixels. What is the value of the bar labelled A? What is the value of the bar?
Compute the sum. Compute the difference. Compute the product. What is the answer? The answer is
the number. Describe the image. What is in the picture? How many objects are there? Read the chart.
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words. This is a test of the
tokenizer with some ordinary English sentences, questions and answers about images, charts, clocks,
boxes, shapes, colours: red, green, blue, yellow, orange, purple, black, white, gray, cyan, magenta.
square circle triangle rectangle hour minute second left right top bottom width height value label
plus minus times divided equals sum difference product quotient result number digits
USER: ASSISTANT: system user assistant
"""


def chat_template(name: str) -> str:
    """The chat template ``templates/<name>.jinja`` (package data; the file ends with one newline that
    is not part of the template)."""
    return (files(__package__) / "templates" / f"{name}.jinja").read_text(encoding="utf-8").removesuffix("\n")


def train_tokenizer(special_tokens: tuple[str, ...]) -> Tokenizer:
    # Digits first, one per token (as Qwen does), then GPT-2 byte-level splitting of the rest.
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return _byte_level_bpe(pre_tokenizer, special_tokens)


def _byte_level_bpe(pre_tokenizer, special_tokens: tuple[str, ...]) -> Tokenizer:
    """A byte-level BPE trained on the tiny corpus after `pre_tokenizer` (what both tiny kinds share)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() for _ in range(3)]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def fast_tokenizer(special_tokens: tuple[str, ...], chat_template: str, **token_roles: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(special_tokens),
        chat_template=chat_template,
        model_max_length=4096,
        **token_roles,
    )


def qwen_tokenizer(template: str):
    """Qwen's tokens; the instruct models end a turn (and generation) with <|im_end|>; <|endoftext|> pads."""
    return fast_tokenizer(
        QWEN_SPECIAL_TOKENS, chat_template(template), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def tiny_text_config_kwargs(tokenizer) -> dict:
    """The text model every tiny family shares: 2 layers of width 64, the tokenizer's special ids."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.bos_token or tokenizer.pad_token),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


# LLaMA-3's pre-tokenizer regex (also Llama 4's, GLM-4.xV's, and the one Mistral Small 3.1's tokenizer.json
# ships by mistake): numbers in groups of 1-3 digits from the left ("2024" -> "202" "4").
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_GROUPED_NUMBERS = [f"{v:0{w}d}" for w in (2, 3) for v in range(10**w)]


def train_grouped_tokenizer(special_tokens: tuple[str, ...]) -> Tokenizer:
    """A LLaMA-3-style byte-level BPE: `LLAMA3_SPLIT_REGEX` splits the text, then byte-level BPE; the
    vocabulary holds every number token of 1-3 digits ("0".."9", "00".."99", "000".."999"), each reached
    by merges whatever order they are applied in, so every group of digits is one token as in LLaMA-3."""
    import json

    from tokenizers import Regex

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer = _byte_level_bpe(pre_tokenizer, special_tokens)
    state = json.loads(tokenizer.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    known = {tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges}
    for number in _GROUPED_NUMBERS:  # ASCII digits are their own byte-level symbols
        splits = (
            [(number[:1], number[1:])]
            if len(number) == 2
            else [(number[:1], number[1:]), (number[:2], number[2:])]
        )
        for pair in splits:
            if pair not in known:
                known.add(pair)
                merges.append(list(pair))
        vocab.setdefault(number, len(vocab))
    return Tokenizer.from_str(json.dumps(state))


def grouped_fast_tokenizer(special_tokens: tuple[str, ...], chat_template: str, **token_roles: str):
    """`fast_tokenizer` with `train_grouped_tokenizer`'s LLaMA-3-style number grouping."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_grouped_tokenizer(special_tokens),
        chat_template=chat_template,
        model_max_length=4096,
        **token_roles,
    )
