"""probe_number_tokenization on tiny tokenizers built here with the `tokenizers` library (offline): a
LLaMA-3-style `\\p{N}{1,3}` one (grouped), a Qwen-style `\\p{N}` one (single), a Mistral-style folder whose
tokenizer.json carries the LLaMA-3 regex (grouped as loaded, with the fix_mistral_regex note; single once
fixed), and unusable ones (groups from the right, digits merged with letters); the grouped table drives
GroupedNTILLoss."""

import json
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ntil_ds.config import ConfigError
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.tokenizer import digit_token_ids_from_tokenizer, probe_number_tokenization

REST = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = REST.replace("{digits}", r"\p{N}{1,3}")  # LLaMA-3 / 4, GLM-4.xV
QWEN2 = REST.replace("{digits}", r"\p{N}")
FROM_THE_RIGHT = REST.replace("{digits}", r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))")
MERGED = r"[\p{L}\p{N}]+|\s+|[^\s\p{L}\p{N}]+"
ALL_NUMBERS = [f"{v:0{w}d}" for w in (1, 2, 3) for v in range(10**w)]


def _tokenizer(regex: str, name: str, extra=()) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "[PAD]", *string.ascii_letters, " ", ".", "-", "=", ",", *ALL_NUMBERS, *extra]
    model = Tokenizer(
        models.WordLevel({word: i for i, word in enumerate(dict.fromkeys(words))}, unk_token="[UNK]")
    )
    model.pre_tokenizer = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.name_or_path = name
    return tokenizer


def test_llama3_style_tokenizer_is_grouped_with_its_table():
    tokenizer = _tokenizer(LLAMA3, "tiny-llama3")
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024", add_special_tokens=False)] == ["202", "4"]
    found = probe_number_tokenization(tokenizer)
    assert (found.kind, found.max_width, found.note) == ("grouped", 3, "")
    assert sorted(found.table) == [1, 2, 3] and [len(found.table[w]) for w in (1, 2, 3)] == [10, 100, 1000]
    assert tokenizer.convert_ids_to_tokens([found.table[3][7], found.table[2][45], found.table[1][9]]) == [
        "007",
        "45",
        "9",
    ]
    # The table drives the loss: "12345" as "123" "45", predicted exactly, costs nothing.
    labels = torch.tensor([tokenizer.encode("x=12345", add_special_tokens=False)])
    logits = torch.full((1, labels.shape[1], len(tokenizer)), -20.0)
    logits[0, torch.arange(labels.shape[1]), labels[0]] = 20.0
    out = GroupedNTILLoss(found.table, gumbel_noise_scale=0.0)(logits, labels)
    assert out.emd.item() == pytest.approx(0.0, abs=1e-6) and out.rel == 0
    with pytest.raises(ValueError, match="GroupedNTILLoss"):  # the single-digit API points to the grouped one
        digit_token_ids_from_tokenizer(tokenizer)


def test_qwen_style_tokenizer_is_single_digits():
    tokenizer = _tokenizer(QWEN2, "tiny-qwen2")
    found = probe_number_tokenization(tokenizer)
    assert (found.kind, found.max_width) == ("single", 1)
    assert tokenizer.convert_ids_to_tokens(found.digit_ids) == list("0123456789") and found.table == {
        1: found.digit_ids
    }


@pytest.mark.parametrize(
    ("regex", "extra", "message"),
    [
        (FROM_THE_RIGHT, (), r"'1234567' into \['1', '234', '567'\]: digits grouped from the right"),
        (
            MERGED,
            ("1234567", "12345", "2024", "007", "a12b"),
            r"'a12b' into \['a12b'\]: digits merged with letters",
        ),
        (REST.replace("{digits}", r"\p{N}{1,4}"), ("1234", "2024"), "groups of 4 digits"),
    ],
    ids=["from-the-right", "merged-with-letters", "groups-of-4"],
)
def test_unusable_tokenizers_are_refused_saying_what_was_found(regex, extra, message):
    tokenizer = _tokenizer(regex, "tiny-unusable", extra)
    with pytest.raises(ValueError, match=message) as error:
        probe_number_tokenization(tokenizer)
    assert "tiny-unusable" in str(error.value) and "loss.name=ce" in str(error.value)


def test_mistral_style_folder_with_the_llama3_regex_is_grouped_as_loaded_and_says_so(tmp_path):
    """Mistral Small 3.1 / Pixtral ship tokenizer.json with the LLaMA-3 grouping regex although the model
    was trained with one digit per token: judged as loaded (grouped), with the fix named; fixed, single."""
    folder = tmp_path / "mistral3"
    # transformers patches the regex only for vocabularies over 100,000 tokens (real Mistral ones: 131,072).
    _tokenizer(LLAMA3, "tiny-mistral3", [f"<unused{i}>" for i in range(100_000)]).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral3"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with pytest.warns(UserWarning, match="fix_mistral_regex=True"):
        found = probe_number_tokenization(tokenizer)
    assert found.kind == "grouped" and "trained with one digit per token" in found.note
    assert "fix_mistral_regex=True" in found.note and "'mistral3'" in found.note
    fixed = probe_number_tokenization(AutoTokenizer.from_pretrained(folder, fix_mistral_regex=True))
    assert (fixed.kind, fixed.note) == ("single", "")


def test_a_llama3_folder_of_another_family_gets_no_mistral_note(tmp_path):
    folder = tmp_path / "llama"
    _tokenizer(LLAMA3, "tiny-llama").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mllama"}))
    found = probe_number_tokenization(AutoTokenizer.from_pretrained(folder))
    assert (found.kind, found.note) == ("grouped", "")


def test_recipes_build_the_grouped_loss_and_number_rows_for_a_grouped_tokenizer(tmp_path):
    """build_loss: GroupedNTILLoss on the probe's table for a LLaMA-3-style tokenizer, NTILLoss for a
    single-digit one; lora.head=number_rows trains every number token the loss reads (1,110 + '-' '.')."""
    from ntil_ds.config import load_config
    from ntil_ds.loss import NTILLoss, number_token_ids
    from ntil_ds.loss.build import build_loss

    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "data.train_file=x"])
    grouped, single = _tokenizer(LLAMA3, "tiny-llama3"), _tokenizer(QWEN2, "tiny-qwen2")
    loss_fn = build_loss(cfg, grouped)
    assert type(loss_fn) is GroupedNTILLoss
    assert loss_fn.number_token_table.column_ids == number_token_ids(grouped, False, False)
    assert len(number_token_ids(grouped, False, False)) == 1110
    assert type(build_loss(cfg, single)) is NTILLoss and len(number_token_ids(single, False, False)) == 10
    with pytest.raises(ConfigError, match="loss.name=ntil: .*grouped from the right"):
        build_loss(cfg, _tokenizer(FROM_THE_RIGHT, "tiny-right"))


def test_cross_entropy_trains_on_a_tokenizer_ntil_cannot_read_as_the_refusal_advises(caplog):
    """The refusal tells the user to train with loss.name=ce; that recipe builds, its loss is exactly the
    cross-entropy (float64, from the logits directly), and the log says NTIL's parts read single digits."""
    import torch.nn.functional as F

    from ntil_ds.config import load_config
    from ntil_ds.loss.build import build_loss

    tokenizer = _tokenizer(FROM_THE_RIGHT, "tiny-right")
    cfg = load_config(None, ["model.name_or_path=x", "data.train_file=x", "loss.name=ce"])
    with caplog.at_level("WARNING", logger="ntil_ds.loss.build"):
        loss_fn = build_loss(cfg, tokenizer)
    assert "grouped from the right" in caplog.text and "single-character digit labels" in caplog.text
    assert tokenizer.convert_ids_to_tokens(loss_fn.digit_token_ids) == list("0123456789")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, len(tokenizer), generator=generator)
    labels = torch.randint(0, len(tokenizer), (2, 7), generator=generator)
    labels[0, :2] = -100
    expected = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert torch.allclose(loss_fn(logits, labels).loss.double(), expected, rtol=1e-6, atol=1e-7)


def test_signed_numbers_on_a_tokenizer_that_merges_the_sign_are_refused_at_start_with_the_fix():
    """LLaMA-3's pre-tokenizer writes "x=-3" as "x" "=-" "3": no token of its own for the sign. Signed
    NTIL is refused as a config error naming what was found and the setting that works; unsigned, the
    same tokenizer builds the grouped loss."""
    from ntil_ds.config import load_config
    from ntil_ds.loss.build import build_loss

    tokenizer = _tokenizer(LLAMA3, "tiny-llama3-signs", ("=-", " -"))
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x=-3", add_special_tokens=False)] == [
        "x",
        "=-",
        "3",
    ]
    base = ["model.name_or_path=x", "data.train_file=x"]
    with pytest.raises(ConfigError, match=r"no token of its own for '-'.*'=-'.*loss.signed_numbers=false"):
        build_loss(load_config(None, [*base, "loss.signed_numbers=true"]), tokenizer)
    assert type(build_loss(load_config(None, base), tokenizer)) is GroupedNTILLoss
