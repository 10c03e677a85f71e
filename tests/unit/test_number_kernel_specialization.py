"""The number kernels compile once for every packed shape (issue 35 item 4, review F9).

With packing, the longest sample (`length`) and the positions (`num_positions`, S x longest) change from step
to step. Triton keys its compiled kernels on each int argument's value class (divisible by 16, equal to 1,
other) unless the argument is in `do_not_specialize`: a new class is a new compile (~1 s) inside a step.
Here the kernels' launches for three packed batches go through Triton's own launch-side binder for sm_90
(`create_function_from_signature` with the CUDA backend, what `JITFunction.run` keys its cache on) and the
cache keys are counted: one per kernel. No GPU: the launch itself is recorded, not run."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0", reason="the kernels are interpreted"),
]


class KeyRecorder:
    """Stands in for a `@triton.jit` kernel at its launch `kernel[grid](*args, **options)`: records the key
    of Triton's per-device compile cache that the launch would look up, and launches nothing."""

    def __init__(self, kernel) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        self.keys: set = set()

    def __getitem__(self, grid):
        from triton.runtime.jit import compute_cache_key

        def launch(*args, **options):
            _, specialization, options = self.binder(*args, **options)
            self.keys.add(compute_cache_key({}, specialization, options))

        return launch


def test_packed_shapes_share_one_compiled_kernel_each_way(monkeypatch):
    from ntil_ds.loss import NTILLoss, number_kernel
    from tests.unit.number_kernel_checks import DIGITS, VOCAB, number_batch, packed_rows

    recorders = {
        name: KeyRecorder(getattr(number_kernel, name)) for name in ("_forward_kernel", "_backward_kernel")
    }
    for name, recorder in recorders.items():
        monkeypatch.setattr(number_kernel, name, recorder)
    monkeypatch.setattr(number_kernel, "_check_device", lambda tensor: None)  # CPU tensors: nothing launches
    # Three steps' packing: longest samples of 23, 32 and 47 positions (not divisible by 16, divisible, not),
    # rows of 48, so num_positions 69, 64 and 94.
    steps = [[[23, 20], [9, 14], [5]], [[32, 16], [30]], [[47], [12, 30]]]
    for samples in steps:
        rows = len(samples)
        _, labels = number_batch(rows, 48, seed=len(samples[0]))
        logits = torch.randn(rows, 48, VOCAB, generator=torch.Generator().manual_seed(1)).requires_grad_()
        loss_fn = NTILLoss(DIGITS, kernel="torch", number_stage="triton")
        out = loss_fn(logits, labels, unpack_index=packed_rows(samples, row_length=48))
        out.ntil.sum().backward()  # the recorded backward writes nothing: its values are not looked at
    assert {name: len(recorder.keys) for name, recorder in recorders.items()} == {
        "_forward_kernel": 1,
        "_backward_kernel": 1,
    }
