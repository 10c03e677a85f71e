"""The labelled head (ntil_ds/loss/labelled_head.py) equals the head + vocabulary stage on whole logits.

The reference computes the logits of every row at once (``OutputHead.logits``) and runs
``vocab_stats.position_stats`` on them; the labelled head runs the same rows in chunks and never holds
those logits. Compared: every output, and the gradients of the hidden states, the head weight, its bias
and the row delta, through a loss that uses both the CE and the column logits. fp64 and fp32 to float
rounding; bf16 no further from an fp64 reference than the whole-logits path is. The Triton kernels'
version of the same comparison runs in the interpreter (tests/unit/head_kernel_checks.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntil_ds.loss.labelled_head import OutputHead, chunk_rows_for, labelled_position_stats
from ntil_ds.loss.vocab_stats import position_stats

VOCAB, HIDDEN, ROWS = 301, 24, 37
DIGITS = [0, 7, 150, 151, 299, 300, 64, 65, 128, 200]


def case(dtype: torch.dtype, *, bias: bool, delta: bool, softcap: float | None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64) * 0.5
    tensors = {"hidden": hidden, "weight": weight}
    if bias:
        tensors["bias"] = torch.randn(VOCAB, generator=generator, dtype=torch.float64)
    if delta:
        tensors["delta"] = torch.randn(3, HIDDEN, generator=generator, dtype=torch.float64) * 0.1
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[torch.rand(ROWS, generator=generator) < 0.2] = -1  # no label on some rows
    targets[:5] = torch.tensor(DIGITS[:5])
    upstream = (torch.randn(ROWS, generator=generator), torch.randn(ROWS, len(DIGITS), generator=generator))
    leaves = {k: v.to(dtype).requires_grad_() for k, v in tensors.items()}
    head = OutputHead(
        leaves["weight"],
        leaves.get("bias"),
        (torch.tensor([0, 150, 300]), leaves["delta"]) if delta else None,
        softcap,
    )
    return leaves, head, targets, upstream


def run(leaves, head, targets, upstream, *, labelled: bool, chunk_rows: int = 5):
    columns = torch.tensor(DIGITS)
    payload = torch.arange(ROWS * 2, dtype=torch.float32).reshape(ROWS, 2)
    if labelled:
        out = labelled_position_stats(
            leaves["hidden"], head, targets, columns, payload=payload, kernel="torch", chunk_rows=chunk_rows
        )
    else:
        out = position_stats(head.logits(leaves["hidden"]), targets, columns, payload=payload, kernel="torch")
    ce, cols, row_max, received = out
    loss = (ce * upstream[0].to(ce.dtype)).sum() + (cols * upstream[1].to(cols.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"ce": ce, "columns": cols, "row_max": row_max, "payload": received}, dict(
        zip(leaves, grads, strict=True)
    )


VARIANTS = [
    {"bias": False, "delta": False, "softcap": None},
    {"bias": True, "delta": True, "softcap": None},
    {"bias": False, "delta": True, "softcap": 5.0},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=("plain", "bias+delta", "delta+softcap"))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_the_whole_logits_path(variant, dtype):
    leaves, head, targets, upstream = case(dtype, **variant)
    want_out, want_grad = run(leaves, head, targets, upstream, labelled=False)
    got_out, got_grad = run(leaves, head, targets, upstream, labelled=True)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for name in want_out:
        torch.testing.assert_close(got_out[name], want_out[name], **tol, msg=name)
    for name in want_grad:
        scale = want_grad[name].abs().max()
        error = (got_grad[name] - want_grad[name]).abs().max()
        assert error <= tol["rtol"] * scale + tol["atol"], f"grad of {name}: {error:.3g} of {scale:.3g}"
    assert (got_out["ce"][targets < 0] == 0).all()


def test_bf16_no_further_from_fp64_than_the_whole_logits_path():
    """In bf16 both paths round; the labelled head (fp32 accumulation of the chunks' gradients) is no
    further from the fp64 truth than computing the whole logits in bf16."""
    variant = VARIANTS[1]
    exact_out, exact_grad = run(*case(torch.float64, **variant), labelled=False)

    def errors(labelled: bool) -> dict[str, float]:
        out, grad = run(*case(torch.bfloat16, **variant), labelled=labelled)
        found = {name: (grad[name].double() - exact_grad[name]).abs().max().item() for name in grad}
        return {**found, "ce": (out["ce"].double() - exact_out["ce"]).abs().max().item()}

    whole, labelled = errors(False), errors(True)
    for name, error in labelled.items():
        assert error <= 1.5 * whole[name] + 1e-3, (name, error, whole[name])


def test_chunks_never_hold_the_whole_logits():
    """Any chunking gives the same result; the chunk size bounds the logits held (rows x vocabulary)."""
    leaves, head, targets, upstream = case(torch.float64, **VARIANTS[1])
    results = [run(leaves, head, targets, upstream, labelled=True, chunk_rows=c) for c in (1, 7, ROWS)]
    for out, grad in results[1:]:
        for name in out:
            torch.testing.assert_close(out[name], results[0][0][name], rtol=1e-12, atol=1e-12)
        for name in grad:
            torch.testing.assert_close(grad[name], results[0][1][name], rtol=1e-12, atol=1e-12)
    assert chunk_rows_for(151936) == 883 and chunk_rows_for(10**12) == 1


def test_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    leaves, head, targets, _ = case(torch.float64, **VARIANTS[0])
    leaves["weight"].requires_grad_(False)
    out = labelled_position_stats(leaves["hidden"], head, targets, torch.tensor(DIGITS), kernel="torch")
    out[0].sum().backward()
    assert leaves["weight"].grad is None and leaves["hidden"].grad.abs().sum() > 0


def test_in_the_triton_interpreter():
    pytest.importorskip("triton")
    checks = Path(__file__).with_name("head_kernel_checks.py")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, str(checks)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results and all(value == "ok" for value in results.values()), results
