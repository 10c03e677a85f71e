"""NTILLoss on CUDA: same numbers as the float64 CPU computation, and no host-device sync.

Skipped without CUDA (tests/conftest.py). Run on a GPU machine with `pytest -q tests/gpu`.
"""

import pytest
import torch

from ntil_ds.loss import NTILLoss

pytestmark = pytest.mark.gpu

DIGITS = [17, 3, 25, 8, 30, 11, 2, 29, 14, 21]
PARTS = ("loss", "ntil", "emd", "rel", "mag", "ce_sum", "num_tokens")


def random_batch(batch=4, length=96, vocab=1003, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    digit_mask = torch.rand(batch, length, generator=generator) < 0.4
    labels[digit_mask] = torch.tensor(DIGITS)[
        torch.randint(0, 10, (int(digit_mask.sum()),), generator=generator)
    ]
    labels[torch.rand(batch, length, generator=generator) < 0.3] = -100
    logits = torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2
    return logits, labels


def forward_backward(loss_fn, logits, labels):
    logits = logits.detach().requires_grad_(True)
    out = loss_fn(logits, labels)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 2e-2, 1e-3)])
def test_cuda_matches_float64_cpu(dtype, rtol, atol):
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0)
    logits, labels = random_batch()
    # The CPU reference sees the same rounded inputs the GPU sees.
    rounded = logits.to(dtype).to(torch.float64)
    reference, reference_grad = forward_backward(loss_fn, rounded, labels)
    out, grad = forward_backward(loss_fn, logits.to(dtype).cuda(), labels.cuda())
    assert grad.dtype == dtype
    for part in PARTS:
        torch.testing.assert_close(
            getattr(out, part).double().cpu(), getattr(reference, part).double(), rtol=rtol, atol=atol
        )
    torch.testing.assert_close(grad.double().cpu(), reference_grad, rtol=rtol, atol=atol)


def test_forward_and_backward_never_sync_with_the_host():
    loss_fn = NTILLoss(DIGITS)  # noise on: the Gumbel draw must not sync either
    logits, labels = random_batch()
    logits = logits.float().cuda().requires_grad_(True)
    labels = labels.cuda()
    loss_fn(logits, labels).loss.backward()  # warm-up: first calls may allocate constants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = loss_fn(logits, labels)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss.detach()).all().item()
