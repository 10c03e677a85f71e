"""transformers.Trainer's training step with its own cross-entropy, with NTIL as ``compute_loss_func`` (whole
logits) and with NTIL through the labelled head (ntil_ds.integrations.attach_ntil), at a vocabulary of
151,936 (Qwen2's), one process on the CPU.

    python -m benchmarks.trainer_routes            # ~2 minutes on 2 cores
    python -m benchmarks.trainer_routes --positions 2048 --repeats 5

One micro-batch of long prompts and short numeric answers (the shape of number fine-tuning data) through
``Trainer.training_step`` (forward, loss, backward), a narrow 2-layer Qwen2 so the output head dominates as
it does in a large model at long context. Per route: the median step time (routes interleaved, so a shared
machine's load hits all alike) and the peak extra memory of a step (the most bytes of tensors alive at once
above what was allocated before, counted by benchmarks.head_speed's dispatch mode: deterministic, unlike
the process's resident size). Ratios against the Trainer's own CE in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.head_speed import LiveTensorBytes

ROUTES = ("ce", "ntil_logits", "ntil_labelled")


def build(route: str, folder: Path, tokenizer, out: Path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from ntil_ds.integrations import attach_ntil

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(out / route), report_to=[], use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    if route != "ce":
        attach_ntil(
            trainer, tokenizer, head=route.removeprefix("ntil_"), kernel="torch", number_stage="eager"
        )
    return trainer


def batch(tokenizer, batch_size: int, positions: int, answer_tokens: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    digits = torch.tensor([tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    input_ids = torch.randint(0, len(tokenizer), (batch_size, positions), generator=generator)
    input_ids[:, -answer_tokens:] = digits[
        torch.randint(0, 10, (batch_size, answer_tokens), generator=generator)
    ]
    labels = torch.full_like(input_ids, -100)
    labels[:, -answer_tokens:] = input_ids[:, -answer_tokens:]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def step(trainer, inputs) -> float:
    trainer.model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    trainer.training_step(
        trainer.model, dict(inputs), num_items_in_batch=int((inputs["labels"][:, 1:] != -100).sum())
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ntil_ds.tiny import build_tiny_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model_folder("qwen2", Path(tmp) / "model")
        config = json.loads((folder / "config.json").read_text())
        config.update(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        from transformers import AutoConfig, AutoModelForCausalLM

        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        inputs = batch(tokenizer, args.batch, args.positions, args.answer_tokens)
        trainers = {route: build(route, folder, tokenizer, Path(tmp)) for route in ROUTES}
        for trainer in trainers.values():
            step(trainer, inputs)  # warm-up
        times = {route: [] for route in ROUTES}
        for _ in range(args.repeats):
            for route, trainer in trainers.items():
                times[route].append(step(trainer, inputs))
        peaks = {}
        for route, trainer in trainers.items():
            trainer.model.zero_grad(set_to_none=True)
            with LiveTensorBytes() as counter:
                step(trainer, inputs)
            peaks[route] = counter.peak
    result = {"shape": vars(args) | {"json": None}}
    for route in ROUTES:
        median = statistics.median(times[route])
        result[route] = {
            "step_s": median,
            "peak_mib": peaks[route] / 2**20,
            "time_vs_ce": median / statistics.median(times["ce"]),
            "memory_vs_ce": peaks[route] / peaks["ce"],
        }
        print(f"{route:14s} step {median:7.3f} s ({result[route]['time_vs_ce']:.2f}x CE)   peak "
              f"{result[route]['peak_mib']:8.1f} MiB ({result[route]['memory_vs_ce']:.2f}x CE)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
