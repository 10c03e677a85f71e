"""One process, no launcher: build the real Trainer, run evaluate(), and print how many forwards it made
and how many eval micro-batches there were (for test_single_process.py).

    python tests/distributed/eval_forward_probe.py --config R.yaml key=value ...
"""

from __future__ import annotations

import json
import math

from launch.train import parse_args
from ntil_ds.ds_config import resolve_run
from ntil_ds.engine import init_distributed
from ntil_ds.trainer import Trainer


def main() -> None:
    args = parse_args()
    cfg, ds_config, dist_info = resolve_run(args.config, args.overrides)
    init_distributed()
    trainer = Trainer(cfg, ds_config, dist_info)
    calls = 0
    real_forward = trainer.engine.forward

    def counting_forward(**batch):
        nonlocal calls
        calls += 1
        return real_forward(**batch)

    trainer.engine.forward = counting_forward
    metrics = trainer.evaluate()
    batches = math.ceil(len(trainer.eval_data) / cfg.train.micro_batch_size)
    print(json.dumps({"forwards": calls, "batches": batches, "loss": metrics["loss"]}))


if __name__ == "__main__":
    from ntil_ds.dist import exit_process

    main()
    exit_process(0)  # as launch/train.py ends a rank: a plain exit can abort in gloo's threads (exit_process)
