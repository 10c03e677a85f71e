"""Digit ids from real (tiny, offline-trained) Hugging Face tokenizers, and the refusal of grouped digits."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer, number_sign_and_point_ids_from_tokenizer

CORPUS = [
    "The total is 1234567 and 3.015 units.",
    "x = -42, y = 2024-05-01",
    "Numbers 12 345 6789 100 1000 3.14",
] * 20


def _tokenizer(individual_digits: bool, name: str) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE ('▁' word marker) trained here, in memory, on a few lines."""
    model = Tokenizer(models.BPE(unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(),
            pre_tokenizers.Digits(individual_digits=individual_digits),
            pre_tokenizers.Punctuation(),
        ]
    )
    model.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["[UNK]", "[PAD]"],
        initial_alphabet=list("0123456789.-"),
        show_progress=False,
    )
    model.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.name_or_path = name
    return tokenizer


def test_digit_splitting_tokenizer_gives_the_ten_digit_ids():
    tokenizer = _tokenizer(individual_digits=True, name="tiny-split-digits")
    ids = digit_token_ids_from_tokenizer(tokenizer)
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids] == list("0123456789")
    assert tokenizer.encode("907", add_special_tokens=False)[-3:] == [ids[9], ids[0], ids[7]]
    minus_id, point_id = number_sign_and_point_ids_from_tokenizer(tokenizer)
    assert tokenizer.convert_ids_to_tokens([minus_id, point_id]) == ["-", "."]
    NTILLoss(
        ids, decimal_numbers=True, decimal_point_id=point_id, signed_numbers=True, minus_sign_id=minus_id
    )


def test_grouping_tokenizer_is_refused_with_a_clear_error():
    tokenizer = _tokenizer(individual_digits=False, name="tiny-grouped-digits")
    assert len(tokenizer.encode("1234567", add_special_tokens=False)) < 7  # it really groups digits
    with pytest.raises(ValueError) as error:
        digit_token_ids_from_tokenizer(tokenizer)
    message = str(error.value)
    assert "tiny-grouped-digits" in message and type(tokenizer).__name__ in message
    assert "one single-character token per digit" in message and "LLaMA-3" in message
