"""Token ids the loss needs, read from a Hugging Face tokenizer, with the checks that make them safe.

NTIL reads numbers digit by digit (`NTILLoss`: one token per digit, LLaMA-2, Mistral, Qwen2, ...) or
through a number token table (`GroupedNTILLoss`: tokens of 1-3 digits grouped from the left, LLaMA-3 / 4,
GLM-4.xV). `probe_number_tokenization` decides which one a tokenizer is, as loaded, by tokenizing probe
strings and reading the pieces; anything else (groups from the right, mixed widths, digits merged with
letters or spaces) is refused with an explanation rather than trained on silently.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

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
        "LLaMA-2, Mistral or Qwen2. For tokenizers that group 1-3 digits per token from the left (LLaMA-3, "
        "GLM-4.xV) use GroupedNTILLoss with the table of ntil_ds.loss.probe_number_tokenization(tokenizer); "
        "otherwise train with plain cross-entropy (ntil_lambda=0) or choose a digit-splitting tokenizer."
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


def single_character_digit_ids(tokenizer: TokenizerLike) -> list[int]:
    """The ids of the tokens '0'..'9' each written alone, for a tokenizer that does not write numbers with
    them (only cross-entropy trains on such a tokenizer; these are the digits its reported NTIL parts
    read). Raises a ValueError if a digit alone is not one token."""
    ids = []
    for digit in DIGITS:
        content = _content_ids(tokenizer, digit)
        if len(content) != 1 or tokenizer.decode(content).strip() != digit:
            raise ValueError(
                f"Tokenizer {_describe(tokenizer)} has no single token for the digit {digit!r} "
                f"(it writes it as {[tokenizer.decode([i]) for i in content]})."
            )
        ids += content
    return ids


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
                f"(it writes {pieces}; LLaMA-3-style pre-tokenizers merge a sign with the punctuation before "
                "it, as in '=-' and ' -'): signed and decimal NTIL read the sign and the point as tokens of "
                "their own."
            )
        found[char] = matches[0]
    return found["-"], found["."]


def number_token_table_from_tokenizer(tokenizer: TokenizerLike) -> dict[int, list[int]]:
    """``{1: digit ids}`` for a single-digit tokenizer (checked as `digit_token_ids_from_tokenizer` checks
    it), else the grouped table of `probe_number_tokenization` (which refuses unusable tokenizers)."""
    try:
        return {1: digit_token_ids_from_tokenizer(tokenizer)}
    except ValueError as single_digit_error:
        try:
            found = probe_number_tokenization(tokenizer)
        except ValueError as error:
            raise error from single_digit_error
        return found.table


def number_token_ids(tokenizer: TokenizerLike, signed: bool, decimal: bool) -> list[int]:
    """The token ids NTIL reads: '0'..'9' (every number token of the table for a grouped tokenizer: 1,110
    for groups of 1-3), then '-' when it reads signs (``signed``) and '.' when it reads decimal points
    (``decimal``); found and checked as the loss finds them. The rows of the output head that
    ``lora.head=number_rows`` trains."""
    ids = [i for width_ids in number_token_table_from_tokenizer(tokenizer).values() for i in width_ids]
    if signed or decimal:
        minus_id, point_id = number_sign_and_point_ids_from_tokenizer(tokenizer)
        ids += [minus_id] if signed else []
        ids += [point_id] if decimal else []
    return ids


# Probe strings: long and short numbers, a leading-zero group, a year, digits between letters and after a
# space. A grouped-from-the-left tokenizer writes "1234567" as "123" "456" "7"; from the right "1" "234" "567".
PROBES = ("1234567", "12345", "2024", "007", "a12b", "x 12", "3.015")
# The model types whose tokenizer.json may carry the LLaMA-3 digit-grouping regex although the model was
# trained with one digit per token (the list transformers checks before its fix_mistral_regex warning).
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


@dataclass(frozen=True)
class NumberTokenization:
    """What `probe_number_tokenization` found. ``kind``: "single" (one token per digit, for NTILLoss with
    ``digit_ids``) or "grouped" (tokens of 1..``max_width`` digits from the left, for GroupedNTILLoss with
    ``table``: width -> the ids of the values 0..10**width - 1, zero-padded). ``note``: what the user should
    know beyond that (the Mistral regex trap), empty when nothing."""

    kind: Literal["single", "grouped"]
    max_width: int
    digit_ids: list[int]
    table: dict[int, list[int]]
    note: str = ""


def _pieces(tokenizer: TokenizerLike, text: str) -> tuple[list[int], list[str]]:
    ids = _content_ids(tokenizer, text)
    return ids, [tokenizer.decode([i]) for i in ids]


def _model_type_next_to(tokenizer: TokenizerLike) -> str | None:
    """``model_type`` of the config.json in the tokenizer's folder, when it was loaded from one."""
    config = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _mistral_note(tokenizer: TokenizerLike, kind: str) -> str:
    model_type = _model_type_next_to(tokenizer)
    flagged = getattr(tokenizer, "fix_mistral_regex", None) is False  # transformers detected and warned
    if kind != "grouped" or not (flagged or model_type in _MISTRAL_TYPES):
        return ""
    return (
        f"{_describe(tokenizer)} (model_type {model_type!r}) groups digits as loaded, but its tokenizer.json "
        "carries the LLaMA-3 digit-grouping regex of another family: the Mistral model was trained with one "
        "digit per token. Reload it with AutoTokenizer.from_pretrained(..., fix_mistral_regex=True) so that "
        "the loss and the model see the single digits it was trained with; the loss follows the tokenizer "
        "as loaded."
    )


def _unusable(tokenizer: TokenizerLike, found: str) -> ValueError:
    return ValueError(
        f"Tokenizer {_describe(tokenizer)} cannot be used with NTIL: {found}. NTIL reads numbers from tokens "
        "that hold one digit each, or 1-3 digits grouped from the left (\\p{N}{1,3}, as LLaMA-3 and GLM-4.xV "
        "write them); groups from the right, mixed widths and digits merged with letters or spaces have no "
        "place value the loss can read. Train with plain cross-entropy (loss.name=ce), or use the tokenizer's "
        "digit-splitting variant if it has one (for a Mistral-family tokenizer.json: fix_mistral_regex=True)."
    )


def _group_width(tokenizer: TokenizerLike) -> int:
    """The m of "groups of m digits from the left" that every probe shows (1 = single digits)."""
    widths = {}
    for text in PROBES:
        _, pieces = _pieces(tokenizer, text)
        found = f"it splits {text!r} into {pieces}"
        runs, current = [], []
        for piece in pieces:
            if any(c.isdigit() for c in piece):
                if not piece.isdigit() or not piece.isascii():
                    raise _unusable(tokenizer, found + ": digits merged with letters, spaces or signs")
                current.append(len(piece))
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        numbers = [len(n) for n in re.findall(r"[0-9]+", text)]
        if [sum(run) for run in runs] != numbers:
            raise _unusable(tokenizer, found + ": the digit pieces do not spell the numbers")
        widths[text] = (runs, found)
    width = max(widths["1234567"][0][0])
    for runs, found in widths.values():
        for run in runs:
            expected = [width] * (sum(run) // width) + ([sum(run) % width] if sum(run) % width else [])
            if run != expected:
                order = "from the right" if run == expected[::-1] else "in mixed widths"
                raise _unusable(
                    tokenizer, f"{found}: digits grouped {order}, not in groups of {width} from the left"
                )
    if width > 3:
        raise _unusable(tokenizer, f"{widths['1234567'][1]}: groups of {width} digits (NTIL reads at most 3)")
    return width


def probe_number_tokenization(tokenizer: TokenizerLike) -> NumberTokenization:
    """How this tokenizer, as loaded, writes numbers: single digits or groups of 1-3 from the left (with
    the table of its number tokens), decided by tokenizing `PROBES` and reading the pieces. Raises a
    ValueError saying what it found for anything else. A Mistral-family tokenizer whose tokenizer.json
    carries the LLaMA-3 regex is reported as grouped (it is, as loaded) with a ``note`` (also warned)."""
    width = _group_width(tokenizer)
    if width == 1:
        digit_ids = digit_token_ids_from_tokenizer(tokenizer)
        return NumberTokenization("single", 1, digit_ids, {1: digit_ids})
    table = {}
    for w in range(1, width + 1):
        ids = []
        for value in range(10**w):
            text = f"{value:0{w}d}"
            content, pieces = _pieces(tokenizer, text)
            if pieces != [text]:
                raise _unusable(tokenizer, f"it groups digits by {width} but writes {text!r} as {pieces}")
            ids.append(content[0])
        table[w] = ids
    all_ids = [i for ids in table.values() for i in ids]
    if len(set(all_ids)) != len(all_ids):
        raise _unusable(tokenizer, "two different digit strings map to the same token id")
    for text in PROBES:  # inside numbers, the same ids as the digit strings alone
        ids, pieces = _pieces(tokenizer, text)
        numbers = [(i, p) for i, p in zip(ids, pieces, strict=True) if p.isdigit()]
        if any(table[len(p)][int(p)] != i for i, p in numbers):
            raise _unusable(
                tokenizer, f"in {text!r} its number tokens {pieces} are not the ids of those digits alone"
            )
    note = _mistral_note(tokenizer, "grouped")
    if note:
        warnings.warn(note, stacklevel=2)
    return NumberTokenization("grouped", width, table[1], table, note)
