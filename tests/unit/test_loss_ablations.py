"""The ablation keys of issue 43 (docs/loss.md "Ablations"), each against the float64 loop reference
(`ntil_ds.loss.reference`): the lambda ramp, the per-sample ratio, the sequence terms alone, EMD alone; and
paper mode unchanged, bit for bit, with the keys at their defaults."""

import pytest
import torch

from ntil_ds.config import ConfigError, load_config
from ntil_ds.jobs import REPO_ROOT
from ntil_ds.loss import GroupedNTILLoss, NTILLoss
from ntil_ds.loss.build import build_loss
from ntil_ds.loss.reference import reference_ntil_loss
from tests.unit.test_loss_tokenizer_probe import LLAMA3, QWEN2, _tokenizer

DIGITS = list(range(10, 20))
FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_mean")


def _batch(seed, batch=4, length=24, vocab=37):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digits = torch.rand(batch, length, generator=generator) < 0.45
    labels[digits] = torch.tensor(DIGITS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[torch.rand(batch, length, generator=generator) < 0.3] = -100
    labels[-1, :] = -100  # a sequence without a label: its per-sample ratio has nothing to rescale
    labels[-2, :] = 5  # one labelled but digit-free: ntil_b = 0
    return torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2, labels


def _check(loss_fn, reference_kwargs, seed, step=None, lambda_at_step=None):
    logits, labels = _batch(seed)
    fast, slow = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = loss_fn(fast, labels, step=step)
    kwargs = (
        dict(reference_kwargs, ntil_lambda=lambda_at_step) if lambda_at_step is not None else reference_kwargs
    )
    expected = reference_ntil_loss(slow, labels, DIGITS, **kwargs)
    for field in FIELDS:
        torch.testing.assert_close(getattr(out, field), expected[field], rtol=1e-10, atol=1e-12)
    out.loss.backward()
    expected["loss"].backward()
    torch.testing.assert_close(fast.grad, slow.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("table", [False, True], ids=["digits", "grouped_width_1"])
def test_lambda_ramp_is_linear_from_zero_over_the_steps(table):
    make = (lambda **k: GroupedNTILLoss({1: DIGITS}, **k)) if table else (lambda **k: NTILLoss(DIGITS, **k))
    ramped = make(ntil_lambda=0.3, ntil_lambda_ramp_steps=8, gumbel_noise_scale=0.0)
    for step, weight in [(0, 0.0), (2, 0.075), (6, 0.225), (8, 0.3), (50, 0.3), (None, 0.3)]:
        assert ramped.lambda_at(step) == pytest.approx(weight, rel=1e-15)
        _check(ramped, {}, seed=step or 1, step=step, lambda_at_step=weight)


def test_per_sample_ratio_against_the_float64_reference():
    for seed in range(3):
        _check(NTILLoss(DIGITS, ntil_ratio="sample", gumbel_noise_scale=0.0), {"ntil_ratio": "sample"}, seed)


def test_per_sample_ratio_of_packed_samples_equals_the_unpacked_rows():
    """Two samples packed in one row (and 4 padding positions) with `unpack_index`: the loss and gradient
    of the same samples as rows side by side."""
    logits, labels = (t[:2] for t in _batch(4, batch=4, length=10))  # rows 0, 1: random, with digits
    labels[0, 0] = 5  # labelled: a padding position must not read it (flat position 0)
    packed_logits = torch.cat([logits.reshape(1, 20, -1), logits[:1, :4]], dim=1).clone().requires_grad_()
    packed_labels = torch.cat([labels.reshape(1, 20), torch.full((1, 4), -100)], dim=1)
    index = torch.cat([torch.arange(20).view(2, 10), torch.full((2, 2), -1)], dim=1)
    rows = logits.clone().requires_grad_()
    loss_fn = NTILLoss(DIGITS, ntil_ratio="sample", gumbel_noise_scale=0.0)
    packed = loss_fn(packed_logits, packed_labels, unpack_index=index)
    unpacked = loss_fn(rows, labels)
    torch.testing.assert_close(packed.loss, unpacked.loss, rtol=1e-12, atol=0)
    packed.loss.backward(), unpacked.loss.backward()
    torch.testing.assert_close(packed_logits.grad[:, :20].reshape_as(rows), rows.grad, rtol=1e-10, atol=1e-14)


def test_the_sequence_terms_alone_and_emd_alone_are_weights_of_zero():
    """Sequence terms alone: digit_alpha=0; EMD alone: abs_alpha = mag_alpha = 0 (loss.name=emd)."""
    for seed in range(2):
        _check(NTILLoss(DIGITS, digit_alpha=0.0, gumbel_noise_scale=0.0), {"digit_alpha": 0.0}, seed)
        emd = {"abs_alpha": 0.0, "mag_alpha": 0.0}
        _check(NTILLoss(DIGITS, **emd), emd, seed)  # no Gumbel noise is drawn without REL / MAG


def test_paper_mode_is_unchanged_bit_for_bit_with_the_keys_at_their_defaults():
    logits, labels = _batch(7)
    results = []
    for kwargs, step in [({}, None), ({"ntil_lambda_ramp_steps": 0, "ntil_ratio": "batch"}, 123)]:
        leaf = logits.float().clone().requires_grad_()
        out = NTILLoss(DIGITS, **kwargs)(leaf, labels, generator=torch.Generator().manual_seed(3), step=step)
        out.loss.backward()
        results.append((out.loss, leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_recipe_keys_reach_the_loss_and_bad_ones_stop_at_start():
    recipe = REPO_ROOT / "configs" / "train" / "tiny_qwen2_arithmetic.yaml"
    base = ["model.name_or_path=x", "data.train_file=x", "train.max_steps=100"]
    cfg = load_config(recipe, [*base, "loss.ntil_lambda_ramp_steps=50", "loss.ntil_ratio=sample"])
    assert (cfg.loss.ntil_lambda_ramp_steps, cfg.loss.ntil_ratio) == (50, "sample")
    for tokenizer in (_tokenizer(QWEN2, "tiny-qwen2"), _tokenizer(LLAMA3, "tiny-llama3")):  # NTIL, grouped
        loss_fn = build_loss(cfg, tokenizer)
        assert (loss_fn.ntil_lambda_ramp_steps, loss_fn.ntil_ratio) == (50, "sample")
    with pytest.raises(ConfigError, match="loss.name=ce trains none"):
        load_config(recipe, [*base, "loss.name=ce", "loss.ntil_lambda_ramp_steps=5"])
    with pytest.raises(ConfigError, match="loss.name=ntl trains none"):
        load_config(recipe, [*base, "loss.name=ntl", "loss.ntil_ratio=sample"])
    with pytest.raises(ConfigError, match="exceeds train.max_steps=100"):
        load_config(recipe, [*base, "loss.ntil_lambda_ramp_steps=101"])
    with pytest.raises(ConfigError, match="ntil_ratio"):
        load_config(recipe, [*base, "loss.ntil_ratio=token"])
    with pytest.raises(ValueError, match="ntil_lambda_ramp_steps must be an integer >= 0"):
        NTILLoss(DIGITS, ntil_lambda_ramp_steps=-1)
