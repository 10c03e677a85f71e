"""Token ids the loss needs, read from a Hugging Face tokenizer, with the checks that make them safe.

NTIL reads numbers digit by digit, so it needs a tokenizer that spells every number with one token
per digit (LLaMA-2, Mistral, Qwen2, ...). Tokenizers that group 1-3 digits per token (LLaMA-3,
DeepSeek) are refused with an explanation rather than trained on silently.
"""

from __future__ import annotations

from typing import Protocol

DIGITS = "0123456789"
# Prepended to "0123456789" so that a word-initial variant ("▁0", "Ġ0") lands on this digit and
# the ten digits as they appear inside a number are the last ten tokens.
_LEADING = "9"


class TokenizerLike(Protocol):
    name_or_path: str

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def _describe(tokenizer: TokenizerLike) -> str:
    return f"{type(tokenizer).__name__}({getattr(tokenizer, 'name_or_path', '') or 'unnamed'!r})"


def _refuse(tokenizer: TokenizerLike, problem: str) -> ValueError:
    return ValueError(
        f"Tokenizer {_describe(tokenizer)} cannot be used with NTIL: {problem}. NTIL needs a tokenizer "
        "that writes every number with one single-character token per digit ('0'..'9'), such as "
        "LLaMA-2, Mistral or Qwen2. Tokenizers that group 1-3 digits per token (LLaMA-3, DeepSeek) are "
        "a planned extension and are not supported yet; train with plain cross-entropy "
        "(ntil_lambda=0) or choose a digit-splitting tokenizer."
    )


def _content_ids(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of `text` without special tokens and without leading whitespace-only tokens ('▁')."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while ids and tokenizer.decode([ids[0]]).strip() == "":
        ids.pop(0)
    return ids


def digit_token_ids_from_tokenizer(tokenizer: TokenizerLike) -> list[int]:
    """The token ids of '0'..'9' (in that order) as they appear inside numbers.

    Checks that the tokenizer spells "1234567" and "3.015" one digit per token with exactly these
    ids; otherwise raises a ValueError naming the tokenizer and explaining why.
    """
    ids = _content_ids(tokenizer, _LEADING + DIGITS)
    if len(ids) < len(DIGITS) or [tokenizer.decode([i]).strip() for i in ids[-10:]] != list(DIGITS):
        pieces = [tokenizer.decode([i]) for i in ids]
        raise _refuse(tokenizer, f"'{_LEADING + DIGITS}' is tokenized as {pieces}, not one token per digit")
    digit_ids = ids[-10:]
    if len(set(digit_ids)) != 10:
        raise _refuse(tokenizer, f"the digits map to repeated ids {digit_ids}")

    for text in ("1234567", "3.015"):
        content = _content_ids(tokenizer, text)
        pieces = [tokenizer.decode([i]) for i in content]
        digit_tokens = [
            i for i, piece in zip(content, pieces, strict=True) if any(c.isdigit() for c in piece)
        ]
        expected = [digit_ids[int(c)] for c in text if c.isdigit()]
        if digit_tokens != expected:
            raise _refuse(tokenizer, f"it spells {text!r} as {pieces}, not one token per digit")
    return digit_ids


def number_sign_and_point_ids_from_tokenizer(tokenizer: TokenizerLike) -> tuple[int, int]:
    """`(minus_sign_id, decimal_point_id)`: the ids of '-' and '.' as they appear in "-3.015".

    For `NTILLoss(signed_numbers=True, decimal_numbers=True, ...)`. Raises a ValueError if either
    character is not a token of its own there.
    """
    content = _content_ids(tokenizer, "x=-3.015")
    pieces = [tokenizer.decode([i]) for i in content]
    found = {}
    for char in "-.":
        matches = [i for i, piece in zip(content, pieces, strict=True) if piece.strip() == char]
        if not matches:
            raise ValueError(
                f"Tokenizer {_describe(tokenizer)} has no token of its own for {char!r} in 'x=-3.015' "
                f"(got {pieces}); signed/decimal NTIL needs one."
            )
        found[char] = matches[0]
    return found["-"], found["."]


def number_token_ids(tokenizer: TokenizerLike, signed: bool, decimal: bool) -> list[int]:
    """The token ids NTIL reads: '0'..'9', then '-' when it reads signs (``signed``) and '.' when it reads
    decimal points (``decimal``); found and checked as :class:`NTILLoss` finds them. The rows of the
    output head that ``lora.head=number_rows`` trains."""
    ids = digit_token_ids_from_tokenizer(tokenizer)
    if signed or decimal:
        minus_id, point_id = number_sign_and_point_ids_from_tokenizer(tokenizer)
        ids += [minus_id] if signed else []
        ids += [point_id] if decimal else []
    return ids
