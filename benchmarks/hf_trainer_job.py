"""The baseline of benchmarks/train_step.py: the same recipe through the Hugging Face Trainer.

    torchrun --standalone --nproc_per_node 2 benchmarks/hf_trainer_job.py --out times.json \
        --config configs/train/tiny_qwen2vl_clock.yaml [key=value ...]

Same model (ntil_ds.model.load_model: dtype, attention, freezing, ZeRO-3 init), same data and
collation (ntil_ds.data), same merged DeepSpeed config (ntil_ds.ds_config.merge_deepspeed_config, which
the Trainer's DeepSpeed integration checks against its own arguments), same optimizer settings and
cosine schedule; the loss is the model's own cross-entropy (``labels=`` passed to the forward).
Rank 0 writes one record per optimizer step to ``--out``: the time from the Trainer's
``on_step_begin`` (its micro-batches already fetched) to ``on_step_end``, and the input tokens of the
step over all ranks, which is what launch/train.py's ``step_time_s`` / ``tokens_per_s`` measure.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, help="JSON file for the per-step records (rank 0)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ntil_ds.config import gradient_accumulation_steps
    from ntil_ds.constants import IGNORE_INDEX
    from ntil_ds.data import Collator, ConversationDataset, load_processor
    from ntil_ds.ds_config import resolve_run
    from ntil_ds.engine import init_distributed, peak_memory_mib
    from ntil_ds.model import load_model

    cfg, ds_config, dist_info = resolve_run(args.config, args.overrides)
    # The process group first (as launch/train.py does): ZeRO-3 init partitions over it.
    init_distributed()
    o = cfg.optim
    # Created before the model: the Trainer's DeepSpeed config turns on ZeRO-3 init for it.
    training_args = TrainingArguments(
        output_dir=str(Path(cfg.output_dir)),
        per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps(cfg, dist_info.dp_size),
        max_steps=cfg.train.max_steps,
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_epsilon=o.eps,
        max_grad_norm=o.grad_clip,
        lr_scheduler_type="cosine",
        warmup_steps=o.warmup_steps,
        bf16=cfg.model.dtype == "bfloat16",
        fp16=cfg.model.dtype == "float16",
        deepspeed=ds_config,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        seed=cfg.train.seed,
        logging_steps=cfg.train.log_every,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=cfg.data.num_workers,
        disable_tqdm=True,
    )
    torch.manual_seed(cfg.train.seed)
    processor = load_processor(cfg.model.processor or cfg.model.name_or_path)
    # created on the GPU it trains on (ZeRO-2: no zero.Init), not on the CPU and then moved
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    loaded = load_model(cfg.model, ds_config, device)
    dataset = ConversationDataset(
        cfg.data.train_file, processor, cfg.data.max_seq_len, on_bad_sample=cfg.data.on_bad_sample
    )
    collator = Collator(processor, fake_image=cfg.data.fake_image)

    def with_hf_labels(samples):
        # HF models take unaligned labels= and shift them themselves: undo the data's alignment. The
        # first position, never a target, is ignored; HF's loss is then exactly the trainer's.
        batch = collator(samples)
        targets = batch.pop("targets")
        batch["labels"] = torch.nn.functional.pad(targets[:, :-1], (1, 0), value=IGNORE_INDEX)
        return batch

    class CountingTrainer(Trainer):
        """Counts the input tokens each optimizer step consumes on this rank."""

        step_tokens = 0.0

        def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *rest: Any, **kw: Any):
            self.step_tokens += float(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *rest, **kw)

    records: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # this step's peak
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels done, as ours ends on its host read
            elapsed = time.perf_counter() - self.started  # taken before the all_reduce below
            # On the Trainer's device: NCCL (the CUDA backend) cannot all_reduce a CPU tensor.
            tokens = torch.tensor([trainer.step_tokens], dtype=torch.float64, device=trainer.args.device)
            if dist.is_initialized():
                dist.all_reduce(tokens)
            trainer.step_tokens = 0.0
            records.append(
                {
                    "step": state.global_step,
                    "step_time_s": elapsed,
                    "tokens": float(tokens),
                    "peak_mem_mib": peak_memory_mib(trainer.args.device),
                }
            )

    trainer = CountingTrainer(
        model=loaded.model,
        args=training_args,
        train_dataset=dataset,
        data_collator=with_hf_labels,
        callbacks=[StepTimer()],
    )
    result = trainer.train()
    if dist_info.is_main:
        Path(args.out).write_text(
            json.dumps(
                {"records": records, "train_loss": result.training_loss, "world_size": dist_info.world_size}
            )
        )
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
