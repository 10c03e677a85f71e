"""Checks of the Triton loss kernels (ntil_ds/loss/vocab_kernel.py), run on CPU tensors by Triton's interpreter.

Not collected by pytest: tests/unit/test_loss_kernel.py runs this file in a subprocess with
TRITON_INTERPRET=1 (which must be set before the kernels are defined, and must not leak into other tests)
and reports each check as its own test. Every check compares the kernel path (kernel="triton") with
the torch path (kernel="torch") on the same inputs, or with the golden cases of the authors' code. Shapes are small: the interpreter runs each program in Python.

    TRITON_INTERPRET=1 python tests/unit/loss_kernel_checks.py [CHECK ...]   # prints one JSON line
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "loss_golden" / "ntil_reference_cases.json"
FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_sum", "ce_mean")
VOCAB = 1003  # not a multiple of any block
BLOCK = 128  # the kernels' block in these checks: 8 blocks per row, the last one partial
# Digit ids on both sides of block edges, the first and the last column, unsorted.
EDGE_DIGITS = [127, 128, 0, 255, 1002, 256, 383, 384, 511, 640]
MINUS, POINT = 895, 896


def random_batch(batch, length, vocab, digits, *, seed, dtype, digit_share=0.45, ignored_share=0.3):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digit_mask = torch.rand(batch, length, generator=generator) < digit_share
    picks = torch.randint(0, 10, (int(digit_mask.sum()),), generator=generator)
    labels[digit_mask] = torch.tensor(digits)[picks]
    labels[torch.rand(batch, length, generator=generator) < ignored_share] = -100
    logits = (torch.randn(batch, length, vocab, generator=generator) * 3).to(dtype)
    # Large digit logits at some positions so that the digit softmax is not flat.
    return logits, labels


@contextlib.contextmanager
def expect_kernel_call(loss_fn):
    """The forward kernel runs exactly when `loss_fn.kernel` is "triton": the argument reached the
    vocabulary stage (else a comparison of the two choices would compare the torch path with itself)."""
    from ntil_ds.loss import vocab_kernel

    calls = []
    original = vocab_kernel.forward_full
    vocab_kernel.forward_full = lambda *args: calls.append(1) or original(*args)
    try:
        yield
    finally:
        vocab_kernel.forward_full = original
    assert len(calls) == (loss_fn.kernel == "triton"), f"kernel={loss_fn.kernel!r}: {len(calls)} kernel calls"


def run(loss_fn, logits, labels, output="loss", **call_kwargs):
    """(output, gradient of `output` w.r.t. the logits) with `loss_fn`'s kernel choice."""
    leaf = logits.detach().clone().requires_grad_()
    with expect_kernel_call(loss_fn):
        out = loss_fn(leaf, labels, generator=torch.Generator().manual_seed(7), **call_kwargs)
    getattr(out, output).backward()
    return out, leaf.grad


def tolerances(dtype):
    # fp32: the kernels' exp/log and the online sum differ from torch's in the last bits. bf16: the
    # gradient is rounded to bf16 once by both paths; 1 bf16 ulp apart at most (8 significant bits: an
    # ulp is up to 2**-7 of the value, at the bottom of a binade).
    if dtype == torch.float32:
        return {"rtol": 2e-6, "atol": 1e-6}, {"rtol": 1e-5, "atol": 1e-7}
    return {"rtol": 2e-6, "atol": 1e-6}, {"rtol": 2**-7, "atol": 1e-6}


def compare_backends(make_loss, logits, labels, *, outputs=("loss", "ntil"), **call_kwargs):
    """`make_loss(kernel)` -> an NTILLoss with that kernel choice; the triton one against the torch one."""
    value_tol, grad_tol = tolerances(logits.dtype)
    for output in outputs:
        expected, expected_grad = run(make_loss("torch"), logits, labels, output, **call_kwargs)
        out, grad = run(make_loss("triton"), logits, labels, output, **call_kwargs)
        assert grad.dtype == logits.dtype and grad.shape == logits.shape
        for field in FIELDS:
            torch.testing.assert_close(
                getattr(out, field), getattr(expected, field), **value_tol, msg=f"{output}: {field}"
            )
        assert torch.equal(out.num_tokens, expected.num_tokens)
        torch.testing.assert_close(
            grad.float(), expected_grad.float(), **grad_tol, msg=f"gradient of {output}"
        )


def kernel_module(block=BLOCK):
    from ntil_ds.loss import vocab_kernel

    vocab_kernel.MAX_BLOCK = block
    return vocab_kernel


# --- the checks ---------------------------------------------------------------------------------


def check_golden_cases_every_field_and_both_gradients():
    from ntil_ds.loss import NTILLoss

    kernel_module(block=16)  # golden vocabularies are 24-59 wide: 2-4 blocks
    cases = json.loads(GOLDEN.read_text())["cases"]
    for index, case in enumerate(cases):
        loss_fn = NTILLoss(case["digit_ids"], gumbel_noise_scale=0.0, kernel="triton", **case["hyper"])
        labels = torch.tensor(case["labels"])
        expected = case["expected"]
        for output_name, grad_name in (("ntil", "grad_ntil"), ("loss", "grad_loss")):
            logits = torch.tensor(case["logits"], dtype=torch.float32, requires_grad=True)
            with expect_kernel_call(loss_fn):
                out = loss_fn(logits, labels)
            getattr(out, output_name).backward()
            torch.testing.assert_close(
                logits.grad, torch.tensor(expected[grad_name]), rtol=1e-5, atol=1e-6,
                msg=f"case {index}: {grad_name}",
            )  # fmt: skip
        for field in ("loss", "ntil", "emd", "rel", "mag", "ce_mean"):
            torch.testing.assert_close(
                getattr(out, field), torch.tensor(expected[field]), rtol=1e-5, atol=1e-6,
                msg=f"case {index}: {field}",
            )  # fmt: skip


def _check_random(dtype):
    from ntil_ds.loss import NTILLoss

    kernel_module()
    logits, labels = random_batch(2, 14, VOCAB, EDGE_DIGITS, seed=1, dtype=dtype)
    labels[1, :4] = -100  # a run of ignored rows
    compare_backends(lambda kernel: NTILLoss(EDGE_DIGITS, kernel=kernel), logits, labels)  # Gumbel noise on


def check_fp32_matches_torch_path_digits_at_block_edges():
    _check_random(torch.float32)


def check_bf16_matches_torch_path_digits_at_block_edges():
    _check_random(torch.bfloat16)


def check_fp16_and_one_block_rows():
    from ntil_ds.loss import NTILLoss

    kernel_module(block=16384)  # the default: V = 1003 fits one masked block
    logits, labels = random_batch(1, 12, VOCAB, EDGE_DIGITS, seed=2, dtype=torch.float16)
    compare_backends(
        lambda kernel: NTILLoss(EDGE_DIGITS, gumbel_noise_scale=0.0, kernel=kernel), logits, labels,
        outputs=("loss",),
    )  # fmt: skip


def check_signed_and_decimal_options_eleven_columns():
    from ntil_ds.loss import NTILLoss

    kernel_module()
    logits, labels = random_batch(2, 12, VOCAB, EDGE_DIGITS, seed=3, dtype=torch.float32)
    labels[0, 2], labels[0, 6], labels[1, 3] = MINUS, POINT, MINUS
    logits[0, 1, MINUS] = 30.0  # the model predicts a minus sign before a run
    options = {
        "signed_numbers": True,
        "minus_sign_id": MINUS,
        "decimal_numbers": True,
        "decimal_point_id": POINT,
    }
    compare_backends(lambda kernel: NTILLoss(EDGE_DIGITS, kernel=kernel, **options), logits, labels)


def check_all_ignored_rows_give_zero_loss_and_zero_gradient():
    from ntil_ds.loss import NTILLoss

    kernel_module()
    logits, labels = random_batch(2, 6, VOCAB, EDGE_DIGITS, seed=4, dtype=torch.bfloat16)
    labels[:] = -100
    out, grad = run(NTILLoss(EDGE_DIGITS, kernel="triton"), logits, labels, "loss_sum")
    assert out.loss.item() == 0.0 and out.num_tokens.item() == 0
    assert torch.count_nonzero(grad) == 0 and grad.dtype == torch.bfloat16


def check_label_outside_the_vocabulary_gives_nan():
    from ntil_ds.loss import NTILLoss

    kernel_module()
    loss_fn = NTILLoss(EDGE_DIGITS, kernel="triton")
    # each on its own: an id past the vocabulary, and a negative id that is not ignore_index
    for bad in (VOCAB + 5, -7):
        labels = torch.tensor([[1, bad, 2, -100]])
        with expect_kernel_call(loss_fn):
            out = loss_fn(torch.randn(1, 4, VOCAB), labels)
        assert torch.isnan(out.loss).item(), bad


def check_position_stats_outputs_repeated_columns_and_partial_gradients():
    """The stage-1 function itself: every output, repeated column ids, only-CE and only-column gradients,
    non-contiguous rows."""
    from ntil_ds.loss.vocab_stats import position_stats

    kernel_module()
    generator = torch.Generator().manual_seed(5)
    wide = torch.randn(9, VOCAB + 17, generator=generator) * 4
    logits = wide[:, 5 : 5 + VOCAB]  # a strided view: rows are not contiguous in memory
    targets = torch.tensor([0, 127, 128, 1002, -1, 640, 5, -1, 384])
    column_ids = torch.tensor([128, 3, 128, 1002, 0, 127, 700, 255, 256, 511, 895])  # 128 twice
    payload = torch.randn(9, 4, generator=generator)
    grad_ce = torch.randn(9, generator=generator)
    grad_columns = torch.randn(9, 11, generator=generator)
    results = {}
    for name in ("torch", "triton"):
        leaf = logits.detach().clone().requires_grad_()
        ce, columns, row_max, payload_out = position_stats(
            leaf, targets, column_ids, payload=payload, kernel=name
        )
        grads = [
            torch.autograd.grad(ce, leaf, grad_ce, retain_graph=True)[0],
            torch.autograd.grad(columns, leaf, grad_columns, retain_graph=True)[0],
            torch.autograd.grad((ce, columns), leaf, (grad_ce, grad_columns))[0],
        ]
        results[name] = (ce, columns, row_max, payload_out, *grads)
    names = ("ce", "columns", "row_max", "payload", "grad of ce", "grad of columns", "grad of both")
    for name, got, expected in zip(names, results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, msg=name)
    assert torch.equal(results["triton"][3], payload)


def check_unlabelled_rows_are_not_read_and_get_the_contracts_fills():
    """Rows without a label: NaN logits there reach no output of the kernels (had a row been read, its
    max, log-sum-exp and gradient would be NaN); the fills are the contract's, equal on the torch path
    (which computes those rows on finite logits and fills them), full vocabulary and one shard."""
    from ntil_ds.loss.vocab_stats import position_stats, reduce_rows, row_partials

    kernel = kernel_module()
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(7, VOCAB, generator=generator) * 4
    targets = torch.tensor([3, -100, 127, -1, 1002, 640, -100])
    unlabelled = targets < 0
    column_ids = torch.tensor(EDGE_DIGITS)
    grad_ce, grad_columns = torch.randn(7, generator=generator), torch.randn(7, 10, generator=generator)
    poisoned = logits.clone()
    poisoned[unlabelled] = float("nan")

    ce, columns, row_max, log_sum_exp = kernel.forward_full(poisoned, targets, column_ids)
    assert torch.all(ce[unlabelled] == 0) and torch.all(columns[unlabelled] == 0)
    assert torch.all(row_max[unlabelled] == float("inf")) and torch.all(
        log_sum_exp[unlabelled] == float("-inf")
    )
    grad = kernel.backward(poisoned, targets, log_sum_exp, column_ids, 0, grad_ce, grad_columns)
    assert torch.all(grad[unlabelled] == 0) and torch.isfinite(grad).all()
    local_max, packed = kernel.forward_partials(poisoned[:, 500:], targets, column_ids, 500, 3 + 10)
    assert torch.all(local_max[unlabelled] == 0) and torch.all(packed[unlabelled] == 0)
    # One shard's partials finished as the vocab-parallel path finishes them (AutoTP): the same rows as
    # the torch partials of the finite logits, NaN rules and fills included.
    finished = {
        "triton": reduce_rows(local_max, packed, targets, 10, None, None),
        "torch": reduce_rows(
            *row_partials(logits[:, 500:], targets, column_ids, 500, None), targets, 10, None, None
        ),
    }
    for name, got, expected in zip(
        ("ce", "columns", "row_max"), finished["triton"][:3], finished["torch"][:3], strict=True
    ):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, equal_nan=True, msg=f"shard {name}")

    results = {}
    for name, values in (("torch", logits), ("triton", poisoned)):
        leaf = values.detach().clone().requires_grad_()
        ce, columns, row_max, _ = position_stats(leaf, targets, column_ids, kernel=name)
        (grad,) = torch.autograd.grad((ce, columns), leaf, (grad_ce, grad_columns))
        results[name] = (ce, columns, row_max, grad)
    for name, got, expected in zip(("ce", "columns", "row_max", "grad"), *results.values(), strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, msg=name)
    assert torch.all(results["torch"][2][unlabelled] == float("inf"))


def check_kernels_are_interpreted():
    """The kernels were defined under the interpreter (the wrappers' CPU check asks them; CPU tensors
    without the interpreter are refused: test_loss_kernel.py checks that in pytest's own process)."""
    assert kernel_module()._interpreting()


CHECKS = {name: value for name, value in globals().items() if name.startswith("check_")}


def main(names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run on CPU tensors only under the interpreter)")
    torch.set_num_threads(1)
    results = {}
    for name in names or list(CHECKS):
        try:
            CHECKS[name]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
