"""A transformers.Trainer job with NTIL through ntil_ds.integrations (launched by the deepspeed launcher on
2 CPU ranks by tests/distributed/test_integrations_trainer.py).

The Trainer's own DeepSpeed integration runs ZeRO-3 from the JSON the ntil-ds run of the same recipe reads
(its batch, clipping and optimizer keys left to the Trainer: "auto"). The samples are ntil-ds's encoding of the data
file, collated by its collator (so both sides see the same tensors: padding, images, the fake image of a
text-only micro-batch), the targets handed to the Trainer as Hugging Face labels (unshifted), and in the
order that gives each rank, at each micro-step, the micro-batch ntil-ds's sampler gives it.

Writes the Trainer's log history (each step's loss, grad_norm and NTIL parts) as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--deepspeed-json", required=True, help="the recipe's DeepSpeed JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--head", choices=["logits", "labelled"], default="logits")
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()

    import os

    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Trainer, TrainingArguments

    from ntil_ds.data import Collator, ConversationDataset, is_multimodal, load_processor
    from ntil_ds.integrations import attach_ntil

    # The recipe's JSON holds no batch sizes, clipping or optimizer (ntil-ds merges them): the Trainer's are "auto"
    deepspeed = json.loads(Path(args.deepspeed_json).read_text())
    deepspeed.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                     train_batch_size="auto", gradient_clipping="auto")  # fmt: skip

    # accelerate gives DeepSpeed no process group on a machine without an accelerator (its backend is None
    # there: one process). A state made first over gloo, which the Trainer then uses (accelerate's documented
    # use_configured_state), is DeepSpeed on 2 ranks; on GPUs none of this is needed.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    processor = load_processor(args.model)
    encoded = ConversationDataset(args.data, processor, args.max_seq_len)
    collator = Collator(processor)
    world = 2
    per_round = args.micro * world
    # Trainer sample j goes to rank (j // micro) % world at round j // per_round; ntil-ds's sampler gives rank r
    # the stream positions r, r + world, ...: so j is the position (round * micro + j % micro) * world + rank.
    order = [
        ((j // per_round) * args.micro + j % args.micro) * world + (j // args.micro) % world
        for j in range(args.steps * args.accumulate * per_round)
    ]

    class InRanksOrder(torch.utils.data.Dataset):
        def __len__(self):
            return len(order)

        def __getitem__(self, j):
            return encoded[order[j]]

    def hugging_face_batch(samples):
        batch = collator(samples)
        targets = batch.pop("targets")  # aligned: targets[t] is the token at t + 1
        batch["labels"] = F.pad(targets[:, :-1], (1, 0), value=-100)  # Hugging Face's: the token at t
        return batch

    model_class = AutoModelForImageTextToText if is_multimodal(processor) else AutoModelForCausalLM
    model = model_class.from_pretrained(args.model, dtype=torch.float32)
    training = TrainingArguments(
        output_dir=str(Path(args.out).parent / "hf_out"), deepspeed=deepspeed, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.accumulate, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_epsilon=args.eps, optim="adamw_torch",
        max_grad_norm=1e9, logging_steps=1, report_to=[], save_strategy="no", train_sampling_strategy="sequential",
        remove_unused_columns=False, dataloader_num_workers=0, seed=0,
        accelerator_config={"use_configured_state": True},
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=training, train_dataset=InRanksOrder(), data_collator=hugging_face_batch
    )
    attach_ntil(trainer, processor, head=args.head, ntil_lambda=0.3, gumbel_noise_scale=0.0)
    trainer.train()
    if trainer.is_world_process_zero():
        Path(args.out).write_text(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    from ntil_ds.dist import exit_process

    main()
    exit_process(0)  # as launch/train.py ends a rank: a plain exit can abort in gloo's threads (exit_process)
