"""Greedy answers to a split's questions, scored with the task's metrics (``ntil_ds.scoring``). A split
is any input the trainer reads (JSONL, .parquet, a folder of shards, a save_to_disk folder), read by
the same reader (ntil_ds/data/sources.py).

Works on any Hugging Face model object with ``generate`` (an exported folder loaded with plain
``from_pretrained``: :func:`load_exported_model`). The last assistant answer of every line is generated
from what comes before it, in batches, greedily; the report holds the metrics and every prediction.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from ntil_ds.data import (
    ConversationDataset,
    DataError,
    load_processor,
    prompt_batch,
    split_last_answer,
    tokenizer_of,
)
from ntil_ds.data.progress import progress
from ntil_ds.data.sources import first_value
from ntil_ds.scoring import score


def generate_and_score(
    model, processor, dataset: ConversationDataset, task: str, batch_size: int, max_new_tokens: int
) -> dict[str, Any]:
    """Greedy-generate every sample's last answer and score the lot; returns the report."""
    tokenizer = tokenizer_of(processor)
    device = next(model.parameters()).device
    rows = []
    started = time.perf_counter()
    # in a log file (a SLURM .out) one line every ~30 s, not one per batch
    with progress(total=len(dataset), desc="generating", unit="sample") as bar:
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
            bar.update(len(conversations))
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


def score_exported_model(
    model_dir: Path,
    split: Path,
    task: str,
    *,
    processor_dir: Path | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 32,
    dtype: str = "float32",
    on_bad_sample: str = "error",
) -> dict[str, Any]:
    """An exported folder's report on ``split``: what ``launch/evaluate.py`` prints and writes."""
    processor = load_processor(processor_dir or model_dir)
    dataset = ConversationDataset(
        split, processor, max_seq_len=1_000_000, on_bad_sample=on_bad_sample, show_progress=True
    )
    model = load_exported_model(model_dir, dtype)
    report = generate_and_score(model, processor, dataset, task, batch_size, max_new_tokens)
    report["model"] = str(model_dir)
    return report


def task_of(split: Path) -> str:
    """The "task" key of the split's first line or row (written by launch/make_data.py); any input the
    trainer reads (ntil_ds/data/sources.py)."""
    task = first_value(split, "task")  # optional key: absent in user data
    if not task:
        raise DataError(
            f"{split}: lines have no 'task' key; give --task (clock, boxes, chart, arithmetic, ...)"
        )
    return task


def load_exported_model(model_dir: Path, dtype: str):
    """An exported Hugging Face folder, without DeepSpeed, on the GPU when there is one, in eval mode."""
    config = AutoConfig.from_pretrained(model_dir)
    auto_class = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = auto_class.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def write_report(report: dict[str, Any], out: Path) -> Path:
    """Strict JSON (a mean over no parsed answers is NaN in Python, null in the report)."""
    report["metrics"] = {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in report["metrics"].items()
    }
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return out
