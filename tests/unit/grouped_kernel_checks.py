"""The Triton vocabulary kernels with a grouped-digit loss's gathered columns (widths 1-2: 110 columns), in Triton's interpreter
on CPU (run as a script with TRITON_INTERPRET=1; tests/unit/test_loss_grouped.py runs it in a subprocess).
GroupedNTILLoss(kernel="triton") against kernel="torch" (itself checked against the float64 reference),
values and gradients, and one vocabulary shard's partials. Prints a JSON dict check name -> "ok" or the
traceback."""

import json
import os
import sys
import traceback

import torch

from tests.unit.loss_kernel_checks import compare_backends, kernel_module
from tests.unit.test_loss_grouped import SIGNED_DECIMAL, TABLE, grouped_batch

# Widths 1-2 (110 columns): the table the vocabulary kernels take (GroupedNTILLoss.KERNEL_MAX_COLUMNS).
TABLE_12 = {1: TABLE[1], 2: TABLE[2]}


def check_grouped_loss_on_the_kernels_equals_the_torch_tiles():
    from ntil_ds.loss.grouped import GroupedNTILLoss

    kernel_module(block=256)  # a vocabulary of 1,150: 5 blocks, the last partial
    logits, labels = grouped_batch(2, 12, seed=11, dtype=torch.float32, table=TABLE_12)
    for options in ({"gumbel_noise_scale": 0.0}, {"gumbel_noise_scale": 1.0, **SIGNED_DECIMAL}):
        compare_backends(
            lambda kernel, o=options: GroupedNTILLoss(TABLE_12, kernel=kernel, **o), logits, labels
        )


def check_one_shards_partials_with_the_tables_columns():
    from ntil_ds.loss.grouped import GroupedNTILLoss
    from ntil_ds.loss.vocab_stats import reduce_rows, row_partials

    kernel = kernel_module(block=256)
    logits, labels = grouped_batch(2, 8, seed=12, dtype=torch.float32, table=TABLE_12)
    rows = logits.reshape(16, -1)[:, 400:900].contiguous()  # a middle shard: some columns local, most not
    targets = torch.where(labels.flatten() < 0, -1, labels.flatten())
    column_ids = GroupedNTILLoss(TABLE_12).column_ids_on(torch.device("cpu"))
    got = reduce_rows(
        *kernel.forward_partials(rows, targets, column_ids, 400, 3 + 110), targets, 110, None, None
    )
    want = reduce_rows(*row_partials(rows, targets, column_ids, 400, None), targets, 110, None, None)
    for name, a, b in zip(("ce", "columns", "row_max"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6, equal_nan=True, msg=name)


CHECKS = {name: value for name, value in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    results = {}
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))
