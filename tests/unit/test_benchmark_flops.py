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


def test_2b_step_flops_count_the_head_where_it_ran(tmp_path):
    """matmul_params against the parameters of a real model built from such a config (every nn.Linear of
    the language model, and the head), and step_flops counting the head at the labelled rows only."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from benchmarks.model_2b import matmul_params
    from benchmarks.train_step import StepRecord, step_flops
    from ntil_ds.tiny import build_tiny_model_folder

    folder = build_tiny_model_folder("qwen2_vl", tmp_path / "tiny")
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    decoder = sum(
        module.weight.numel()
        for name, module in model.model.language_model.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    params = matmul_params(folder / "config.json")
    assert params == {"decoder": decoder, "head": model.lm_head.weight.numel()}
    hf = StepRecord(step=1, seconds=1.0, tokens=1000)  # the HF Trainer: the head at every token
    ours = StepRecord(step=1, seconds=1.0, tokens=1000, head_rows=20)
    assert step_flops(hf, params) == 6 * 1000 * (decoder + params["head"])
    assert step_flops(ours, params) == 6 * (1000 * decoder + 20 * params["head"])
