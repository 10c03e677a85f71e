"""The labelled head on CUDA in bf16, in several chunks: the path the head table's 20 % and 100 % rows and
long answers take, and the CPU suite cannot: each chunk's weight gradient is a bf16 x bf16 product into
fp32 (``torch.mm(..., out_dtype=torch.float32)``, CUDA only; CPU upcasts), on the Triton kernels or the
torch tiles. Against an fp64 CPU reference: no further from it than the whole bf16 logits on CUDA are.

Skipped without CUDA (tests/conftest.py). gpu_check.sh runs it with the other loss tests.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ntil_ds.loss.labelled_head import OutputHead, labelled_position_stats
from ntil_ds.loss.vocab_stats import position_stats

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN, ROWS, CHUNK_ROWS = 1003, 64, 300, 48  # 7 chunks
DIGITS = [0, 7, 150, 151, 299, 300, 64, 65, 128, 200]
KERNELS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) * 0.5
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[torch.rand(ROWS, generator=generator) < 0.2] = -1  # no label on some rows
    targets[:10] = torch.tensor(DIGITS)
    upstream = (torch.randn(ROWS, generator=generator), torch.randn(ROWS, len(DIGITS), generator=generator))
    return hidden, weight, targets, upstream


def run(device, dtype, kernel: str, labelled: bool):
    """CE and digit-column logits of every row, and the gradients of hidden states and head weight
    through a loss that uses both."""
    hidden, weight, targets, upstream = _inputs()
    leaves = [t.to(device, dtype).requires_grad_() for t in (hidden, weight)]
    head = OutputHead(leaves[1])
    columns, targets = torch.tensor(DIGITS, device=device), targets.to(device)
    if labelled:
        out = labelled_position_stats(leaves[0], head, targets, columns, kernel=kernel, chunk_rows=CHUNK_ROWS)
    else:
        out = position_stats(head.logits(leaves[0]), targets, columns, kernel=kernel)
    ce, cols = out[0], out[1]
    up_ce, up_cols = (u.to(device, ce.dtype) for u in upstream)
    loss = (ce * up_ce).sum() + (cols * up_cols.to(cols.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return {"ce": ce, "columns": cols, "grad_hidden": grads[0], "grad_weight": grads[1]}


def errors_against_fp64(device, kernel: str) -> tuple[dict[str, float], dict[str, float]]:
    exact = run(torch.device("cpu"), torch.float64, "torch", labelled=False)

    def errors(labelled: bool) -> dict[str, float]:
        got = run(device, torch.bfloat16, kernel, labelled)
        return {k: (got[k].double().cpu() - exact[k]).abs().max().item() for k in exact}

    return errors(False), errors(True)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_chunked_labelled_head_no_further_from_fp64_than_the_whole_logits_on_cuda(kernel):
    whole, labelled = errors_against_fp64(torch.device("cuda"), kernel)
    for name, error in labelled.items():
        assert error <= 1.5 * whole[name] + 1e-3, (name, error, whole[name])
