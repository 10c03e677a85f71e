"""NTILLoss on one device: golden parity with the authors' code, gradchecks, shapes, dtypes, edge cases."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ntil_ds.loss import NTILLoss
from ntil_ds.loss.reference import reference_ntil_loss
from ntil_ds.loss.vocab_stats import position_stats

# Reference values computed with the paper authors' released implementation (noise off).
GOLDEN = Path(__file__).resolve().parent / "loss_golden" / "ntil_reference_cases.json"
FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_mean")
DIGITS = [17, 3, 25, 8, 30, 11, 2, 29, 14, 21]  # deliberately unsorted, like LLaMA-2's


def _golden_cases():
    return json.loads(GOLDEN.read_text())["cases"]


def _random_batch(batch, length, vocab, *, digit_share=0.4, ignored_share=0.3, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digit_mask = torch.rand(batch, length, generator=generator) < digit_share
    labels[digit_mask] = torch.tensor(DIGITS)[
        torch.randint(0, 10, (int(digit_mask.sum()),), generator=generator)
    ]
    labels[torch.rand(batch, length, generator=generator) < ignored_share] = -100
    logits = torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2
    return logits.to(dtype), labels


@pytest.mark.parametrize("index", range(len(_golden_cases())))
def test_golden_parity_every_field_and_both_gradients(index):
    case = _golden_cases()[index]
    loss_fn = NTILLoss(case["digit_ids"], gumbel_noise_scale=0.0, **case["hyper"])
    labels = torch.tensor(case["labels"])
    expected = case["expected"]
    for output_name, grad_name in (("ntil", "grad_ntil"), ("loss", "grad_loss")):
        logits = torch.tensor(case["logits"], dtype=torch.float32, requires_grad=True)
        out = loss_fn(logits, labels)
        getattr(out, output_name).backward()
        torch.testing.assert_close(logits.grad, torch.tensor(expected[grad_name]), rtol=1e-5, atol=1e-6)
    for field in FIELDS:
        assert getattr(out, field).item() == pytest.approx(expected[field], rel=1e-5, abs=1e-6), field
    assert out.num_tokens.item() == sum(label != -100 for row in case["labels"] for label in row)
    assert out.loss_sum.item() == pytest.approx(out.loss.item() * out.num_tokens.item(), rel=1e-6)


def test_float64_gradcheck_of_cross_entropy_and_column_logits():
    logits, labels = _random_batch(2, 5, 13, seed=1, dtype=torch.float64)
    targets = torch.where(labels == -100, -1, labels % 13).flatten()
    logits = logits.reshape(10, 13).requires_grad_()

    def stats(x):
        ce, columns, _, _ = position_stats(x, targets, torch.tensor([3, 7, 12]))
        return ce, columns

    assert torch.autograd.gradcheck(stats, (logits,), eps=1e-6, atol=1e-7)  # full Jacobian: 130 inputs


def test_float64_gradcheck_of_token_level_term():
    loss_fn = NTILLoss(DIGITS, abs_alpha=0.0, mag_alpha=0.0, digit_exp=1.3)
    logits, labels = _random_batch(2, 6, 32, seed=2, dtype=torch.float64, digit_share=0.7)
    assert torch.isin(labels, torch.tensor(DIGITS)).sum() >= 5  # several runs, several place exponents
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: loss_fn(x, labels).ntil, (logits,), eps=1e-6, atol=1e-7)
    # `loss` itself has a stop-gradient, so finite differences cannot check it: its parts can.
    ce_mean = lambda x: loss_fn(x, labels).ce_mean  # noqa: E731
    assert torch.autograd.gradcheck(ce_mean, (logits,), eps=1e-6, atol=1e-7, fast_mode=True)


def test_ragged_batches_one_after_another_match_the_float64_reference():
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0)
    for seed, (batch, length) in enumerate([(1, 1), (3, 17), (1, 40), (5, 8), (2, 64), (4, 3)]):
        logits, labels = _random_batch(batch, length, 37, seed=seed, dtype=torch.float64)
        fast_input = logits.clone().requires_grad_()
        slow_input = logits.clone().requires_grad_()
        out = loss_fn(fast_input, labels)
        expected = reference_ntil_loss(slow_input, labels, DIGITS)
        for field in FIELDS:
            torch.testing.assert_close(getattr(out, field), expected[field], rtol=1e-10, atol=1e-12)
        out.loss.backward()
        expected["loss"].backward()
        torch.testing.assert_close(fast_input.grad, slow_input.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_compute_in_fp32_and_return_grads_in_their_dtype(dtype):
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0)
    logits, labels = _random_batch(3, 21, 40, seed=3, dtype=dtype)
    half = logits.clone().requires_grad_()
    full = logits.float().requires_grad_()  # the same values, upcast: the fp32 math must agree
    out_half, out_full = loss_fn(half, labels), loss_fn(full, labels)
    out_half.loss.backward()
    out_full.loss.backward()
    assert out_half.loss.dtype == torch.float32 and half.grad.dtype == dtype
    for field in FIELDS:
        torch.testing.assert_close(getattr(out_half, field), getattr(out_full, field), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(half.grad, full.grad.to(dtype), rtol=0, atol=0)


def test_no_labelled_token_gives_zero_loss_and_zero_grads_without_nan():
    loss_fn = NTILLoss(DIGITS)
    logits = torch.randn(2, 6, 40, requires_grad=True)
    out = loss_fn(logits, torch.full((2, 6), -100))
    out.loss_sum.backward()
    for field in (*FIELDS, "ce_sum", "loss_sum"):
        assert getattr(out, field).item() == 0.0, field
    assert out.num_tokens.item() == 0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_digit_free_labels_give_ntil_zero_and_plain_cross_entropy():
    loss_fn = NTILLoss(DIGITS)
    logits = torch.randn(3, 10, 40, requires_grad=True)
    labels = torch.tensor([[v for v in range(40) if v not in DIGITS][:10]] * 3)
    labels[1, 4:] = -100
    out = loss_fn(logits, labels)
    out.loss.backward()
    ce_input = logits.detach().clone().requires_grad_()
    ce = F.cross_entropy(ce_input.reshape(-1, 40), labels.flatten())
    ce.backward()
    assert out.ntil.item() == out.emd.item() == out.rel.item() == out.mag.item() == 0.0
    torch.testing.assert_close(out.loss, ce, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad, ce_input.grad, rtol=1e-5, atol=1e-8)


def test_lambda_zero_is_exactly_cross_entropy_and_still_reports_the_parts():
    logits, labels = _random_batch(2, 30, 40, seed=4)
    logits.requires_grad_()
    out = NTILLoss(DIGITS, ntil_lambda=0.0, gumbel_noise_scale=0.0)(logits, labels)
    with_ntil = NTILLoss(DIGITS, gumbel_noise_scale=0.0)(logits, labels)
    assert torch.equal(out.loss, out.ce_mean)
    for field in ("ntil", "emd", "rel", "mag"):
        assert getattr(out, field).item() == getattr(with_ntil, field).item() > 0
        assert not getattr(out, field).requires_grad
    out.loss.backward()
    expected = torch.autograd.grad(F.cross_entropy(logits.reshape(-1, 40), labels.flatten()), logits)[0]
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-8)


def test_forward_makes_no_host_sync(monkeypatch):
    """`.item()`, `.tolist()` and Python branches on tensor data all go through these methods."""
    loss_fn = NTILLoss(DIGITS, decimal_numbers=True, decimal_point_id=5, signed_numbers=True, minus_sign_id=6)
    logits, labels = _random_batch(3, 25, 40, seed=5)
    logits.requires_grad_()

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync in the loss forward")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = loss_fn(logits, labels, generator=torch.Generator().manual_seed(0))
    monkeypatch.undo()
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and logits.grad is not None


def test_gumbel_noise_comes_from_the_generator():
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=2.0)  # large enough to move some argmaxes
    logits, labels = _random_batch(2, 40, 40, seed=6, digit_share=0.8)
    first = loss_fn(logits, labels, generator=torch.Generator().manual_seed(11))
    again = loss_fn(logits, labels, generator=torch.Generator().manual_seed(11))
    other = loss_fn(logits, labels, generator=torch.Generator().manual_seed(12))
    assert first.rel.item() == again.rel.item() and first.mag.item() == again.mag.item()
    assert (first.rel.item(), first.mag.item()) != (other.rel.item(), other.mag.item())
    assert first.emd.item() == other.emd.item()  # the token level term has no noise


def test_emd_only_configuration_skips_gumbel_and_reports_argmax_rel_mag():
    logits, labels = _random_batch(2, 30, 40, seed=7)
    emd_only = NTILLoss(DIGITS, abs_alpha=0.0, mag_alpha=0.0)(logits, labels)
    paper = NTILLoss(DIGITS, gumbel_noise_scale=0.0)(logits, labels)
    assert emd_only.rel.item() == paper.rel.item() and emd_only.mag.item() == paper.mag.item()
    assert emd_only.ntil.item() == pytest.approx(paper.emd.item(), rel=1e-6)


def test_long_digit_runs_stay_finite():
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0)
    labels = torch.tensor([DIGITS[9]] * 600)[None]  # a 600-digit run: 1.2**599 and 10**599 overflow fp32
    logits = torch.randn(1, 600, 40, requires_grad=True)
    out = loss_fn(logits, labels)
    out.loss.backward()
    assert all(math.isfinite(getattr(out, field).item()) for field in FIELDS)
    assert torch.isfinite(logits.grad).all()


def test_label_outside_the_vocabulary_is_not_silent():
    out = NTILLoss(DIGITS)(torch.randn(1, 3, 40), torch.tensor([[1, 45, 2]]))
    assert math.isnan(out.loss.item())


def _confident_logits(labels, predicted, vocab=40, margin=40.0):
    """Logits whose argmax (and almost all digit-softmax mass) at each position is `predicted`."""
    logits = torch.zeros(1, len(predicted), vocab)
    for t, token in enumerate(predicted):
        logits[0, t, token] = margin
    return logits


def _tokens(text):
    """Digits -> DIGITS ids, '.' -> 5, '-' -> 6, anything else -> 0 (a non-digit filler)."""
    return [DIGITS[int(c)] if c.isdigit() else {".": 5, "-": 6}.get(c, 0) for c in text]


def test_decimal_numbers_hand_computed():
    target, predicted = "a3.015b", "a3.025b"
    labels = torch.tensor([_tokens(target)])
    logits = _confident_logits(labels, _tokens(predicted))
    kwargs = {"gumbel_noise_scale": 0.0, "digit_exp": 1.2}
    decimal = NTILLoss(DIGITS, decimal_numbers=True, decimal_point_id=5, **kwargs)(logits, labels)
    paper = NTILLoss(DIGITS, **kwargs)(logits, labels)
    # Decimal: one number 3.015 vs 3.025; the wrong digit '1'->'2' sits at k = -2.
    assert decimal.emd.item() == pytest.approx(1.2**-2 * 1 / 4, rel=1e-5)
    assert decimal.rel.item() == pytest.approx(0.01 / (3.025 + 1), rel=1e-4)
    assert decimal.mag.item() == pytest.approx(math.log(4.025 / 4.015), rel=1e-4)
    # Paper mode: two numbers, 3 (exact) and 015 vs 025 (k = 1 for the wrong digit).
    assert paper.emd.item() == pytest.approx(1.2**1 * 1 / 4, rel=1e-5)
    assert paper.rel.item() == pytest.approx((0 + 10 / 26) / 2, rel=1e-5)
    assert paper.mag.item() == pytest.approx((0 + math.log(26 / 16)) / 2, rel=1e-5)


def test_decimal_numbers_need_exactly_one_dot_in_the_stretch():
    labels = torch.tensor([_tokens("x1.2.3y")])
    logits = _confident_logits(labels, _tokens("x1.2.4y"))
    kwargs = {"gumbel_noise_scale": 0.0}
    decimal = NTILLoss(DIGITS, decimal_numbers=True, decimal_point_id=5, **kwargs)(logits, labels)
    paper = NTILLoss(DIGITS, **kwargs)(logits, labels)
    for field in FIELDS:  # a version string: three integers in both modes
        assert getattr(decimal, field).item() == getattr(paper, field).item()
    assert paper.rel.item() == pytest.approx((1 / 5) / 3, rel=1e-5)


def test_signed_numbers_hand_computed():
    kwargs = {"gumbel_noise_scale": 0.0, "signed_numbers": True, "minus_sign_id": 6}
    loss_fn = NTILLoss(DIGITS, **kwargs)
    labels = torch.tensor([_tokens("x-42y")])
    # The model predicts the minus too: same as unsigned (exact).
    right_sign = loss_fn(_confident_logits(labels, _tokens("x-42y")), labels)
    assert right_sign.rel.item() == 0.0 and right_sign.mag.item() == pytest.approx(0.0, abs=1e-6)
    # It predicts "x 42": |42 - (-42)| / (42 + 1); magnitudes agree, so mag stays 0.
    wrong_sign = loss_fn(_confident_logits(labels, _tokens("x 42y")), labels)
    assert wrong_sign.rel.item() == pytest.approx(84 / 43, rel=1e-6)
    assert wrong_sign.mag.item() == pytest.approx(0.0, abs=1e-6)
    # Predicted negative, target "-40": |-42 - (-40)| / 43.
    labels_40 = torch.tensor([_tokens("x-40y")])
    both_negative = loss_fn(_confident_logits(labels_40, _tokens("x-42y")), labels_40)
    assert both_negative.rel.item() == pytest.approx(2 / 43, rel=1e-5)
    # "5-3" is a hyphen, not a sign: the target 3 is positive, the prediction 3 too.
    hyphen = torch.tensor([_tokens("5-3")])
    out = loss_fn(_confident_logits(hyphen, _tokens("5-3")), hyphen)
    assert out.rel.item() == 0.0


def test_signed_rel_stays_finite_and_bounded():
    loss_fn = NTILLoss(DIGITS, signed_numbers=True, minus_sign_id=6)
    logits, labels = _random_batch(4, 50, 40, seed=8)
    labels[:, ::7] = 6  # many minus signs
    logits.requires_grad_()
    out = loss_fn(logits, labels, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert 0 <= out.rel.item() < 2 and math.isfinite(out.loss.item()) and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"digit_token_ids": list(range(9))}, "10 integer token ids"),
        ({"digit_token_ids": [1] * 10}, "distinct"),
        ({"digit_token_ids": [-1, *range(1, 10)]}, "non-negative"),
        ({"digit_token_ids": DIGITS, "ntil_lambda": -0.1}, "ntil_lambda"),
        ({"digit_token_ids": DIGITS, "gumbel_tau": 0.0}, "gumbel_tau"),
        ({"digit_token_ids": DIGITS, "abs_alpha": float("nan")}, "abs_alpha"),
        ({"digit_token_ids": DIGITS, "decimal_numbers": True}, "decimal_point_id"),
        ({"digit_token_ids": DIGITS, "signed_numbers": True}, "minus_sign_id"),
        ({"digit_token_ids": DIGITS, "signed_numbers": True, "minus_sign_id": DIGITS[0]}, "not a digit"),
    ],
)
def test_construction_errors_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NTILLoss(**kwargs)


@pytest.mark.parametrize(
    ("logits", "labels", "call_kwargs", "error", "message"),
    [
        (torch.zeros(2, 3, 40), torch.zeros(2, 4, dtype=torch.long), {}, ValueError, "aligned"),
        (torch.zeros(6, 40), torch.zeros(6, dtype=torch.long), {}, ValueError, r"\[B, T, V\]"),
        (torch.zeros(2, 3, 40), torch.zeros(2, 3), {}, TypeError, "integer"),
        (
            torch.zeros(2, 3, 40, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.long),
            {},
            TypeError,
            "float",
        ),
        (torch.zeros(2, 3, 20), torch.zeros(2, 3, dtype=torch.long), {}, ValueError, "outside the logits"),
        (
            torch.zeros(2, 3, 40),
            torch.zeros(2, 3, dtype=torch.long),
            {"vocab_start": 8},
            ValueError,
            "process_group",
        ),
    ],
)
def test_call_errors_say_what_is_wrong(logits, labels, call_kwargs, error, message):
    with pytest.raises(error, match=message):
        NTILLoss(DIGITS)(logits, labels, **call_kwargs)
