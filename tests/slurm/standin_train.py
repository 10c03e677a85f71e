"""A small real torch.distributed (gloo) training job that slurm/train.sh can launch in place of
launch/train.py (TRAIN_SCRIPT=tests/slurm/standin_train.py). It honours the same contract:

    standin_train.py --config RECIPE.yaml [key=value ...] [--local_rank=N]
    exit 0 when training completed, 85 (EXIT_PREEMPTED) after a preemption checkpoint

and the same preemption protocol (PreemptionWatcher at each step boundary, checkpoint on all ranks,
resume=auto from the newest complete checkpoint). It can also make one rank die (die_rank/die_at_step)
so that the tests can check that a dead rank ends the whole SLURM job quickly.

Recipe keys (flat YAML; key=value overrides win): output_dir, resume (auto|none), max_steps,
step_seconds (sleep per step, to give a test time to signal), die_rank, die_at_step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ntil_ds.dist import exit_process
from ntil_ds.preemption import EXIT_PREEMPTED, PreemptionWatcher

DEFAULTS = {
    "output_dir": "",
    "resume": "auto",
    "max_steps": 10,
    "step_seconds": 0.0,
    "die_rank": -1,
    "die_at_step": -1,
}


def load_recipe(path: str, overrides: list[str]) -> dict:
    recipe = dict(DEFAULTS)
    recipe.update(yaml.safe_load(Path(path).read_text()) or {})
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown key {key!r} (known: {', '.join(DEFAULTS)})")
        recipe[key] = yaml.safe_load(value)
    if not recipe["output_dir"]:
        raise SystemExit("output_dir is required")
    return recipe


def newest_checkpoint(output_dir: Path) -> Path | None:
    # A checkpoint is complete once its "done" marker exists (written after all ranks saved).
    done = sorted(output_dir.glob("ckpt-*/done"), key=lambda p: int(p.parent.name.split("-")[1]))
    return done[-1].parent if done else None


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The data of a step depends only on (step, rank): a resumed run sees what an uninterrupted one sees.
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 4, generator=gen)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 1.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args, overrides = parser.parse_known_args()
    recipe = load_recipe(args.config, overrides)
    out = Path(recipe["output_dir"])
    out.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Who this process is, as the launcher set it up (the multi-node launch test reads it).
    identity = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"])}
    identity["node"] = os.environ.get("SLURM_NODEID")
    (out / f"rank-{rank}.json").write_text(json.dumps(identity))
    watcher = PreemptionWatcher(flag_file=os.environ.get("NTIL_PREEMPT_FLAG"))

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    ckpt = newest_checkpoint(out) if recipe["resume"] == "auto" else None
    if ckpt is not None:
        state = torch.load(ckpt / "state.pt")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"[standin] resumed from {ckpt} at step {start}", flush=True)

    def save(step: int) -> None:
        path = out / f"ckpt-{step}"
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, path / "state.pt"
            )
        dist.barrier()  # every rank is past its save before the checkpoint counts as complete
        if rank == 0:
            (path / "done").touch()

    for step in range(start + 1, recipe["max_steps"] + 1):
        if rank == recipe["die_rank"] and step == recipe["die_at_step"]:
            print(f"[standin] rank {rank} dies at step {step}", flush=True)
            os._exit(3)
        x, y = batch(step, rank)
        optim.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": mean_loss.item() / world}) + "\n")
        time.sleep(recipe["step_seconds"])
        if watcher.requested():
            save(step)
            if rank == 0:
                print(
                    f"[standin] preempted ({watcher.reason}) after step {step}: checkpoint saved", flush=True
                )
            dist.destroy_process_group()
            return EXIT_PREEMPTED
    save(recipe["max_steps"])
    if rank == 0:
        print("[standin] training completed", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())  # as launch/train.py ends a rank
