"""launch/train.py's job with a loss, or only its gradient, that turns NaN on one rank at one
micro-batch (for the NaN tests).

    torchrun ... tests/distributed/nan_train.py --config R.yaml key=value ...
    (env: NAN_AT_STEP, NAN_ON_RANK, NAN_IN=loss|gradient)

The poisoned micro-batch is micro-batch 1 of step NAN_AT_STEP on rank NAN_ON_RANK. NAN_IN=gradient keeps
the loss finite and makes its backward NaN (an overflow in the backward). When the trainer stops
with NonFiniteLossError, this script exports the weights (a collective, so every rank joins) to
<output_dir>/after_nan, for the test to compare with the checkpoint of the step before, and exits 3.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from launch.train import parse_args
from ntil_ds.config import load_config
from ntil_ds.dist import DistInfo, exit_process
from ntil_ds.ds_config import load_deepspeed_json, merge_deepspeed_config
from ntil_ds.engine import init_distributed
from ntil_ds.export import export_hf_folder
from ntil_ds.nonfinite import NonFiniteLossError
from ntil_ds.trainer import Trainer

EXIT_STOPPED_ON_NAN = 3


class NanBackward(torch.autograd.Function):
    """Identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class PoisonedLoss:
    """The real loss, with a NaN (in the loss, or in its gradient only) on one rank at one micro-batch."""

    def __init__(self, loss_fn, grad_accum: int, step: int, rank: int, this_rank: int, where: str) -> None:
        self.loss_fn, self.grad_accum, self.where = loss_fn, grad_accum, where
        self.poisoned_call = (step - 1) * grad_accum + 1 if rank == this_rank else -1
        self.calls = 0

    def __getattr__(self, name: str):  # everything else is the real loss's
        return getattr(self.loss_fn, name)

    def __call__(self, *args, **kwargs):  # on whole logits (loss.logits=all)
        return self._poisoned(self.loss_fn(*args, **kwargs))

    def from_position_stats(self, *args, **kwargs):  # after the labelled head (the default)
        return self._poisoned(self.loss_fn.from_position_stats(*args, **kwargs))

    def _poisoned(self, out):
        if self.calls == self.poisoned_call and self.where == "gradient":
            out = dataclasses.replace(out, loss_sum=NanBackward.apply(out.loss_sum))
        elif self.calls == self.poisoned_call:
            nan = float("nan")
            out = dataclasses.replace(out, loss=out.loss * nan, loss_sum=out.loss_sum * nan)
        self.calls += 1
        return out


def main() -> int:
    args = parse_args()
    cfg = load_config(args.config, args.overrides)
    dist_info = DistInfo.from_env()
    ds_config = merge_deepspeed_config(cfg, load_deepspeed_json(cfg.deepspeed), dist_info.dp_size)
    init_distributed()
    trainer = Trainer(cfg, ds_config, dist_info)
    trainer.objective.loss_fn = PoisonedLoss(
        trainer.objective.loss_fn,
        trainer.grad_accum,
        int(os.environ["NAN_AT_STEP"]),
        int(os.environ["NAN_ON_RANK"]),
        dist_info.rank,
        os.environ.get("NAN_IN", "loss"),
    )
    try:
        trainer.fit()
    except NonFiniteLossError as error:
        print(f"[rank {dist_info.rank}] {error}", flush=True)
        export_hf_folder(
            trainer.engine, trainer.processor, Path(cfg.output_dir) / "after_nan", dist_info.is_main
        )
        return EXIT_STOPPED_ON_NAN
    return 0


if __name__ == "__main__":
    exit_process(main())  # as launch/train.py ends a rank
