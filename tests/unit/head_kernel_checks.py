"""The labelled head on the Triton kernels, in Triton's interpreter (run by test_labelled_head.py).

    TRITON_INTERPRET=1 python tests/unit/head_kernel_checks.py   # prints one JSON line

The same rows through ``labelled_position_stats`` with kernel="triton" and kernel="torch": every output
and the gradients of the hidden states and the head weight, fp32 and bf16, chunks crossing the rows.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

VOCAB, HIDDEN, ROWS = 203, 16, 11
DIGITS = [0, 1, 64, 65, 127, 128, 129, 200, 201, 202]


def compare(dtype: torch.dtype) -> None:
    from ntil_ds.loss import vocab_kernel
    from ntil_ds.loss.labelled_head import OutputHead, labelled_position_stats

    vocab_kernel.MAX_BLOCK = 64  # several blocks per row, the last one partial
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.7).to(dtype)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[[2, 7]] = -1
    upstream = torch.randn(ROWS, generator=generator), torch.randn(ROWS, len(DIGITS), generator=generator)
    results = {}
    for kernel in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ce, columns, row_max, _ = labelled_position_stats(
            h, OutputHead(w), targets, torch.tensor(DIGITS), kernel=kernel, chunk_rows=4
        )
        loss = (ce * upstream[0]).sum() + (columns * upstream[1]).sum()
        loss.backward()
        results[kernel] = (ce, columns, row_max, h.grad.float(), w.grad.float())
    # bf16: the two paths round the logits' gradient differently, one bf16 step of the largest entry
    # (2**-7 of it) apart at most; fp32: float rounding only. Measured against each tensor's scale.
    rtol, atol = (2e-5, 1e-5) if dtype == torch.float32 else (2**-7, 2e-3)
    for name, got, want in zip(("ce", "columns", "row_max", "grad hidden", "grad weight"),
                               results["triton"], results["torch"], strict=True):  # fmt: skip
        got, want = got.float(), want.float()
        # Unlabelled rows' row max is +inf on both paths (the contract's fill), compared exactly.
        assert torch.equal(got.isinf(), want.isinf()), f"{dtype} {name}: infinite at other places"
        finite = want.isfinite()
        error, scale = (got - want)[finite].abs().max().item(), want[finite].abs().max().item()
        assert error <= rtol * scale + atol, f"{dtype} {name}: {error:.3g} of {scale:.3g}"


def check_fp32() -> None:
    compare(torch.float32)


def check_bf16() -> None:
    compare(torch.bfloat16)


CHECKS = {name: value for name, value in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    report = {}
    for name, check in CHECKS.items():
        try:
            check()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc()[-2000:]
    print(json.dumps(report))
