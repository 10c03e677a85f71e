"""NTILLoss on CUDA: same numbers as the float64 CPU computation, and no host-device sync, on both
implementations of the vocabulary stage (the Triton kernels, chosen automatically, and the torch tiles).

Skipped without CUDA (tests/conftest.py). Run on a GPU machine with `pytest -q tests/gpu`.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ntil_ds.loss import NTILLoss, vocab_stats

pytestmark = pytest.mark.gpu

DIGITS = [17, 3, 25, 8, 30, 11, 2, 29, 14, 21]
PARTS = ("loss", "ntil", "emd", "rel", "mag", "ce_sum", "num_tokens")
HAVE_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")),
]
GOLDEN = Path(__file__).resolve().parents[1] / "unit" / "loss_golden" / "ntil_reference_cases.json"


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The `kernel` argument of NTILLoss."""
    return request.param


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
def test_cuda_matches_float64_cpu(backend, dtype, rtol, atol):
    loss_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0, kernel=backend)
    logits, labels = random_batch()
    # The CPU reference sees the same rounded inputs the GPU sees.
    rounded = logits.to(dtype).to(torch.float64)
    reference_fn = NTILLoss(DIGITS, gumbel_noise_scale=0.0, kernel="torch")
    reference, reference_grad = forward_backward(reference_fn, rounded, labels)
    out, grad = forward_backward(loss_fn, logits.to(dtype).cuda(), labels.cuda())
    assert grad.dtype == dtype
    for part in PARTS:
        torch.testing.assert_close(
            getattr(out, part).double().cpu(), getattr(reference, part).double(), rtol=rtol, atol=atol
        )
    torch.testing.assert_close(grad.double().cpu(), reference_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("number_stage", ["auto", "eager"])
def test_forward_and_backward_never_sync_with_the_host(backend, number_stage):
    loss_fn = NTILLoss(DIGITS, kernel=backend, number_stage=number_stage)  # noise on: the draw must not sync
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


def test_kernel_is_the_automatic_choice_on_cuda():
    chosen = vocab_stats.kernel_wanted(torch.zeros(2, 3, device="cuda", dtype=torch.bfloat16))
    assert (chosen is not None) == HAVE_TRITON


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_path_on_cuda_across_block_edges(dtype):
    """V = 40,000 spans three 16384-wide forward blocks (two 32768-wide backward ones on sm_80/90/100), the
    last one partial; digits sit on the block edges."""
    from ntil_ds.loss import vocab_kernel

    edge = vocab_kernel.launch_config(torch.device("cuda"), "forward")[0]  # the backward's is 1 or 2 edges
    digits = [edge - 1, edge, 0, 2 * edge - 1, 2 * edge, 39_999, 5, edge + 1, 2 * edge + 1, 100]
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 40_000, (3, 64), generator=generator)
    mask = torch.rand(3, 64, generator=generator) < 0.4
    labels[mask] = torch.tensor(digits)[torch.randint(0, 10, (int(mask.sum()),), generator=generator)]
    labels[torch.rand(3, 64, generator=generator) < 0.3] = -100
    logits = (torch.randn(3, 64, 40_000, generator=generator) * 3).to(dtype).cuda()
    labels = labels.cuda()
    results = {}
    for name in ("torch", "triton"):
        loss_fn = NTILLoss(digits, kernel=name)
        leaf = logits.detach().clone().requires_grad_()
        out = loss_fn(leaf, labels, generator=torch.Generator(device="cuda").manual_seed(1))
        out.loss.backward()
        results[name] = (out, leaf.grad)
    (out, grad), (expected, expected_grad) = results["triton"], results["torch"]
    for part in PARTS:
        torch.testing.assert_close(getattr(out, part), getattr(expected, part), rtol=2e-6, atol=1e-6)
    grad_tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(grad.float(), expected_grad.float(), **grad_tol)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernel_golden_cases_on_cuda():
    for index, case in enumerate(json.loads(GOLDEN.read_text())["cases"]):
        loss_fn = NTILLoss(case["digit_ids"], gumbel_noise_scale=0.0, kernel="triton", **case["hyper"])
        labels = torch.tensor(case["labels"], device="cuda")
        for output_name, grad_name in (("ntil", "grad_ntil"), ("loss", "grad_loss")):
            logits = torch.tensor(case["logits"], dtype=torch.float32, device="cuda", requires_grad=True)
            out = loss_fn(logits, labels)
            getattr(out, output_name).backward()
            expected = torch.tensor(case["expected"][grad_name])
            torch.testing.assert_close(logits.grad.cpu(), expected, rtol=1e-5, atol=1e-6, msg=f"{index}")
        value = torch.tensor(case["expected"]["loss"])
        torch.testing.assert_close(out.loss.cpu(), value, rtol=1e-5, atol=1e-6, msg=f"{index}")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_compiled_number_stage_matches_eager_on_cuda():
    """number_stage="compile" (torch.compile, dynamic shapes) against the eager number stage, with the
    signed/decimal options on, on two batch shapes one after another."""
    options = {"decimal_numbers": True, "decimal_point_id": 5, "signed_numbers": True, "minus_sign_id": 6}
    # One instance per mode for both shapes, as in training (the compiled stage is built once, dynamic).
    loss_fns = {mode: NTILLoss(DIGITS, gumbel_noise_scale=0.0, number_stage=mode, **options)
                for mode in ("eager", "compile")}  # fmt: skip
    for seed, (batch, length) in enumerate([(2, 30), (3, 17)]):
        logits, labels = random_batch(batch, length, 40, seed=seed)
        labels[0, 3], labels[1, 5] = 6, 5
        logits, labels = logits.float().cuda(), labels.cuda()
        results = {}
        for mode, loss_fn in loss_fns.items():
            out, grad = forward_backward(loss_fn, logits, labels)
            results[mode] = (out, grad)
        (out, grad), (expected, expected_grad) = results["compile"], results["eager"]
        for part in PARTS:
            torch.testing.assert_close(getattr(out, part), getattr(expected, part), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def packed_rows(samples, row_length):
    """unpack_index [S, longest] of samples (lists of lengths per row) laid into rows of row_length."""
    starts = []
    for row, lengths in enumerate(samples):
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        starts += [
            (row * row_length + offset, length) for offset, length in zip(offsets, lengths, strict=True)
        ]
    longest = max(length for _, length in starts)
    return torch.tensor(
        [[start + i if i < length else -1 for i in range(longest)] for start, length in starts]
    )


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_triton_number_stage_matches_eager_on_cuda():
    """number_stage="triton" (the default on CUDA) against the torch stage on CUDA: paper mode with noise,
    decimal + signed numbers, packed rows; values and gradients."""
    options = {"decimal_numbers": True, "decimal_point_id": 5, "signed_numbers": True, "minus_sign_id": 6}
    unpack_index = packed_rows([[40, 50], [96], [10, 30, 20]], row_length=96).cuda()
    for name, kwargs, call in [
        ("paper", {}, {}),
        ("options", options, {}),
        ("packed", {}, {"unpack_index": unpack_index}),
    ]:
        logits, labels = random_batch(3, 96, 40, seed=4)
        labels[:, ::9] = 5
        labels[:, 4::11] = 6
        logits, labels = logits.float().cuda(), labels.cuda()
        results = {}
        for stage in ("eager", "triton"):
            leaf = logits.detach().clone().requires_grad_()
            generator = torch.Generator(device="cuda").manual_seed(2)
            out = NTILLoss(DIGITS, number_stage=stage, **kwargs)(leaf, labels, generator=generator, **call)
            out.loss.backward()
            results[stage] = (out, leaf.grad)
        (out, grad), (expected, expected_grad) = results["triton"], results["eager"]
        for part in PARTS:
            torch.testing.assert_close(
                getattr(out, part), getattr(expected, part), rtol=1e-5, atol=1e-6, msg=name
            )
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7, msg=name)


def assert_bitwise_deterministic(loss_fn, logits, labels):
    """Two forward + backward calls with the same noise give the same bits (no atomics anywhere): every
    part and the logits' gradient. Returns the first call's output."""
    runs = []
    for _ in range(2):
        leaf = logits.detach().clone().requires_grad_()
        out = loss_fn(leaf, labels, generator=torch.Generator(device="cuda").manual_seed(3))
        out.loss.backward()
        runs.append((out, leaf.grad))
    for part in PARTS:
        assert torch.equal(getattr(runs[0][0], part), getattr(runs[1][0], part)), part
    assert torch.equal(runs[0][1], runs[1][1])
    return runs[0][0]  # the gradients go with ``runs``: at LLaMA-3's vocabulary 1 GiB each


def gpu_activities(loss_fn, logits, labels) -> list[str]:
    """The names of the GPU activities (kernels, memsets, copies under torch.profiler) of one forward +
    backward."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    leaf = logits.detach().clone().requires_grad_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_fn(leaf, labels).loss.backward()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == DeviceType.CUDA]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_loss_is_bitwise_deterministic_and_within_60_launches_on_cuda(dtype):
    """Two calls with the same noise give the same bits (no atomics anywhere); one call is <= 60 GPU
    activities (kernels, memsets, copies under torch.profiler), the CPU count's bound."""
    loss_fn = NTILLoss(DIGITS, signed_numbers=True, minus_sign_id=6)
    logits, labels = random_batch(8, 512, 1003, seed=5)
    logits, labels = logits.to(dtype).cuda(), labels.cuda()
    assert_bitwise_deterministic(loss_fn, logits, labels)
    launches = len(gpu_activities(loss_fn, logits, labels))
    print(f"{launches} GPU activities per forward + backward ({dtype})")
    assert launches <= 60


LLAMA3_VOCAB = 128_256


def llama3_style_table(max_width: int, vocab: int = LLAMA3_VOCAB, seed: int = 0):
    """A LLaMA-3-style number token table (widths 1..max_width, zero-padded values, ids scattered over the
    vocabulary), a minus sign, a decimal point and some words."""
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    table, used = {}, 0
    for width in range(1, max_width + 1):
        table[width], used = ids[used : used + 10**width], used + 10**width
    return table, ids[used], ids[used + 1], ids[used + 2 : used + 100]


def grouped_labels(table, minus, point, words, batch, length, seed):
    """[batch, length] labels: numbers of 1-9 digits tokenized as `\\p{N}{1,max width}` from the left
    ("12345" -> "123" + "45"), some signed, some with a fraction ("3.015" -> "3" + "." + "015"), words, -100."""
    generator = torch.Generator().manual_seed(seed)
    width = max(table)

    def randint(high):
        return int(torch.randint(0, high, (1,), generator=generator))

    def tokens(digits):
        return [
            table[len(part)][int(part)]
            for part in (digits[i : i + width] for i in range(0, len(digits), width))
        ]

    rows = []
    for _ in range(batch):
        row = []
        while len(row) < length:
            number, kind = tokens(str(randint(10 ** (1 + randint(9))))), randint(5)
            if kind == 0:
                row += [minus, *number]
            elif kind == 1:
                row += [*number, point, *tokens(str(randint(1000)).zfill(1 + randint(3)))]
            elif kind == 2:
                row += [-100] * (1 + randint(3))
            else:
                row += [*number, words[randint(len(words))]]
        rows.append(row[:length])
    return torch.tensor(rows)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("max_width", [2, 3], ids=["widths 1-2", "widths 1-3"])
def test_grouped_loss_is_bitwise_deterministic_and_within_60_launches_on_cuda(max_width):
    """GroupedNTILLoss at LLaMA-3's vocabulary, [8, 512, 128256] bf16, signed + decimal, on its default
    stages (the Triton vocabulary kernels, at 128 lanes for widths 1-2 and 2,048 for widths 1-3, and the
    grouped Triton number kernels): two calls with the same noise give the same bits, each of the five
    forward and backward kernels runs once, and one call is <= 60 GPU activities (38 counted on CPU,
    tests/unit/grouped_kernel_checks.py)."""
    from ntil_ds.loss import GroupedNTILLoss

    table, minus, point, words = llama3_style_table(max_width)
    options = {
        "signed_numbers": True,
        "minus_sign_id": minus,
        "decimal_numbers": True,
        "decimal_point_id": point,
    }
    loss_fn = GroupedNTILLoss(table, **options)
    assert loss_fn.number_stage_for(torch.zeros(1, device="cuda")) == "triton"
    labels = grouped_labels(table, minus, point, words, 8, 512, seed=5).cuda()
    generator = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(8, 512, LLAMA3_VOCAB, device="cuda", generator=generator) * 2).to(torch.bfloat16)
    out = assert_bitwise_deterministic(loss_fn, logits, labels)
    assert out.rel > 0 and out.emd > 0
    names = gpu_activities(loss_fn, logits, labels)
    assert loss_fn.kernel == "auto"
    # vocab_kernel's _forward_kernel and _backward_kernel, grouped_kernel's three: one launch each.
    launches = {"_position_kernel": 1, "_sequence_kernel": 1, "_forward_kernel": 1, "_backward_kernel": 2}
    for kernel, count in launches.items():
        assert sum(kernel in name for name in names) == count, (kernel, names)
    print(f"{len(names)} GPU activities per forward + backward (widths 1-{max_width})")
    assert len(names) <= 60, names
