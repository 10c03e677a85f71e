"""kernel="auto" / number_stage="auto" when Triton cannot run, in a subprocess (run by test_kernel_fallback.py).

    python tests/unit/kernel_fallback_checks.py SCENARIO   # prints one JSON line

"auto" considers the kernels only on CUDA; here `kernel_choice.AUTO_DEVICE_TYPES` also names the CPU, so that
the probe runs on this machine for real. Scenarios:
  launch:  without TRITON_INTERPRET Triton has no driver for the CPU: the probe's launch fails for real.
  compile: under TRITON_INTERPRET=1 the probe kernel is one Triton refuses to compile (tl.arange of a runtime
           bound): Triton's own check raises.
  works:   under TRITON_INTERPRET=1 the probe passes: "auto" runs the kernels (the gate is not always shut).
Reported: the warnings, whether the kernels were called, whether "auto" equals the torch path bit for bit, and
what kernel="triton" / number_stage="triton" raise.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

DIGITS = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
VOCAB, HIDDEN = 40, 8


def batch():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 9, VOCAB, generator=generator) * 3
    labels = torch.randint(0, VOCAB, (2, 9), generator=generator)
    labels[:, ::3] = torch.tensor(DIGITS)[torch.randint(0, 10, (2, 3), generator=generator)]
    labels[0, 1] = -100
    return logits, labels


def loss_and_grad(**options):
    from ntil_ds.loss import NTILLoss

    logits, labels = batch()
    logits.requires_grad_()
    out = NTILLoss(DIGITS, gumbel_noise_scale=0.0, **options)(logits, labels)
    out.loss.backward()
    return [out.loss.detach(), out.ntil.detach(), logits.grad]


def head_and_grad(kernel):
    from ntil_ds.loss.labelled_head import OutputHead, labelled_position_stats

    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(7, HIDDEN, generator=generator).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    targets = torch.randint(0, VOCAB, (7,), generator=generator)
    ce, columns, _, _ = labelled_position_stats(
        hidden, OutputHead(weight), targets, torch.tensor(DIGITS), kernel=kernel
    )
    (ce.sum() + columns.sum()).backward()
    return [ce.detach(), columns.detach(), hidden.grad]


def error_of(call) -> str | None:
    try:
        call()
    except Exception as error:  # what the caller sees: the type and message
        return f"{type(error).__name__}: {error}"
    return None


def main(scenario: str) -> dict:
    from ntil_ds.loss import kernel_choice, number_kernel, triton_probe, vocab_kernel

    kernel_choice.AUTO_DEVICE_TYPES = ("cuda", "cpu")
    if scenario == "compile":
        import triton
        import triton.language as tl

        @triton.jit
        def broken(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.arange(0, n)  # a runtime bound: Triton refuses it
            tl.store(y_ptr + offsets, tl.load(x_ptr + offsets) + 1.0)

        triton_probe._add_one_kernel = broken
    calls = {"vocab": 0, "number": 0}

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)

        setattr(module, name, wrapper)

    counted(vocab_kernel, "forward_full", "vocab")
    counted(number_kernel, "forward", "number")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = [loss_and_grad() for _ in range(2)] + [head_and_grad("auto")]
    auto_calls = dict(calls)
    reference = [loss_and_grad(kernel="torch", number_stage="eager")] * 2 + [head_and_grad("torch")]
    flat = [(a, r) for got, want in zip(auto, reference, strict=True) for a, r in zip(got, want, strict=True)]
    return {
        # kernel_choice's warnings (the interpreter adds numpy's, e.g. log(0) in masked lanes)
        "warnings": [str(w.message) for w in caught if "Triton" in str(w.message)],
        "kernel_calls": auto_calls,
        "auto_equals_torch": all(torch.equal(a, r) for a, r in flat),
        "auto_close_to_torch": all(torch.allclose(a, r, rtol=1e-5, atol=1e-6) for a, r in flat),
        "triton_error": error_of(lambda: loss_and_grad(kernel="triton", number_stage="eager")),
        "number_triton_error": error_of(lambda: loss_and_grad(kernel="torch", number_stage="triton")),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
