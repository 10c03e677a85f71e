"""Generate a synthetic numeric task as train/val/test JSONL (+ PNG images), offline and seeded.

    python launch/make_data.py clock --n 2000 --out data/clock --seed 0
    python launch/make_data.py arithmetic --n 4000 --out data/arithmetic-easy --difficulty easy

Tasks: clock, boxes, chart, arithmetic (see ntil_ds/data/synthetic.py). Train with
`data.train_file=data/clock/train.jsonl`; score with `python launch/evaluate.py --split data/clock/test.jsonl`.
"""

from __future__ import annotations

import argparse
import time

from ntil_ds.data.synthetic import DIFFICULTIES, TASKS, write_dataset


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--n", type=int, required=True, help="samples over all splits (80/10/10)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--difficulty",
        choices=DIFFICULTIES,
        default="standard",
        help="easy: small enough for a tiny CPU model",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    paths = write_dataset(args.task, args.n, args.out, seed=args.seed, difficulty=args.difficulty)
    seconds = time.perf_counter() - started
    for split, path in paths.items():
        print(f"{split}: {path}")
    print(f"{args.n} {args.task} samples in {seconds:.1f} s ({args.n / seconds:.0f} samples/s)")


if __name__ == "__main__":
    main()
