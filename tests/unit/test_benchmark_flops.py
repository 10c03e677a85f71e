"""The FLOPs the benchmarks' MFU divides by are the ones actually run: torch's FlopCounterMode (an
independent count of every matrix product dispatched) on the head table's two paths, on CPU."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.head_speed import DIGIT_IDS, draw_inputs, head_flops, make_labels, run_once
from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.loss import NTILLoss


def _counted(path: str, inputs) -> int:
    with FlopCounterMode(display=False) as counter:
        run_once(path, *inputs)
    return counter.get_total_flops()


def test_head_flops_are_the_matrix_products_each_path_runs():
    hidden_size, vocab, positions = 32, 2000, 512
    hidden, weight = draw_inputs(hidden_size, vocab, positions, "float32", torch.device("cpu"))
    labels = make_labels(positions, 0.2, vocab, seed=1)
    rows = int((labels != IGNORE_INDEX).sum())
    assert 0 < rows < positions
    inputs = (hidden, weight, labels, NTILLoss(DIGIT_IDS), 64)  # 64 rows a chunk: several chunks
    assert _counted("all", inputs) == head_flops(positions, hidden_size, vocab)
    # the labelled head multiplies only the labelled rows (counting all T would inflate its figure 5x
    # here), and recomputes their logits in the backward
    assert _counted("labelled", inputs) == head_flops(rows, hidden_size, vocab, recompute=True)
