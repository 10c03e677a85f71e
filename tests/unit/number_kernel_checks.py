"""Checks of the Triton number stage (ntil_ds/loss/number_kernel.py) in Triton's interpreter, and the launch
count of the whole loss in its CUDA-default configuration.

Not collected by pytest: tests/unit/test_number_kernel.py runs this file in a subprocess with
TRITON_INTERPRET=1 (set before the kernels are defined, kept out of other tests) and reports each check as
its own test. The checks compare number_stage="triton" with the torch stage (number_stage="eager") on the
same inputs, values and gradients, in every mode, or with the golden cases of the authors' code. Blocks
are shrunk so that numbers cross block edges.

    TRITON_INTERPRET=1 python tests/unit/number_kernel_checks.py [CHECK ...]   # prints one JSON line
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "loss_golden" / "ntil_reference_cases.json"
FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_sum", "num_tokens")
DIGITS = [17, 3, 25, 8, 30, 11, 2, 29, 14, 21]  # unsorted, like LLaMA-2's
POINT, MINUS, VOCAB = 5, 6, 40
OPTIONS = {"decimal_numbers": True, "decimal_point_id": POINT, "signed_numbers": True, "minus_sign_id": MINUS}
# Values: the kernels' exp/log/softmax differ from torch's in the last float32 bits, sums run in another
# order. Gradients: the same, through the rescale CE / NTIL.
VALUE_TOL = {"rtol": 2e-6, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}
LAUNCH_LIMIT = 60
ZERO_FILLS = ("zeros", "zeros_like", "new_zeros", "fill_", "zero_")


def small_blocks(forward=8, backward=16):
    from ntil_ds.loss import number_kernel

    number_kernel.FORWARD_BLOCK, number_kernel.BACKWARD_BLOCK = forward, backward


def number_batch(batch, length, *, seed, digit_share=0.55, ignored_share=0.2, signs=True):
    """Labels with long and short runs, points and minus signs between them; logits with some confident
    digits (so that predicted numbers sometimes equal the targets) and ties of the top digit."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (batch, length), generator=generator)
    digit_mask = torch.rand(batch, length, generator=generator) < digit_share
    labels[digit_mask] = torch.tensor(DIGITS)[
        torch.randint(0, 10, (int(digit_mask.sum()),), generator=generator)
    ]
    if signs:
        special = torch.rand(batch, length, generator=generator)
        labels[special < 0.08] = POINT
        labels[(special >= 0.08) & (special < 0.14)] = MINUS
    labels[torch.rand(batch, length, generator=generator) < ignored_share] = -100
    logits = torch.randn(batch, length, VOCAB, generator=generator) * 2
    confident = torch.rand(batch, length, generator=generator) < 0.5
    rows = confident & digit_mask
    logits[rows, labels[rows].clamp(min=0)] += 25.0  # the model predicts the target digit
    logits[torch.rand(batch, length, generator=generator) < 0.2, MINUS] = 40.0  # predicted minus signs
    return logits, labels


# Hand-made rows (target, prediction), one character a position: a digit, '.', '-', a letter (another token),
# '_' (no label). A wrong predicted sign on a right magnitude ("-42" read as " 42", "42" as "-42": X == Y
# with opposite signs, where max's and min's gradient split), a right sign, decimals, a version string,
# dots that join nothing, a number at the very start and one at the very end.
CRAFTED = [
    ("7a-42b7c-5d1.2.3e3.015f.5g__9h12.5.i", "7a 42b7c-5d1.2.4e3.025f.5g__9h12.6.i"),
    ("za42b-7c7..8d-0e999f-x1.0g0.00h31415", "z-42b-7c7..8d-0e989f-x1.0g0.01h31415"),
]


def crafted_batch():
    def token(char):
        return DIGITS[int(char)] if char.isdigit() else {".": POINT, "-": MINUS, "_": -100}.get(char, 0)

    labels = torch.tensor([[token(c) for c in target] for target, _ in CRAFTED])
    logits = torch.randn(*labels.shape, VOCAB, generator=torch.Generator().manual_seed(11)) * 0.1
    for row, (_, predicted) in enumerate(CRAFTED):
        for t, char in enumerate(predicted):
            # The model's prediction, by a margin that keeps the argmax (noise included) and leaves the Gumbel
            # softmax (temperature 0.1) a gradient: a margin of 30 would make it exactly one-hot.
            logits[row, t, max(token(char), 0)] += 0.7
    return logits, labels


def run(loss_fn, logits, labels, output="loss", **call_kwargs):
    leaf = logits.detach().clone().requires_grad_()
    out = loss_fn(leaf, labels, generator=torch.Generator().manual_seed(7), **call_kwargs)
    getattr(out, output).backward()
    return out, leaf.grad


def compare_stages(make_loss, logits, labels, *, outputs=("loss", "ntil"), label="", **call_kwargs):
    """`make_loss(number_stage)` -> NTILLoss; the "triton" stage against the "eager" one."""
    for output in outputs:
        expected, expected_grad = run(make_loss("eager"), logits, labels, output, **call_kwargs)
        got, grad = run(make_loss("triton"), logits, labels, output, **call_kwargs)
        for field in FIELDS:
            torch.testing.assert_close(
                getattr(got, field), getattr(expected, field), **VALUE_TOL, msg=f"{label} {output}: {field}"
            )
        torch.testing.assert_close(grad, expected_grad, **GRAD_TOL, msg=f"{label} gradient of {output}")


def expect_triton_stage(loss_fn, columns_device="cpu"):
    assert loss_fn.number_stage_for(torch.zeros(1, 10, device=columns_device)) == "triton"


# --- the checks ---------------------------------------------------------------------------------


def check_every_mode_matches_the_torch_stage():
    """Paper mode with and without noise, EMD only, decimal, signed, both, a small max_number_digits (long
    runs and fractions past the cap), across block edges, one block, one position."""
    from ntil_ds.loss import NTILLoss

    small_blocks()
    modes = {
        "paper, noise": {},
        "paper, no noise": {"gumbel_noise_scale": 0.0},
        "emd only": {"abs_alpha": 0.0, "mag_alpha": 0.0},
        "decimal": {"decimal_numbers": True, "decimal_point_id": POINT},
        "signed": {"signed_numbers": True, "minus_sign_id": MINUS},
        "decimal + signed": OPTIONS,
        "cap 3, decimal": {"max_number_digits": 3, "digit_exp": 1.5, **OPTIONS},
    }
    shapes = [(3, 37), (1, 5), (4, 1)]  # 5 blocks of 8 (the last partial), one partial block, one position
    for seed, (name, options) in enumerate(modes.items()):
        for batch, length in [*shapes, (len(CRAFTED), None)]:
            if length is None:
                logits, labels = crafted_batch()
            else:
                logits, labels = number_batch(batch, length, seed=seed * 10 + length)
            if name.startswith("cap"):
                twenty_digits = torch.tensor(DIGITS)[torch.arange(20) % 10]
                ten_decimals = torch.tensor([DIGITS[1], POINT] + [DIGITS[7]] * 10)
                labels[0, :20] = twenty_digits[: labels.shape[1]]
                labels[-1, -12:] = ten_decimals[-labels.shape[1] :]
            compare_stages(
                lambda stage, o=options: NTILLoss(DIGITS, kernel="torch", number_stage=stage, **o),
                logits, labels, label=f"{name} {list(labels.shape)}",
            )  # fmt: skip


def check_golden_cases_every_field_and_both_gradients():
    from ntil_ds.loss import NTILLoss

    small_blocks(forward=4, backward=8)
    for index, case in enumerate(json.loads(GOLDEN.read_text())["cases"]):
        loss_fn = NTILLoss(
            case["digit_ids"], gumbel_noise_scale=0.0, kernel="torch", number_stage="triton", **case["hyper"]
        )
        labels = torch.tensor(case["labels"])
        expected = case["expected"]
        for output_name, grad_name in (("ntil", "grad_ntil"), ("loss", "grad_loss")):
            logits = torch.tensor(case["logits"], dtype=torch.float32, requires_grad=True)
            out = loss_fn(logits, labels)
            getattr(out, output_name).backward()
            torch.testing.assert_close(
                logits.grad,
                torch.tensor(expected[grad_name]),
                rtol=1e-5,
                atol=1e-6,
                msg=f"{index}: {grad_name}",
            )
        for field in ("loss", "ntil", "emd", "rel", "mag", "ce_mean"):
            torch.testing.assert_close(
                getattr(out, field),
                torch.tensor(expected[field]),
                rtol=1e-5,
                atol=1e-6,
                msg=f"{index}: {field}",
            )


def packed_rows(samples, row_length):
    """Samples (lists of lengths) laid into rows of row_length: unpack_index [S, max length], -1 past ends."""
    index, starts = [], []
    for row, lengths in enumerate(samples):
        offset = 0
        for length in lengths:
            starts.append((row * row_length + offset, length))
            offset += length
        assert offset <= row_length
    longest = max(length for _, length in starts)
    for start, length in starts:
        index.append([start + i if i < length else -1 for i in range(longest)])
    return torch.tensor(index)


def check_packed_rows_with_unpack_index():
    """Three rows holding five samples and padding: per-sample numbers, and no gradient at the padding."""
    from ntil_ds.loss import NTILLoss

    small_blocks()
    unpack_index = packed_rows(PACKED, row_length=24)
    logits, labels = number_batch(3, 24, seed=3)
    for name, options in {"paper": {}, "decimal + signed": OPTIONS}.items():
        compare_stages(
            lambda stage, o=options: NTILLoss(DIGITS, kernel="torch", number_stage=stage, **o),
            logits, labels, label=f"packed, {name}", unpack_index=unpack_index,
        )  # fmt: skip
    out, grad = run(
        NTILLoss(DIGITS, number_stage="triton"), logits, labels, "ntil", unpack_index=unpack_index
    )
    covered = torch.zeros(3 * 24, dtype=torch.bool)
    covered[unpack_index[unpack_index >= 0]] = True
    assert torch.count_nonzero(grad.view(72, VOCAB)[~covered]) == 0, "gradient outside every sample"
    assert out.ntil.item() > 0


def check_edge_batches():
    """No labelled token, digit-free sequences next to others, lambda = 0 (no gradient through NTIL)."""
    from ntil_ds.loss import NTILLoss

    small_blocks()
    logits, labels = number_batch(3, 20, seed=4)
    labels[1] = torch.where(torch.isin(labels[1], torch.tensor(DIGITS)), 0, labels[1])  # digit-free
    compare_stages(
        lambda stage: NTILLoss(DIGITS, number_stage=stage, **OPTIONS), logits, labels, label="digit-free"
    )
    for name, options in {"lambda 0": {"ntil_lambda": 0.0}, "all ignored": {}}.items():
        batch_labels = torch.full_like(labels, -100) if name == "all ignored" else labels
        compare_stages(
            lambda stage, o=options: NTILLoss(DIGITS, number_stage=stage, **o), logits, batch_labels,
            outputs=("loss_sum",), label=name,
        )  # fmt: skip
    out, grad = run(
        NTILLoss(DIGITS, number_stage="triton"), logits, torch.full_like(labels, -100), "loss_sum"
    )
    assert out.loss.item() == 0.0 and torch.count_nonzero(grad) == 0
    out = NTILLoss(DIGITS, ntil_lambda=0.0, number_stage="triton")(logits.requires_grad_(), labels)
    assert not out.ntil.requires_grad and out.ntil.item() > 0


def check_gradients_of_each_part():
    """Backward from emd, rel or mag alone (the kernel gets no ntil gradient), and from ntil alone."""
    from ntil_ds.loss import NTILLoss

    small_blocks()
    logits, labels = number_batch(2, 30, seed=5)
    compare_stages(
        lambda stage: NTILLoss(DIGITS, number_stage=stage, **OPTIONS), logits, labels,
        outputs=("emd", "rel", "mag", "ntil"), label="parts",
    )  # fmt: skip


def check_the_kernel_stage_is_chosen():
    """number_stage="triton" reaches the forward kernel's wrapper, "eager" does not (so the comparisons
    above compare two implementations, not the torch stage with itself)."""
    from ntil_ds.loss import NTILLoss, number_kernel

    assert number_kernel._interpreting()
    expect_triton_stage(NTILLoss(DIGITS, number_stage="triton"))
    calls = []
    original = number_kernel.forward
    number_kernel.forward = lambda *args: calls.append(1) or original(*args)
    try:
        NTILLoss(DIGITS, number_stage="triton")(*number_batch(1, 6, seed=6))
        NTILLoss(DIGITS, number_stage="eager")(*number_batch(1, 6, seed=6))
    finally:
        number_kernel.forward = original
    assert calls == [1], calls


# --- launch count --------------------------------------------------------------------------------


def count_launches(loss_fn, logits, labels, **call_kwargs) -> dict:
    """Device launches of one forward + backward, counted on CPU: aten ops seen by a TorchDispatchMode
    (views, allocations and Python numbers wrapped as host tensors launch nothing, and the interpreter's
    own tensor copies inside a launch are not the loss's) plus Triton launches through the interpreter."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    no_launch = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "scalar_tensor"}
    ops = collections.Counter()
    state = {"in_triton": False, "triton": 0}
    kernels = collections.Counter()  # module.name of each Triton kernel launched in the counted call

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name().split("::")[1].split(".")[0]
            if not (func.is_view or name in no_launch or state["in_triton"]):
                ops[func.name()] += 1
            return func(*args, **(kwargs or {}))

    original = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        state["triton"] += 1
        kernels[f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__name__}"] += 1
        state["in_triton"] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            state["in_triton"] = False

    leaf = logits.detach().clone().requires_grad_()
    loss_fn(leaf, labels, **call_kwargs).loss.backward()  # warm-up: constants are made once per device
    leaf.grad = None
    InterpretedFunction.run = counted_run
    try:
        with CountOps():
            loss_fn(leaf, labels, generator=torch.Generator().manual_seed(0), **call_kwargs).loss.backward()
    finally:
        InterpretedFunction.run = original
    return {"aten": sum(ops.values()), "triton": state["triton"], "total": sum(ops.values()) + state["triton"],
            "ops": dict(ops.most_common()), "kernels": dict(sorted(kernels.items()))}  # fmt: skip


PACKED = [[9, 14], [23], [4, 6, 11]]  # three rows of 24 positions holding five samples and some padding


def check_launches_per_forward_and_backward():
    """The CUDA-default configuration (Triton vocabulary and number stages, noise on) stays <= 60 launches
    whatever the shape and mode; the torch number stage (number_stage="eager") is counted for comparison."""
    from ntil_ds.loss import NTILLoss

    small_blocks(64, 128)
    # The reference shape (where the torch stage is counted too), then other shapes and modes: the
    # count must not depend on them. Small vocabularies elsewhere: the interpreter runs every row in Python.
    cases = {
        "[2, 64, 512]": ((2, 64, 512), {}, None, ("triton", "eager")),
        "[5, 41, 64]": ((5, 41, 64), {}, None, ("triton",)),
        "[2, 64, 512] decimal + signed": ((2, 64, 512), OPTIONS, None, ("triton", "eager")),
        "[3, 24, 64] packed": ((3, 24, 64), {}, packed_rows(PACKED, row_length=24), ("triton",)),
    }
    counts = {}
    for name, ((batch, length, vocab), options, unpack_index, stages) in cases.items():
        _, labels = number_batch(batch, length, seed=8)
        logits = torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(9))
        for stage in stages:
            loss_fn = NTILLoss(DIGITS, kernel="triton", number_stage=stage, **options)
            counts[f"{name}, number_stage={stage}"] = count_launches(
                loss_fn, logits, labels, unpack_index=unpack_index
            )
    for name, count in counts.items():
        if "triton" in name:
            assert count["total"] <= LAUNCH_LIMIT, f"{name}: {count}"
            assert count["triton"] == 4, f"{name}: {count}"  # vocabulary + number stage, each way
            # No zero gradient is materialized for outputs without one (set_materialize_grads(False));
            # packed rows zero the column gradient once (positions outside every sample).
            fills = sum(n for op, n in count["ops"].items() if op.split("::")[1].startswith(ZERO_FILLS))
            assert fills == ("packed" in name), f"{name}: {fills} zero fills in {count['ops']}"
    return counts


CHECKS = {name: value for name, value in globals().items() if name.startswith("check_")}


def main(names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run on CPU tensors only under the interpreter)")
    torch.set_num_threads(1)
    results = {}
    for name in names or list(CHECKS):
        try:
            info = CHECKS[name]()
            results[name] = {"status": "ok", "info": info}
        except Exception:
            results[name] = {"status": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
