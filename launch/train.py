"""Train with NTIL on DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 launch/train.py --config configs/train/qwen2vl_7b_clock.yaml train.max_steps=500
    torchrun --nproc_per_node 8 launch/train.py --config configs/train/qwen2vl_7b_clock.yaml
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 launch/train.py \
        --config configs/train/tiny_qwen2vl_clock.yaml          # the tiny CPU demo

Exit codes: 0 done; 85 (EXIT_PREEMPTED) checkpointed after a preemption request, requeue me;
2 bad config or data; 1 anything else (a non-finite loss, a lost peer included).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ntil_ds.config import ConfigError
from ntil_ds.dist import DistInfo, exit_process, is_communication_error, unanswering_ranks
from ntil_ds.ds_config import resolve_run
from ntil_ds.preemption import EXIT_PREEMPTED, PreemptionWatcher

EXIT_CONFIG_ERROR = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="recipe YAML (configs/train/*.yaml)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=10")
    return parser.parse_args(argv)


def report(dist_info: DistInfo, kind: str, error: Exception | str) -> None:
    """Every rank prints the reason it stops: the launcher kills the other ranks as soon as one exits,
    so a message left to rank 0 alone can be lost when another rank is faster."""
    print(f"[rank {dist_info.rank}] {kind}: {error}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist_info = DistInfo.from_env()
    logging.basicConfig(
        level=logging.INFO if dist_info.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {dist_info.rank}] %(levelname)s %(name)s: %(message)s",
    )
    # Everything a recipe can get wrong is checked here, before any process group or model exists.
    try:
        cfg, ds_config, dist_info = resolve_run(args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        report(dist_info, "config error", e)
        return EXIT_CONFIG_ERROR

    # After the checks: a bad recipe fails in a second, before deepspeed, transformers and mlflow import.
    from ntil_ds.checkpoint import CheckpointWriteError
    from ntil_ds.data import DataError
    from ntil_ds.engine import init_distributed
    from ntil_ds.nonfinite import NonFiniteLossError
    from ntil_ds.tracking import default_tags
    from ntil_ds.trainer import Trainer

    init_distributed()
    watcher = PreemptionWatcher(flag_file=os.environ.get("NTIL_PREEMPT_FLAG"))
    try:
        trainer = Trainer(
            cfg,
            ds_config,
            dist_info,
            preemption=watcher,
            tracking_tags=default_tags(dist_info, cfg.model.name_or_path, os.environ),
        )
        result = trainer.fit()
    except (ConfigError, DataError) as e:  # found while building (a freeze flag, a bad data line)
        report(dist_info, "config error" if isinstance(e, ConfigError) else "data error", e)
        return EXIT_CONFIG_ERROR
    except (NonFiniteLossError, CheckpointWriteError) as e:
        report(dist_info, "error", e)
        return 1
    except RuntimeError as e:
        if not is_communication_error(e):
            raise
        report(dist_info, "lost contact with other ranks", e)
        # Say which peers are gone, not only "timed out" (docs/slurm.md). Also when a connection was closed
        # rather than timed out: a peer whose own collective timed out first closes its connections, so
        # which of the two a rank sees is a race between the ranks' timers.
        report(dist_info, "ranks that do not answer", unanswering_ranks())
        return 1
    finally:
        watcher.close()
    if result.status == "preempted":
        logging.getLogger("train").warning("preempted at step %d: checkpoint saved, exiting", result.step)
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    exit_process(main())
