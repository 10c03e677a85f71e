"""launch/train.py, unchanged, with a probe on the mixture-of-experts routers.

A global forward hook records, for every training forward of a router (a module returning
``(router_logits, router_scores, router_indices)``, transformers' ``*TopKRouter``), the experts its
tokens were sent to, and every training forward's aux loss (the model's ``aux_loss``); each rank writes them to ``$MOE_PROBE_DIR/rank<R>.json`` when the run ends.
``MOE_PROBE_NO_LEAF=1`` turns the engine's ZeRO-3 expert leaf modules off (to measure what they
prevent). Used by test_train_moe.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

records: dict[str, list] = {"routes": [], "aux": []}


def probe(module: torch.nn.Module, inputs: tuple, output: object) -> None:
    if not module.training:
        return
    if type(module).__name__.endswith("TopKRouter"):
        _, _, indices = output
        records["routes"].append(sorted(int(e) for e in indices.unique()))
    elif getattr(output, "aux_loss", None) is not None:  # the model's own output: its micro-batch's aux
        records["aux"].append(float(output.aux_loss))


if __name__ == "__main__":
    from launch.train import main
    from ntil_ds import engine
    from ntil_ds.dist import exit_process

    if os.environ.get("MOE_PROBE_NO_LEAF") == "1":
        engine.set_expert_leaf_modules = lambda model: []
    handle = torch.nn.modules.module.register_module_forward_hook(probe)
    try:
        code = main(sys.argv[1:])
    finally:
        handle.remove()
        out = Path(os.environ["MOE_PROBE_DIR"]) / f"rank{os.environ['RANK']}.json"
        out.write_text(json.dumps(records))
    exit_process(code)  # as launch/train.py ends a rank
