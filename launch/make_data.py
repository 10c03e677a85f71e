"""Generate a synthetic numeric task as train/val/test JSONL (+ PNG images), offline and seeded.

    python launch/make_data.py clock --n 2000 --out data/clock --seed 0
    python launch/make_data.py arithmetic --n 4000 --out data/arithmetic-easy --difficulty easy
    python launch/make_data.py mix --parts clock:easy:3000,digits:standard:2000 --out data/pretrain

Tasks: clock, boxes, chart, digits, arithmetic (see ntil_ds/data/synthetic.py); `mix` writes several
TASK:DIFFICULTY:N parts, each in its own folder, and their splits shuffled together
(ntil_ds/data/mixture.py; what configs/train/tiny_qwen2vl_pretrain.yaml trains on). Train with
`data.train_file=data/clock/train.jsonl`; score with `python launch/evaluate.py --split data/clock/test.jsonl`.
"""

from __future__ import annotations

import argparse
import time

from ntil_ds.data.mixture import parse_parts, write_mixture
from ntil_ds.data.synthetic import DIFFICULTIES, TASKS, write_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("task", choices=(*TASKS, "mix"))
    parser.add_argument("--n", type=int, help="samples over all splits (80/10/10); not with mix")
    parser.add_argument(
        "--parts", help="mix only: TASK:DIFFICULTY:N,... e.g. clock:easy:2000,boxes:standard:1000"
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--difficulty",
        choices=DIFFICULTIES,
        default="standard",
        help="easy: small enough for a tiny CPU model; easy-alt: the easy task drawn in a held-out style",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.task == "mix":
        if not args.parts or args.n is not None:
            parser.error("mix takes --parts TASK:DIFFICULTY:N,... (and no --n: each part has its own)")
        try:
            parts = parse_parts(args.parts)
        except ValueError as err:
            parser.error(str(err))
        n = sum(part.n for part in parts)
        paths = write_mixture(parts, args.out, seed=args.seed)
        what = f"{n} samples of {len(parts)} parts"
    else:
        if args.n is None or args.parts:
            parser.error(f"{args.task} takes --n (--parts is for mix)")
        n = args.n
        paths = write_dataset(args.task, n, args.out, seed=args.seed, difficulty=args.difficulty)
        what = f"{n} {args.task} samples"
    seconds = time.perf_counter() - started
    for split, path in paths.items():
        print(f"{split}: {path}")
    print(f"{what} in {seconds:.1f} s ({n / seconds:.0f} samples/s)")


if __name__ == "__main__":
    main()
