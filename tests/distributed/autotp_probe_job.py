"""launch/train.py, unchanged, with a probe on the AutoTP vocab-parallel output head.

A global forward hook records, for every forward of the module DeepSpeed built with
``vocab_parallel_lm_head``, the shape of its output and the vocabulary rows it holds; each rank writes
them to ``$LOGITS_PROBE_DIR/rank<R>.json`` when the run ends. Used by test_autotp.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

records: list[dict] = []


def probe(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    if getattr(module, "is_vocab_parallel_lm_head", False):
        records.append(
            {
                "shape": list(output.shape),
                "vocab_start": int(module.vocab_start_index),
                "vocab_end": int(module.vocab_end_index),
                "vocab_size": int(module.vocab_size),
                "training": module.training,  # False: a forward of generation during evaluation
            }
        )


if __name__ == "__main__":
    from launch.train import main
    from ntil_ds.dist import exit_process

    handle = torch.nn.modules.module.register_module_forward_hook(probe)
    try:
        code = main(sys.argv[1:])
    finally:
        handle.remove()
        out = Path(os.environ["LOGITS_PROBE_DIR"]) / f"rank{os.environ['RANK']}.json"
        out.write_text(json.dumps(records))
    exit_process(code)  # as launch/train.py ends a rank
