"""A tiny Qwen2 LLM folder and text-only arithmetic data, for training runs that need no images."""

from __future__ import annotations

import json
import random
from pathlib import Path

from ntil_ds.tiny import build_tiny_model_folder


def tiny_qwen2_folder(out_dir: Path, extra_vocab_rows: int = 0) -> Path:
    """launch/make_tiny_model.py's qwen2 folder; ``extra_vocab_rows`` pads the embedding/head beyond
    the tokenizer (as Qwen2's 151936 rows do for 151665 tokens), e.g. to make a vocabulary that does
    not split evenly over tensor-parallel ranks."""
    folder = build_tiny_model_folder("qwen2", out_dir)
    if extra_vocab_rows:
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config["vocab_size"] += extra_vocab_rows
        config_path.write_text(json.dumps(config, indent=2))
    return folder


def write_sum_data(path: Path, n: int, seed: int = 0) -> Path:
    """``What is a+b?`` -> ``It is <a+b>``: digits plus a few word tokens in every answer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        messages = [
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": f"It is {a + b}"},
        ]
        lines.append(json.dumps({"messages": messages}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
