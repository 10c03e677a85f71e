"""The "ours" side of benchmarks/train_step.py: CE and NTIL steps interleaved in one training job.

    torchrun --standalone --nproc_per_node 2 benchmarks/loss_pair_job.py --out steps.json --steps 20 \
        --config configs/train/tiny_qwen2vl_clock.yaml [key=value ...]

Builds the real :class:`ntil_ds.trainer.Trainer` from the recipe (what launch/train.py does), then
takes the same micro-batches through two optimizer steps of ``Trainer.train_step``: one with the loss
``loss.name=ce`` builds, one with ``loss.name=ntil``'s, the order alternating from step to step. Both
variants thus run on the same data, weights of the same size and, above all, the same machine load at
the same moment: on a shared machine, jobs run one after another see load differences far larger
than the loss's own cost. Rank 0 writes ``{"records": [{"variant", "step", "step_time_s", "tokens"}]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True, help="steps per variant")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch

    from ntil_ds.data import tokenizer_of
    from ntil_ds.ds_config import resolve_run
    from ntil_ds.engine import init_distributed
    from ntil_ds.loss.build import build_loss
    from ntil_ds.trainer import Trainer

    cfg, ds_config, dist_info = resolve_run(args.config, args.overrides)
    init_distributed()
    trainer = Trainer(cfg, ds_config, dist_info)
    tokenizer = tokenizer_of(trainer.processor)
    losses = {
        name: build_loss(dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, name=name)), tokenizer)
        for name in ("ce", "ntil")
    }
    trainer.engine.train()
    steps = trainer.step_batches()  # packed or padded as the recipe says, prepared by its workers
    records = []
    for step in range(1, args.steps + 1):
        micro_batches = next(steps)
        order = ("ce", "ntil") if step % 2 else ("ntil", "ce")
        for name in order:
            trainer.objective.loss_fn = losses[name]
            if trainer.device.type == "cuda":  # each step's own peak, not the running maximum of both
                torch.cuda.reset_peak_memory_stats(trainer.device)
            metrics = trainer.train_step(micro_batches)
            records.append(
                {
                    "variant": name,
                    "step": step,
                    "step_time_s": metrics["step_time_s"],
                    "tokens": metrics["tokens_per_s"] * metrics["step_time_s"],
                    "loss": metrics["loss"],
                    "peak_mem_mib": metrics["peak_mem_mib"],
                    "micro_batches": len(micro_batches),
                    # where the head ran (MFU): the labelled rows, or every position with loss.logits=all
                    "head_rows": metrics["labelled_tokens"] if trainer.objective.labelled_head else None,
                }
            )
    if dist_info.is_main:
        Path(args.out).write_text(json.dumps({"records": records}))


if __name__ == "__main__":
    main()
