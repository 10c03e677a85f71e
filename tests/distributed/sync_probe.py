"""launch/train.py's job with every host sync of each optimizer step counted (for test_host_syncs.py).

    torchrun ... tests/distributed/sync_probe.py --config R.yaml key=value ...   (env: SYNC_REPORT=FILE)

A sync is a point where the CPU waits for the device: a call of ``ntil_ds.dist.read_to_host`` (the one
named reader), or an aten op that must look at device data on the host (``.item()``/``float()`` of a
tensor dispatch ``_local_scalar_dense``; ``nonzero``, ``masked_select``, ``unique`` ... have
data-dependent shapes). Each op is charged to the innermost frame of the project or of DeepSpeed that
asked for it. Counted per call of ``Trainer.train_step``; each rank writes its own report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from launch.train import parse_args
from ntil_ds import dist as ntil_dist
from ntil_ds import trainer as trainer_module
from ntil_ds.dist import DistInfo, exit_process
from ntil_ds.ds_config import resolve_run
from ntil_ds.engine import init_distributed
from ntil_ds.trainer import Trainer

# aten ops that make the host wait for the device (on CUDA); on CPU they run without waiting, which is
# why they are counted by name.
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "equal",
    "allclose",
    "is_nonzero",
}
REPO = Path(__file__).resolve().parents[2]


def _site() -> str:
    """The innermost frame in ntil_ds/, deepspeed/ or transformers/ that led here."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace(os.sep, "/")
        for root in ("ntil_ds/", "deepspeed/", "transformers/"):
            if f"/{root}" in path:
                return f"{root}{path.split('/' + root, 1)[1]}:{frame.name}"
    return "other"


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in SYNC_OPS:
            self.counts[f"{func._schema.name.split('::')[-1]} @ {_site()}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    args = parse_args()
    cfg, ds_config, dist_info = resolve_run(args.config, args.overrides)
    init_distributed()
    trainer = Trainer(cfg, ds_config, dist_info)
    steps: list[dict] = []
    reads = Counter()
    real_read = ntil_dist.read_to_host

    def counted_read(values):
        reads["read_to_host"] += 1
        return real_read(values)

    trainer_module.read_to_host = counted_read  # the trainer's own reference to the reader
    real_step = trainer.train_step

    def counted_step(micro_batches):
        reads.clear()
        with SyncCounter() as counter:
            metrics = real_step(micro_batches)
        steps.append({"micro_batches": len(micro_batches), "reads": dict(reads), "ops": dict(counter.counts)})
        return metrics

    trainer.train_step = counted_step
    trainer.fit()
    report = Path(os.environ["SYNC_REPORT"]).with_suffix(f".rank{DistInfo.from_env().rank}.json")
    report.write_text(json.dumps(steps, indent=1))
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    exit_process(main())
