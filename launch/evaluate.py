"""Score an exported Hugging Face model folder on a JSONL split: greedy answers, the task's metrics.

    python launch/evaluate.py --model runs/demo/export --split data/clock/test.jsonl

Loads with plain `from_pretrained` (no DeepSpeed), generates the last assistant answer of every line
from what comes before it (batched, greedy), scores it with `ntil_ds.metrics.score` and writes a JSON
report (metrics + every prediction) next to the model, or to `--out`. The task comes from `--task` or
the lines' "task" key (written by launch/make_data.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig

from ntil_ds.data import ConversationDataset, load_processor, prompt_batch, split_last_answer, tokenizer_of
from ntil_ds.metrics import score
from ntil_ds.model.parts import auto_model_class


def evaluate(
    model, processor, dataset: ConversationDataset, task: str, batch_size: int, max_new_tokens: int
) -> dict:
    """Greedy-generate every sample's last answer and score the lot; returns the report."""
    tokenizer = tokenizer_of(processor)
    device = next(model.parameters()).device
    rows = []
    started = time.perf_counter()
    with tqdm(total=len(dataset), desc="generating", unit="sample") as progress:
        for start in range(0, len(dataset), batch_size):
            conversations = dataset.conversations[start : start + batch_size]
            batch = {k: v.to(device) for k, v in prompt_batch(processor, conversations).items()}
            with torch.no_grad():
                output = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new_tokens = output[:, batch["input_ids"].shape[1] :]
            answers = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            for conversation, answer in zip(conversations, answers, strict=True):
                reference = split_last_answer(conversation)[2]
                rows.append(
                    {"source": conversation.source, "reference": reference, "prediction": answer.strip()}
                )
            progress.update(len(conversations))
    seconds = time.perf_counter() - started
    metrics = score(task, [r["prediction"] for r in rows], [r["reference"] for r in rows])
    return {
        "task": task,
        "split": str(dataset.path),
        "data": dataset.report.summary(),
        "metrics": metrics,
        "samples_per_second": len(rows) / seconds,
        "samples": rows,
    }


def task_of(split: Path) -> str:
    """The "task" key of the split's first line (written by launch/make_data.py)."""
    with split.open(encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), "{}")
    task = json.loads(first).get("task")  # optional key: absent in user data
    if not task:
        raise SystemExit(
            f"{split}: lines have no 'task' key; give --task (clock, boxes, chart, arithmetic, ...)"
        )
    return task


def load_model(model_dir: Path, dtype: str):
    config = AutoConfig.from_pretrained(model_dir)
    auto_class = auto_model_class("auto", config)  # an MLLM when the config has a vision part
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = auto_class.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


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
        "--split", required=True, type=Path, help="JSONL file to score (e.g. data/clock/test.jsonl)"
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

    task = args.task or task_of(args.split)
    processor = load_processor(args.processor or args.model)
    dataset = ConversationDataset(
        args.split, processor, max_seq_len=1_000_000, on_bad_sample=args.on_bad_sample, show_progress=True
    )
    model = load_model(args.model, args.dtype)
    report = evaluate(model, processor, dataset, task, args.batch_size, args.max_new_tokens)
    report["model"] = str(args.model)
    out = args.out or args.model / f"eval_{args.split.stem}.json"
    # strict JSON: a mean over no parsed answers is NaN in Python, null in the report
    report["metrics"] = {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in report["metrics"].items()
    }
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print_table(report)
    print(f"report: {out}")
    return report


if __name__ == "__main__":
    main()
