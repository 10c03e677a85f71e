"""The grouped loss's Triton kernels in Triton's interpreter on CPU: the grouped number stage (1,110 columns)
against the float64 reference and the torch stage, and the vocabulary kernels with a grouped-digit loss's
gathered columns (widths 1-2: 110 columns; widths 1-3: 1,110), on CPU (run as a script with
TRITON_INTERPRET=1; tests/unit/test_loss_grouped.py runs it in a subprocess).
GroupedNTILLoss(kernel="triton") against kernel="torch" (itself checked against the float64 reference),
values and gradients, and one vocabulary shard's partials; the launch count of the grouped loss. Prints a
JSON dict check name -> {"status": "ok" or the traceback, "info": what the check returned}.

    TRITON_INTERPRET=1 python tests/unit/grouped_kernel_checks.py [CHECK ...]
"""

import json
import os
import sys
import traceback

import torch

from tests.unit.loss_kernel_checks import compare_backends, kernel_module
from tests.unit.test_loss_grouped import (
    OTHERS,
    RANDOM_CASES,
    SIGNED_DECIMAL,
    TABLE,
    VOCAB,
    _compare,
    grouped_batch,
)

# Widths 1-2 (110 columns, 128 lanes: the backward's same-id matrix) and widths 1-3 (1,110 columns, 2,048
# lanes: distinct ids, no matrix; vocab_kernel.SAME_ID_MAX_LANES): both ways the vocabulary kernels run.
TABLE_12 = {1: TABLE[1], 2: TABLE[2]}


def check_grouped_loss_on_the_kernels_equals_the_torch_tiles():
    from ntil_ds.loss.grouped import GroupedNTILLoss

    kernel_module(block=256)  # a vocabulary of 1,150: 5 blocks, the last partial
    for seed, table in enumerate((TABLE_12, TABLE)):
        logits, labels = grouped_batch(2, 12, seed=11 + seed, dtype=torch.float32, table=table)
        for options in ({"gumbel_noise_scale": 0.0}, {"gumbel_noise_scale": 1.0, **SIGNED_DECIMAL}):
            compare_backends(
                lambda kernel, o=options, t=table: GroupedNTILLoss(t, kernel=kernel, **o), logits, labels
            )


def check_one_shards_partials_with_the_tables_columns():
    from ntil_ds.loss.grouped import GroupedNTILLoss
    from ntil_ds.loss.vocab_stats import reduce_rows, row_partials

    kernel = kernel_module(block=256)
    for table in (TABLE_12, TABLE):
        logits, labels = grouped_batch(2, 8, seed=12, dtype=torch.float32, table=table)
        rows = logits.reshape(16, -1)[:, 400:900].contiguous()  # a middle shard: some columns local, most not
        targets = torch.where(labels.flatten() < 0, -1, labels.flatten())
        column_ids = GroupedNTILLoss(table).column_ids_on(torch.device("cpu"))
        width = column_ids.numel()
        got = kernel.forward_partials(rows, targets, column_ids, 400, 3 + width)
        want = row_partials(rows, targets, column_ids, 400, None)
        got, want = (reduce_rows(*parts, targets, width, None, None) for parts in (got, want))
        for name, a, b in zip(("ce", "columns", "row_max"), got[:3], want[:3], strict=True):
            torch.testing.assert_close(
                a, b, rtol=2e-6, atol=1e-6, equal_nan=True, msg=f"{width} columns: {name}"
            )


def _small_number_blocks():
    from ntil_ds.loss import grouped_kernel

    grouped_kernel.SEQUENCE_BLOCK = 8  # sequences of 16-24 positions: 2-3 blocks, carries across their edges
    return grouped_kernel


def check_grouped_number_kernels_equal_the_float64_reference():
    """number_stage="triton" (1,110 columns) on random cases, loss and both gradients, against the float64
    reference at fp32's tolerance (the torch stage's fp32 test's)."""
    _small_number_blocks()
    for seed, (name, options) in enumerate(RANDOM_CASES.items()):
        try:
            out = _compare(
                {**options, "number_stage": "triton"}, seed=seed, batch=2, length=16,
                fast_dtype=torch.float32, atol=2e-5,
            )  # fmt: skip
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
        assert out.emd > 0 and out.rel > 0, name


def _run(loss_fn, logits, labels, output, **call):
    leaf = logits.detach().clone().requires_grad_()
    out = loss_fn(leaf, labels, generator=torch.Generator().manual_seed(4), **call)
    getattr(out, output).backward()
    return out, leaf.grad


def check_grouped_number_kernels_equal_the_torch_stage_in_float32():
    """Tight: the kernels against number_stage="eager" on the same fp32 columns (with noise, signs, points)."""
    from ntil_ds.loss.grouped import GroupedNTILLoss

    _small_number_blocks()
    logits, labels = grouped_batch(2, 24, seed=21, dtype=torch.float32)
    for options in ({"gumbel_noise_scale": 1.0, **SIGNED_DECIMAL}, {"gumbel_noise_scale": 0.0}):
        for output in ("loss", "ntil"):
            results = {}
            for stage in ("eager", "triton"):
                loss_fn = GroupedNTILLoss(TABLE, kernel="torch", number_stage=stage, **options)
                assert loss_fn.number_stage_for(logits) == stage
                results[stage] = _run(loss_fn, logits, labels, output)
            (out, grad), (want, want_grad) = results["triton"], results["eager"]
            for field in ("loss", "ntil", "emd", "rel", "mag"):
                torch.testing.assert_close(getattr(out, field), getattr(want, field), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


# Three samples of 12 positions packed in two rows of 24 (padding between): (row, start) of each.
PLACEMENTS = [(0, 0), (0, 12), (1, 5)]


def _packed(logits, labels):
    """[3, 12] samples packed at PLACEMENTS: packed logits, packed labels, unpack_index."""
    packed_logits, packed_labels = torch.zeros(2, 24, VOCAB), torch.full((2, 24), -100)
    for sample, (row, start) in enumerate(PLACEMENTS):
        packed_logits[row, start : start + 12] = logits[sample]
        packed_labels[row, start : start + 12] = labels[sample]
    unpack_index = torch.tensor([[row * 24 + start + i for i in range(12)] for row, start in PLACEMENTS])
    return packed_logits, packed_labels, unpack_index


def check_grouped_number_kernels_on_packed_rows():
    """Three samples packed in two rows (unpack_index) on the kernels equal the unpacked batch on them."""
    from ntil_ds.loss.grouped import GroupedNTILLoss

    _small_number_blocks()
    loss_fn = GroupedNTILLoss(
        TABLE, kernel="torch", number_stage="triton", gumbel_noise_scale=0.0, **SIGNED_DECIMAL
    )
    logits, labels = grouped_batch(3, 12, seed=5, dtype=torch.float32)
    packed_logits, packed_labels, unpack_index = _packed(logits, labels)
    got, packed_grad = _run(loss_fn, packed_logits, packed_labels, "ntil", unpack_index=unpack_index)
    want, grad = _run(loss_fn, logits, labels, "ntil")
    for field in ("ntil", "emd", "rel", "mag"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-6, atol=1e-7,
                                   msg=lambda message, field=field: f"packed {field}: {message}")  # fmt: skip
    for sample, (row, start) in enumerate(PLACEMENTS):
        torch.testing.assert_close(packed_grad[row, start : start + 12], grad[sample], rtol=1e-6, atol=1e-8,
                                   msg=lambda message, sample=sample: f"sample {sample}'s gradient: {message}")  # fmt: skip
    assert packed_grad[1, :5].abs().max() == 0 and want.rel > 0


# --- launch count ---------------------------------------------------------------------------------


def _runs_batch(table, runs_per_row: int, length: int = 16):
    """[2, length] labels of number tokens (of every width) in `runs_per_row` runs split by words."""
    tokens = [ids[(7 * i + 3) % len(ids)] for i, ids in enumerate(table.values())]
    gaps = {round(i * length / runs_per_row) for i in range(1, runs_per_row)}
    row = [OTHERS[4] if t in gaps or t - 1 in gaps else tokens[t % len(tokens)] for t in range(length)]
    logits = torch.randn(2, length, VOCAB, generator=torch.Generator().manual_seed(runs_per_row))
    return logits, torch.tensor([row, row[::-1]])


def check_grouped_launches_are_a_constant_of_the_table():
    """Launches of one forward + backward (noise on, as in training), counted on CPU (aten ops + Triton
    launches, number_kernel_checks.count_launches): for each table and options the same count at every
    B*T and number of runs; the grouped number stage is exactly three Triton launches (position, sequence,
    backward) whatever the widths, two vocabulary launches, and the whole loss <= 60."""
    from ntil_ds.loss.grouped import GroupedNTILLoss
    from tests.unit.number_kernel_checks import LAUNCH_LIMIT, count_launches

    kernel_module(block=256)
    _small_number_blocks()
    number_stage = {"grouped_kernel._position_kernel": 1, "grouped_kernel._sequence_kernel": 1,
                    "grouped_kernel._backward_kernel": 1}  # fmt: skip
    vocabulary = {"vocab_kernel._forward_kernel": 1, "vocab_kernel._backward_kernel": 1}
    tables = {"widths 1": {1: TABLE[1]}, "widths 1-2": TABLE_12, "widths 1-3": TABLE}
    counts, failures = {}, []
    for table_name, table in tables.items():
        # 8 positions and 32, one run a row and six; widths 1-3 (LLaMA-3's table) also packed rows and
        # signed + decimal mode. Small: the interpreter runs every program in Python.
        cases = {"[1, 8]": (*grouped_batch(1, 8, seed=1, dtype=torch.float32, table=table), None),
                 "[2, 16] 6 runs a row": (*_runs_batch(table, 6), None)}  # fmt: skip
        runs = [("", {}, cases)]
        if table_name == "widths 1-3":
            packed = _packed(*grouped_batch(3, 12, seed=5, dtype=torch.float32, table=table))
            more = {
                "[2, 16] 1 run a row": (*_runs_batch(table, 1), None),
                "[3, 12] packed in [2, 24]": packed,
            }
            runs = [("", {}, {**cases, **more}), (" signed+decimal", SIGNED_DECIMAL, cases)]
        for options_name, option, batches in runs:
            loss_fn = GroupedNTILLoss(table, kernel="triton", number_stage="triton", **option)
            totals = set()
            for case_name, (logits, labels, unpack_index) in batches.items():
                count = count_launches(loss_fn, logits, labels, unpack_index=unpack_index)
                name = f"{table_name}{options_name} {case_name}"
                counts[name] = {key: count[key] for key in ("aten", "triton", "total", "kernels")}
                totals.add(count["total"])
                if count["kernels"] != {**number_stage, **vocabulary}:
                    failures.append(
                        f"{name}: Triton launches {count['kernels']}, expected {number_stage | vocabulary}"
                    )
                if count["total"] > LAUNCH_LIMIT:
                    failures.append(f"{name}: {count['total']} launches > {LAUNCH_LIMIT}")
            if len(totals) != 1:
                failures.append(f"{table_name}{options_name}: the count depends on the batch: {totals}")
    assert not failures, "\n".join(failures)
    return counts


CHECKS = {name: value for name, value in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    results = {}
    for name in sys.argv[1:] or list(CHECKS):
        try:
            results[name] = {"status": "ok", "info": CHECKS[name]()}
        except Exception:
            results[name] = {"status": traceback.format_exc()}
    print(json.dumps(results))
