"""loss.name=ntl: cross-entropy + the ntloss package's Wasserstein number token loss, against a
hand-written reference of that loss, normalised like the trainer's other losses, and its refusals."""

import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from ntil_ds.config import load_config
from ntil_ds.loss import digit_token_ids_from_tokenizer
from ntil_ds.loss.build import build_loss
from ntil_ds.loss.ntl import NTLLoss, NTLUnavailableError
from ntil_ds.tiny import build_tiny_model_folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = build_tiny_model_folder("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))
    return AutoTokenizer.from_pretrained(folder)


def _batch(tokenizer, vocab, seed=0):
    """Logits [3, 7, vocab] and labels with digit runs, words and ignored positions."""
    generator = torch.Generator().manual_seed(seed)
    digits = digit_token_ids_from_tokenizer(tokenizer)
    word = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = torch.tensor(
        [
            [-100, -100, digits[1], digits[2], word, -100, -100],
            [-100, digits[9], digits[0], digits[7], digits[3], word, -100],
            [-100, -100, -100, word, -100, -100, -100],  # no digit
        ]
    )
    logits = torch.randn(3, 7, vocab, generator=generator, requires_grad=True)
    return logits, labels, digits


def _reference(logits, labels, digits, ntl_lambda):
    """CE summed over labelled positions + lambda x sum over digit positions of ntloss's Wasserstein
    NTL with reweighing: m * sum_j p_j |j - d| + 1.01 * 9 * (1 - m), with p the softmax over the ten
    digits and m the full-vocabulary probability mass on them."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.flatten()
    ce_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    ntl_sum = torch.zeros(())
    for row, label in zip(flat_logits, flat_labels.tolist(), strict=True):
        if label not in digits:
            continue
        target = digits.index(label)
        p = row[digits].softmax(-1)
        mass = row.softmax(-1)[digits].sum()
        wasserstein = sum(p[j] * abs(j - target) for j in range(10))
        ntl_sum = ntl_sum + mass * wasserstein + 1.01 * 9 * (1 - mass)
    return ce_sum + ntl_lambda * ntl_sum


def test_ntl_matches_a_hand_written_reference_with_gradients(tokenizer, tmp_path):
    cfg = load_config(
        None, [f"model.name_or_path={tmp_path}", "data.train_file=x", "loss.name=ntl", "loss.ntl_lambda=0.7"]
    )
    loss_fn = build_loss(cfg, tokenizer)
    assert isinstance(loss_fn, NTLLoss)
    vocab = len(tokenizer) + 5  # a model's vocabulary may be larger than its tokenizer's
    logits, labels, digits = _batch(tokenizer, vocab)
    out = loss_fn(logits, labels)
    expected = _reference(logits, labels, digits, 0.7)
    assert out.num_tokens == 9
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, expected / 9, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    # NTIL's parts are reported, like loss.name=ce does
    assert float(out.emd) > 0 and float(out.ntil) > 0


def test_ntl_sums_add_up_over_micro_batches(tokenizer, tmp_path):
    """The trainer divides summed micro-batch losses by the step's label count: sums must add up."""
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "data.train_file=x", "loss.name=ntl"])
    loss_fn = build_loss(cfg, tokenizer)
    logits, labels, _ = _batch(tokenizer, len(tokenizer), seed=1)
    whole = loss_fn(logits, labels).loss_sum
    parts = loss_fn(logits[:1], labels[:1]).loss_sum + loss_fn(logits[1:], labels[1:]).loss_sum
    torch.testing.assert_close(whole, parts, rtol=1e-6, atol=1e-5)


def test_ntl_refuses_vocab_parallel_shards(tokenizer, tmp_path):
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "data.train_file=x", "loss.name=ntl"])
    loss_fn = build_loss(cfg, tokenizer)
    logits, labels, _ = _batch(tokenizer, len(tokenizer))
    with pytest.raises(ValueError, match="cannot run on vocabulary-parallel logit shards"):
        loss_fn(logits[..., :100], labels, vocab_start=100)


def test_ntl_without_the_package_says_how_to_install_it(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ntloss", None)  # what `import ntloss` sees when not installed
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "data.train_file=x", "loss.name=ntl"])
    with pytest.raises(NTLUnavailableError, match=r"pip install ntloss==0\.3\.2"):
        build_loss(cfg, tokenizer)


@pytest.mark.parametrize("digit_level", [True, False])
def test_ntl_on_a_grouping_tokenizer_in_both_ntloss_modes(tmp_path, digit_level):
    """A LLaMA-3-style tokenizer ("123" one token): `loss.ntl_digit_level=true` (ntloss's default) scores
    only the labels "0".."9" (a label "123" gets no NTL term); false scores every number token by its own
    value, "123" -> 123 and "007" -> 7, whatever its place (max distance 999 in the reweighing)."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_folder("llama", tmp_path / "llama"))
    vocab = tokenizer.get_vocab()
    values = {i: float(t) for t, i in vocab.items() if t.isascii() and t.isdigit() and len(t) <= 3}
    if digit_level:
        values = {i: v for i, v in values.items() if len(tokenizer.convert_ids_to_tokens(i)) == 1}
    assert len(values) == (10 if digit_level else 1110)
    ids = sorted(values)
    word = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    labels = torch.tensor([[vocab["123"], vocab["4"], word, -100], [-100, vocab["007"], vocab["9"], word]])
    logits = torch.randn(2, 4, len(tokenizer), generator=torch.Generator().manual_seed(3), requires_grad=True)
    level = str(digit_level).lower()
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tmp_path}",
            "data.train_file=x",
            "loss.name=ntl",
            f"loss.ntl_digit_level={level}",
        ],
    )
    loss_fn = build_loss(cfg, tokenizer)
    out = loss_fn(logits, labels)

    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.flatten()
    expected = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    value = torch.tensor([values[i] for i in ids], dtype=torch.float64)
    max_dist = float(value.max() - value.min())
    scored = 0
    for row, label in zip(flat_logits, flat_labels.tolist(), strict=True):
        if label not in values:
            continue
        scored += 1
        p = row[ids].double().softmax(-1)
        mass = row.double().softmax(-1)[ids].sum()
        term = mass * (p * (value - values[label]).abs()).sum() + 1.01 * max_dist * (1 - mass)
        expected = expected + 0.3 * term.float()
    assert scored == (2 if digit_level else 4)  # "4" and "9"; or also "123" and "007"
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=1e-4)
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-5)
