"""GroupedNTILLoss (grouped-digit NTIL, docs/design/ntil_spec.md "Grouped digits") against its float64
reference (`grouped_reference`, loops straight from the spec) on random grouped cases, loss and gradients;
with a single-digit table against today's NTILLoss and the golden cases of the authors' code; packed rows
and the labelled head against the plain call."""

import json
from pathlib import Path

import pytest
import torch

from ntil_ds.labelled_forward import loss_from_rows, row_inputs, row_stats
from ntil_ds.loss import NTILLoss
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.grouped_reference import reference_grouped_ntil_loss
from ntil_ds.loss.grouped_terms import NumberTokenTable
from ntil_ds.loss.labelled_head import OutputHead

GOLDEN = Path(__file__).resolve().parent / "loss_golden" / "ntil_reference_cases.json"
FIELDS = ("loss", "ntil", "emd", "rel", "mag", "ce_mean")
VOCAB = 1150  # 1,110 number tokens (shuffled ids) and 40 others
PERMUTATION = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0)).tolist()
TABLE = {1: PERMUTATION[:10], 2: PERMUTATION[10:110], 3: PERMUTATION[110:1110]}
OTHERS = PERMUTATION[1110:]
MINUS, POINT = OTHERS[0], OTHERS[1]
SIGNED_DECIMAL = {
    "signed_numbers": True,
    "minus_sign_id": MINUS,
    "decimal_numbers": True,
    "decimal_point_id": POINT,
}


def _number(generator, widths, max_tokens=3, table=TABLE):
    """The tokens of one number as a grouped-from-the-left tokenizer writes it (or any widths: the loss
    takes the label's own tokenization)."""
    count = int(torch.randint(1, max_tokens + 1, (1,), generator=generator))
    tokens = []
    for _ in range(count):
        width = widths[int(torch.randint(0, len(widths), (1,), generator=generator))]
        tokens.append(table[width][int(torch.randint(0, 10**width, (1,), generator=generator))])
    return tokens


def grouped_batch(batch, length, *, seed, table=TABLE, dtype=torch.float64, others=OTHERS, vocab=VOCAB):
    """Labels made of numbers (some signed, some with one decimal point, some with two), words and -100."""
    generator = torch.Generator().manual_seed(seed)
    widths = sorted(table)
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < length:
            kind = int(torch.randint(0, 6, (1,), generator=generator))
            if kind == 0:
                row += [MINUS, *_number(generator, widths, table=table)]
            elif kind == 1:
                row += [
                    *_number(generator, widths, table=table),
                    POINT,
                    *_number(generator, widths, table=table),
                ]
            elif kind == 2:
                row += [
                    *_number(generator, widths, 2, table=table),
                    POINT,
                    *_number(generator, widths, 1, table=table),
                    POINT,
                    table[1][3],
                ]
            elif kind == 3:
                row += [-100] * int(torch.randint(1, 3, (1,), generator=generator))
            else:
                row += [
                    *_number(generator, widths, table=table),
                    others[int(torch.randint(2, len(others), (1,), generator=generator))],
                ]
        rows.append(row[:length])
    labels = torch.tensor(rows)
    logits = torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64) * 2
    # Make the argmax land on the right token at some positions, so that REL is 0 for some runs.
    hit = (torch.rand(batch, length, generator=generator) < 0.3) & (labels >= 0)
    logits[(*hit.nonzero(as_tuple=True), labels[hit])] += 8.0
    return logits.to(dtype), labels


def _noise(loss_fn, numel, dtype, seed):
    """The noise the loss draws from a generator in this state (replayed for the reference)."""
    generator = torch.Generator().manual_seed(seed)
    exponential = torch.empty(numel, 2 * loss_fn.number_token_table.noise_half, dtype=dtype)
    return -exponential.exponential_(generator=generator).log() * loss_fn.gumbel_noise_scale


def _compare(options, *, seed, batch=3, length=20, atol=1e-6, fast_dtype=torch.float64):
    """The loss (kernel="torch", `options`) in `fast_dtype` against the float64 reference, both gradients."""
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", **options)
    logits, labels = grouped_batch(batch, length, seed=seed)
    use_noise = loss_fn.uses_gumbel and loss_fn.gumbel_noise_scale > 0
    noise = _noise(loss_fn, labels.numel(), fast_dtype, seed) if use_noise else None
    reference_options = {k: v for k, v in options.items() if k not in ("signed_numbers", "decimal_numbers")}
    reference_options.pop("gumbel_noise_scale", None)
    reference_options.pop("number_stage", None)
    for field in ("ntil", "loss"):
        fast_logits = logits.detach().clone().to(fast_dtype).requires_grad_()
        out = loss_fn(fast_logits, labels, generator=torch.Generator().manual_seed(seed))
        getattr(out, field).backward()
        reference_logits = logits.detach().clone().requires_grad_()
        expected = reference_grouped_ntil_loss(
            reference_logits,
            labels,
            TABLE,
            noise=None if noise is None else noise.double(),
            **reference_options,
        )
        expected[field].backward()
        for name in FIELDS:
            torch.testing.assert_close(
                getattr(out, name).double(), expected[name], rtol=atol, atol=atol,
                msg=lambda message, name=name: f"{name}: {message}",
            )  # fmt: skip
        torch.testing.assert_close(
            fast_logits.grad.double(), reference_logits.grad, rtol=atol, atol=atol,
            msg=lambda message, field=field: f"the gradient of {field}: {message}",
        )  # fmt: skip
    return out


RANDOM_CASES = {
    "paper": {"gumbel_noise_scale": 0.0},
    "noise": {"gumbel_noise_scale": 1.0},
    "signed+decimal": {"gumbel_noise_scale": 0.5, **SIGNED_DECIMAL},
    "decimal": {
        "gumbel_noise_scale": 0.0,
        "decimal_numbers": True,
        "decimal_point_id": POINT,
        "digit_exp": 1.5,
    },
    "signed": {"gumbel_noise_scale": 1.0, "signed_numbers": True, "minus_sign_id": MINUS},
    "emd-only": {"abs_alpha": 0.0, "mag_alpha": 0.0, **SIGNED_DECIMAL},
    "cap4": {"gumbel_noise_scale": 0.0, "max_number_digits": 4, **SIGNED_DECIMAL},
}


@pytest.mark.parametrize("options", list(RANDOM_CASES.values()), ids=list(RANDOM_CASES))
def test_random_grouped_cases_equal_the_float64_reference(options):
    for seed in range(2):
        out = _compare(options, seed=seed)
        assert out.emd > 0 and out.rel > 0


def test_float32_fast_path_against_the_float64_reference():
    _compare({"gumbel_noise_scale": 0.5, **SIGNED_DECIMAL}, seed=7, fast_dtype=torch.float32, atol=2e-5)


def test_places_follow_the_labels_own_tokenization():
    """ "12345" as "123"+"45" and as "1"+"234"+"5": the same number, each digit at its own place; the one-hot
    prediction of either tokenization gives EMD, REL and MAG 0, and a wrong first digit costs digit_exp**4."""
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", gumbel_noise_scale=0.0)
    for tokens in ([TABLE[3][123], TABLE[2][45]], [TABLE[1][1], TABLE[3][234], TABLE[1][5]]):
        labels = torch.tensor([[*tokens, OTHERS[5]]])
        logits = torch.full((1, len(tokens) + 1, VOCAB), -30.0)
        logits[0, torch.arange(len(tokens) + 1), labels[0]] = 30.0
        out = loss_fn(logits, labels)
        assert out.emd.item() == pytest.approx(0.0, abs=1e-6) and out.rel == 0 and out.mag == 0
        wrong = logits.clone()
        first = TABLE[3][223] if len(tokens) == 2 else TABLE[1][2]  # first digit 2 instead of 1
        wrong[0, 0, labels[0, 0]], wrong[0, 0, first] = -30.0, 30.0
        out = loss_fn(wrong, labels)
        assert out.emd.item() == pytest.approx(
            1.2**4 / 5, rel=1e-5
        )  # one digit off by 1 at place 4, 5 places
        assert out.rel.item() == pytest.approx(10000 / 22346, rel=1e-5)


def test_mass_on_other_widths_and_non_number_tokens_is_renormalised_away():
    """Only the label width's tokens enter the NTIL terms (spec: renormalised within the width)."""
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", gumbel_noise_scale=0.0)
    logits, labels = grouped_batch(2, 16, seed=3)
    base = loss_fn(logits, labels)
    moved = logits.clone()
    for b, t in (labels >= 0).nonzero().tolist():
        moved[b, t, OTHERS[3]] += 5.0  # a word
        for _width, ids in TABLE.items():
            if labels[b, t].item() not in ids:
                moved[b, t, ids] += 3.0  # the other widths' number tokens
    out = loss_fn(moved, labels)
    for name in ("ntil", "emd", "rel", "mag"):
        torch.testing.assert_close(getattr(out, name), getattr(base, name), rtol=1e-12, atol=1e-12, msg=name)
    assert out.ce_mean > base.ce_mean


def _golden_cases():
    return json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("index", range(len(_golden_cases())))
def test_single_digit_table_is_todays_ntil_on_the_golden_cases(index):
    case = _golden_cases()[index]
    table = {1: case["digit_ids"]}
    expected = case["expected"]
    for output_name, grad_name in (("ntil", "grad_ntil"), ("loss", "grad_loss")):
        outputs, grads = [], []
        for loss_fn in (GroupedNTILLoss(table, gumbel_noise_scale=0.0, **case["hyper"]),
                        NTILLoss(case["digit_ids"], gumbel_noise_scale=0.0, **case["hyper"])):  # fmt: skip
            logits = torch.tensor(case["logits"], dtype=torch.float32, requires_grad=True)
            outputs.append(loss_fn(logits, torch.tensor(case["labels"])))
            getattr(outputs[-1], output_name).backward()
            grads.append(logits.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[0], torch.tensor(expected[grad_name]), rtol=1e-5, atol=1e-6)
        for field in FIELDS:
            torch.testing.assert_close(
                getattr(outputs[0], field), getattr(outputs[1], field), rtol=1e-6, atol=1e-6
            )
            assert getattr(outputs[0], field).item() == pytest.approx(expected[field], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("options", [{}, SIGNED_DECIMAL], ids=["paper", "signed+decimal"])
def test_single_digit_table_is_todays_ntil_with_noise_signs_and_points(options):
    digits = TABLE[1]
    generator = torch.Generator().manual_seed(4)
    labels = torch.tensor([*digits, MINUS, POINT, -100, OTHERS[9]])[
        torch.randint(0, 14, (4, 30), generator=generator)
    ]
    logits = torch.randn(4, 30, VOCAB, generator=generator)
    results = []
    for loss_fn in (GroupedNTILLoss({1: digits}, gumbel_noise_scale=1.0, **options),
                    NTILLoss(digits, gumbel_noise_scale=1.0, **options)):  # fmt: skip
        leaf = logits.clone().requires_grad_()
        out = loss_fn(leaf, labels, generator=torch.Generator().manual_seed(9))
        out.loss.backward()
        results.append((out, leaf.grad))
    for field in FIELDS:
        torch.testing.assert_close(
            getattr(results[0][0], field), getattr(results[1][0], field), rtol=1e-6, atol=1e-6
        )
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)
    assert results[0][0].rel > 0


def test_packed_rows_equal_the_unpacked_batch():
    """Two rows holding three samples and padding: the number terms per sample, as unpacked."""
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", gumbel_noise_scale=0.0, **SIGNED_DECIMAL)
    logits, labels = grouped_batch(3, 12, seed=5)
    packed_logits = torch.zeros(2, 24, VOCAB, dtype=torch.float64)
    packed_labels = torch.full((2, 24), -100)
    placements = [(0, 0), (0, 12), (1, 5)]
    for sample, (row, start) in enumerate(placements):
        packed_logits[row, start : start + 12], packed_labels[row, start : start + 12] = (
            logits[sample],
            labels[sample],
        )
    unpack_index = torch.tensor([[row * 24 + start + i for i in range(12)] for row, start in placements])
    packed_leaf, leaf = packed_logits.requires_grad_(), logits.clone().requires_grad_()
    got = loss_fn(packed_leaf, packed_labels, unpack_index=unpack_index)
    want = loss_fn(leaf, labels)
    got.ntil.backward(), want.ntil.backward()
    for field in FIELDS:
        torch.testing.assert_close(
            getattr(got, field), getattr(want, field), rtol=1e-10, atol=1e-12, msg=field
        )
    for sample, (row, start) in enumerate(placements):
        torch.testing.assert_close(packed_leaf.grad[row, start : start + 12], leaf.grad[sample])
    assert packed_leaf.grad[1, :5].abs().max() == 0 and want.rel > 0


def test_labelled_head_equals_full_logits():
    """loss.logits=labelled (the head at the labelled rows, NTILLoss's row hooks) equals the plain call."""
    loss_fn = GroupedNTILLoss(TABLE, kernel="torch", gumbel_noise_scale=1.0, **SIGNED_DECIMAL)
    _, labels = grouped_batch(2, 20, seed=6)
    generator = torch.Generator().manual_seed(6)
    hidden, weight = (
        torch.randn(2, 20, 16, generator=generator),
        torch.randn(VOCAB, 16, generator=generator) * 0.5,
    )
    full_hidden = hidden.clone().requires_grad_()
    expected = loss_fn(full_hidden @ weight.t(), labels, generator=torch.Generator().manual_seed(1))
    expected.loss.backward()
    rows_hidden = hidden.clone().requires_grad_()
    rows = (labels.flatten() != -100).nonzero().squeeze(1)
    targets, noise, payload = row_inputs(
        loss_fn, labels, rows, torch.float32, torch.Generator().manual_seed(1), False
    )
    column_ids = loss_fn.column_ids_on(torch.device("cpu"))
    stats = row_stats(rows_hidden, OutputHead(weight), rows, targets, column_ids, None, payload, "torch")
    out = loss_from_rows(loss_fn, labels, rows, stats, noise, None)
    out.loss.backward()
    for field in FIELDS:
        torch.testing.assert_close(
            getattr(out, field), getattr(expected, field), rtol=1e-5, atol=1e-6, msg=field
        )
    torch.testing.assert_close(rows_hidden.grad, full_hidden.grad, rtol=1e-5, atol=1e-6)
    assert expected.rel > 0


@pytest.mark.parametrize(
    ("table", "kwargs", "message"),
    [
        ({2: TABLE[2]}, {}, "widths must be 1..m"),
        ({1: TABLE[1], 3: TABLE[3]}, {}, "widths must be 1..m"),
        ({1: TABLE[1], 2: TABLE[2][:99]}, {}, "needs 100"),
        ({1: TABLE[1], 2: TABLE[1] * 10}, {}, "same token id"),
        (TABLE, {"signed_numbers": True, "minus_sign_id": TABLE[2][5]}, "is a number token"),
    ],
)
def test_bad_tables_and_options_say_what_is_wrong(table, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupedNTILLoss(table, **kwargs)


def test_table_columns_in_width_order():
    table = NumberTokenTable.of(TABLE)
    assert table.widths == (1, 2, 3) and table.noise_half == 1000
    assert table.column_ids == TABLE[1] + TABLE[2] + TABLE[3]


def test_every_table_keeps_the_kernel_choice_and_the_vocabulary_kernels_take_its_columns():
    """Widths 1-3 (1,110 columns, 2,048 lanes) run the Triton vocabulary kernels as widths 1-2 do (the
    interpreter checks below compare them with the torch tiles); past 2,048 lanes they refuse."""
    vocab_kernel = pytest.importorskip("ntil_ds.loss.vocab_kernel")  # imports triton

    for kernel in ("auto", "triton", "torch"):
        assert GroupedNTILLoss(TABLE, kernel=kernel).kernel == kernel
    assert vocab_kernel._column_lanes(1111) == vocab_kernel.MAX_COLUMN_LANES > vocab_kernel.SAME_ID_MAX_LANES
    with pytest.raises(ValueError, match="at most 2048 columns, got 2049"):
        vocab_kernel._column_lanes(2049)


CHECKS_FILE = Path(__file__).resolve().parent / "grouped_kernel_checks.py"
LAUNCH_CHECK = "check_grouped_launches_are_a_constant_of_the_table"


@pytest.fixture(scope="module")
def interpreter_results():
    """tests/unit/grouped_kernel_checks.py under TRITON_INTERPRET=1, once (a subprocess: the flag must be set
    before the kernels are defined and must not reach other tests): check name -> {status, info}."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    path = os.pathsep.join(p for p in (str(CHECKS_FILE.parents[2]), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(CHECKS_FILE)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_names():
    """The checks' names, read from the file (importing it here would import this module again)."""
    import re

    return sorted(
        set(re.findall(r"^def (check_\w+)", CHECKS_FILE.read_text(), re.MULTILINE)) - {LAUNCH_CHECK}
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", _check_names())
def test_grouped_kernels_in_the_interpreter(interpreter_results, name):
    """The vocabulary kernels with a grouped table's columns and the grouped number kernels (1,110 columns)
    against the float64 reference and the torch stage, packed rows included."""
    assert interpreter_results[name]["status"] == "ok", interpreter_results[name]["status"]


@pytest.mark.slow
def test_grouped_loss_launches_are_a_constant_of_the_table(interpreter_results):
    """Counted on CPU (number_kernel_checks.count_launches): three grouped Triton launches per forward +
    backward at every batch, run count and mode; the count table is printed (`pytest -s`)."""
    result = interpreter_results[LAUNCH_CHECK]
    print("\nlaunches per GroupedNTILLoss forward + backward (aten ops + Triton launches):")
    for name, count in (result.get("info") or {}).items():
        print(f"  {name:52s} {count['aten']:4d} + {count['triton']} = {count['total']}")
    assert result["status"] == "ok", result["status"]


@pytest.mark.slow
def test_compiled_number_stage_equals_eager():
    """number_stage="compile" (torch.compile of the grouped stage, dynamic shapes) against "eager"."""
    logits, labels = grouped_batch(3, 20, seed=2, dtype=torch.float32)
    results = {}
    for stage in ("eager", "compile"):
        loss_fn = GroupedNTILLoss(TABLE, number_stage=stage, gumbel_noise_scale=0.0, **SIGNED_DECIMAL)
        leaf = logits.clone().requires_grad_()
        out = loss_fn(leaf, labels)
        out.loss.backward()
        results[stage] = (out, leaf.grad)
    for field in FIELDS:
        torch.testing.assert_close(getattr(results["compile"][0], field), getattr(results["eager"][0], field))
    torch.testing.assert_close(results["compile"][1], results["eager"][1], rtol=1e-5, atol=1e-6)
