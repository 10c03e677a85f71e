"""Score an exported Hugging Face model folder on a split: greedy answers, the task's metrics.

    python launch/evaluate.py --model runs/demo/export --split data/clock/test.jsonl

A split is any input the trainer reads (docs/data.md): a JSONL file, a .parquet file, a folder of
.parquet shards or a `datasets` save_to_disk folder, read by the trainer's reader.

Loads with plain `from_pretrained` (no DeepSpeed), generates the last assistant answer of every line
from what comes before it (batched, greedy), scores it with `ntil_ds.scoring.score` and writes a JSON
report (metrics + every prediction) next to the model, or to `--out`. The task comes from `--task` or
the first line's (or row's) "task" key (written by launch/make_data.py). The work is done by
ntil_ds.evaluation.generate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ntil_ds.data import DataError
from ntil_ds.evaluation.generate import score_exported_model, task_of, write_report


def print_table(report: dict) -> None:
    metrics = report["metrics"]
    width = max(len(name) for name in metrics)
    print(f"{report['task']} on {report['split']} ({report['samples_per_second']:.1f} samples/s)")
    for name, value in metrics.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)  # None: nothing parsed
        print(f"  {name:<{width}}  {shown}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, type=Path, help="exported Hugging Face model folder")
    parser.add_argument(
        "--split",
        required=True,
        type=Path,
        help="split to score: JSONL, .parquet, a folder of shards or a save_to_disk folder",
    )
    parser.add_argument(
        "--task", help="metrics to use: clock, boxes, chart, arithmetic (default: the lines' task)"
    )
    parser.add_argument("--processor", type=Path, help="processor folder, if not the model folder")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--on-bad-sample", default="error", choices=["error", "skip"])
    parser.add_argument("--out", type=Path, help="report path (default: <model>/eval_<split name>.json)")
    args = parser.parse_args(argv)

    try:
        task = args.task or task_of(args.split)
    except DataError as e:
        raise SystemExit(str(e)) from None
    report = score_exported_model(
        args.model,
        args.split,
        task,
        processor_dir=args.processor,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        on_bad_sample=args.on_bad_sample,
    )
    out = write_report(report, args.out or args.model / f"eval_{args.split.stem}.json")
    print_table(report)
    print(f"report: {out}")
    return report


if __name__ == "__main__":
    main()
