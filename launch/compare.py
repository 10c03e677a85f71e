"""Does NTIL help on this task? Train one recipe under several losses and seeds, score every run on the
test split, and compare.

    python launch/compare.py --config configs/train/tiny_qwen2_arithmetic.yaml \\
        --losses ce,emd,ntil,ntl --seeds 0,1,2 [--out outputs/compare/arith] [key=value ...]

Each (loss, seed) is a real training job through the `deepspeed` launcher (`--nproc` CPU processes, as
launch/quickstart.py runs it) with `loss.name` and `train.seed` set, then its exported model is scored
with greedy generation on the test split (the task's metrics). A loss may carry its own overrides:
`ntil:loss.ntil_lambda=0.6` is a fourth entry next to `ntil`.

Writes under `--out`: `results.json` (every run: status, metrics, wall times, error if it failed;
and mean/std per loss), `table.md` (each metric as mean +- std over seeds, per loss), `comparison.png`
(the same with error bars), the losses paired seed by seed against CE and the controls (answer-ignoring
constants; `--shuffled-n` test items shown other items' images, image tasks; docs/comparison.md),
`runs/<loss>-seed<seed>/` (each job's folder and log), and one MLflow parent
run (the comparison) with a child run per training job (`--out`/mlflow.db unless tracking.uri or
MLFLOW_TRACKING_URI says otherwise). A run that fails is reported in all of them, never dropped; the
exit code is 1 when any run failed. The work is done by ntil_ds.comparison.

`--tiny-model KIND[:SIZE]` and `--data TASK:N[:DIFFICULTY]` first write a tiny model folder and a
synthetic dataset under `--out` and point the recipe at them (what the small recipes need on a fresh
clone). The default test split is `test.jsonl` next to `data.train_file`.

`--lr-grid 1.5e-4,3e-4,6e-4 --select-seed 100` first trains each loss at every rate on the selection seed,
scores it on the validation split (data.eval_file, never the test split) and runs the paired seeds at the
rate with the best validation score; results.json records the choice (lr_selection).

`--merge GRID [GRID ...] --out OUT` reads grids run apart as one (a grid extended later with more
seeds, other losses run beside it on the same test split, compared by content hash): their runs and
curves in one results.json, table.md and plots under OUT, nothing trained again (ntil_ds.comparison.merge).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ntil_ds.comparison.grid import Comparison, GridStopped
from ntil_ds.comparison.lr_select import parse_lr_grid
from ntil_ds.comparison.merge import merge_comparisons
from ntil_ds.comparison.plan import plan_comparison, prepare_inputs
from ntil_ds.comparison.results import parse_loss_specs, parse_seeds
from ntil_ds.config import ConfigError
from ntil_ds.jobs import REPO_ROOT

DEFAULT_JOBS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="training recipe (configs/train/*.yaml)")
    parser.add_argument("--losses", default="ce,emd,ntil,ntl", help="comma-separated loss.name values")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--out", help="output folder (default: outputs/compare/<recipe name>)")
    parser.add_argument("--nproc", type=int, default=2, help="training processes per job (CPU ranks)")
    parser.add_argument(
        "--test",
        help="test split: JSONL, .parquet, shard folder or save_to_disk folder (default: test.jsonl next to "
        "data.train_file)",
    )
    parser.add_argument("--task", help="metrics to use (default: the test lines' task key)")
    parser.add_argument("--tiny-model", help="first write a tiny model folder: KIND[:SIZE], e.g. qwen2:small")
    parser.add_argument(
        "--data", help="first write synthetic data: TASK:N[:DIFFICULTY], e.g. arithmetic:4000:easy"
    )
    parser.add_argument(
        "--shuffled-n",
        type=int,
        default=200,
        help="test items of the shuffled-input check (each export shown other items' images; image "
        "tasks only; 0 turns it off)",
    )
    parser.add_argument(
        "--lr-grid",
        help="choose each loss's optim.lr first: these rates, on --select-seed, scored on the validation "
        "split (data.eval_file, never test); e.g. 1.5e-4,3e-4,6e-4",
    )
    parser.add_argument(
        "--select-seed", type=int, help="train.seed of the lr selection runs (not in --seeds)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"training jobs at once, each with the cores shared out (default {DEFAULT_JOBS}: the faster on "
        "2 cores, docs/comparison.md)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="threads per training rank, the same for every job (default: cores / (jobs x nproc)); a grid "
        "started again must use the same",
    )
    parser.add_argument("--runs", help="where the jobs' folders go (exports, logs; default OUT/runs)")
    parser.add_argument(
        "--records",
        help="where each finished job's small record goes, read by a grid started again and by --merge "
        "(default OUT/records)",
    )
    parser.add_argument(
        "--retry-failed", action="store_true", help="train again the jobs whose record says they failed"
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides for every run, e.g. train.max_steps=50"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="GRID",
        help="instead of training: merge these grids' results into --out",
    )
    args = parser.parse_args(argv)
    if args.merge:
        if args.config or args.overrides or args.tiny_model or args.data or not args.out:
            parser.error("--merge reads finished grids: give it the grids' folders and --out, nothing else")
        merged = Path(args.out).resolve()
        report = merge_comparisons([Path(g).resolve() for g in args.merge], merged)
        print(f"{(merged / 'table.md').read_text()}\nresults: {merged / 'results.json'}")
        return 1 if report["failed"] else 0
    if not args.config:
        parser.error("--config is required (or --merge GRID ... to read finished grids)")
    out = Path(args.out or REPO_ROOT / "outputs" / "compare" / Path(args.config).stem).resolve()
    specs, seeds = parse_loss_specs(args.losses), parse_seeds(args.seeds)
    out.mkdir(parents=True, exist_ok=True)
    try:
        plan = plan_comparison(
            Path(args.config).resolve(),
            out,
            specs,
            seeds,
            nproc=args.nproc,
            overrides=[*prepare_inputs(out, args.tiny_model, args.data), *args.overrides],
            test_split=Path(args.test) if args.test else None,
            task=args.task,
            command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            shuffled_n=args.shuffled_n,
            lr_grid=parse_lr_grid(args.lr_grid),
            select_seed=args.select_seed,
            jobs=args.jobs,
            threads=args.threads,
            runs_dir=Path(args.runs).resolve() if args.runs else None,
            records=Path(args.records).resolve() if args.records else None,
            retry_failed=args.retry_failed,
        )
        report = Comparison(plan).run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except GridStopped as e:
        print(f"compare.py: stopped by {e}", file=sys.stderr)
        return 143 if str(e) == "SIGTERM" else 130
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
