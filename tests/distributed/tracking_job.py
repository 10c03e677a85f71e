"""A small real training job that tracks itself the way ntil_ds/trainer.py does (run by torchrun).

Tiny MLP, DistributedDataParallel on gloo, SGD; rank 0 tracks, every rank calls the tracker. A
checkpoint (model, optimizer, step, MLflow run id) is saved every ``--save-every`` steps; a job started
on an output folder with a checkpoint resumes from it, passing the saved run id to ``build_tracker``.

Test hooks: ``--crash-after N`` ends every rank with os._exit right after step N (a preemption: no
``finish``, no checkpoint); ``--hold-at N --hold-file F`` waits after step N until F exists (the test
kills and restarts the tracking server meanwhile).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ntil_ds.config import Config, TrackingConfig, flatten, save_config
from ntil_ds.dist import DistInfo, exit_process
from ntil_ds.tracking import build_tracker, default_tags


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--uri", default="")
    parser.add_argument("--experiment", default="tracking-test")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--crash-after", type=int, default=0)
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE")
    parser.add_argument("--log-model", action="store_true")
    args = parser.parse_args()

    info = DistInfo.from_env()
    dist.init_process_group("gloo")
    if info.is_main:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = Config(
        output_dir=str(args.output_dir),
        tracking=TrackingConfig(uri=args.uri, experiment=args.experiment, log_model=args.log_model),
    )
    cfg.train.max_steps = args.steps
    out = args.output_dir
    holds = {int(step): Path(file) for step, file in (hold.split(":", 1) for hold in args.hold)}
    ckpt_path = out / "checkpoint.pt"

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start_step, run_id = 0, None
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step, run_id = ckpt["step"], ckpt["run_id"]

    tracker = build_tracker(
        cfg.tracking,
        is_main=info.is_main,
        output_dir=out,
        run_id=run_id,
        tags=default_tags(info, "tiny-mlp", os.environ),
    )
    tracker.log_params(flatten(cfg))
    if info.is_main:
        tracker.log_artifact(save_config(cfg, out / "config.yaml"))

    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(step, info.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        tracker.log_metrics(
            {
                "train/loss": loss.item(),
                "train/grad_norm": grad_norm.item(),
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/step_time_s": time.perf_counter() - t0,
            },
            step=step,
        )
        if step % args.eval_every == 0:
            with torch.no_grad():
                ex, ey = batch(10_000 + step, 0)
                tracker.log_metrics(
                    {"eval/loss": torch.nn.functional.mse_loss(model(ex), ey).item()}, step=step
                )
        if step % args.save_every == 0:
            if info.is_main:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "run_id": tracker.run_id,
                }
                torch.save(state, ckpt_path.with_suffix(".tmp"))
                ckpt_path.with_suffix(".tmp").replace(ckpt_path)
            dist.barrier()
        if step == args.crash_after:
            os._exit(3)  # preempted: no finish(), no final checkpoint
        if step in holds:
            while not holds[step].exists():
                time.sleep(0.2)

    if info.is_main and args.log_model:
        export = out / "export"
        export.mkdir(exist_ok=True)
        torch.save(model.module.state_dict(), export / "model.pt")
        (export / "config.json").write_text('{"kind": "tiny-mlp"}')
        tracker.log_artifact(export, "model")
    # As the trainer ends a job (ntil_ds.engine.leave_process_group): the ranks leave the group together,
    # then rank 0 delivers its tracking backlog alone.
    dist.barrier()
    dist.destroy_process_group()
    tracker.finish("FINISHED")


if __name__ == "__main__":
    main()
    exit_process(0)  # as launch/train.py: no interpreter finalization racing gloo's worker threads
