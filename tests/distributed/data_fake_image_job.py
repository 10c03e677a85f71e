"""One rank of test_data_fake_image.py: real DeepSpeed ZeRO-3, rank 0 trains on image samples and
rank 1 on text-only samples, with or without the collator's fake image.

    torchrun --nproc_per_node 2 data_fake_image_job.py DATA_JSONL OUT_DIR fake|nofake MODEL_DIR...
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers.integrations import HfDeepSpeedConfig

from ntil_ds.data import IGNORE_INDEX, Collator, ConversationDataset, load_processor

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition every tensor
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def main() -> None:
    data_file, out_dir, mode, *model_dirs = sys.argv[1:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    results = {}
    for model_dir in model_dirs:
        keep_alive = HfDeepSpeedConfig(DS_CONFIG)  # partition at construction (transformers keeps a weakref)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
        processor = load_processor(model_dir)
        dataset = ConversationDataset(data_file, processor, max_seq_len=256)
        collator = Collator(processor, fake_image=mode == "fake")
        ids = [0, 1] if rank == 0 else [2, 3]  # lines 1-2 show an image, lines 3-4 are text only
        losses = []
        for _ in range(2):
            batch = collator([dataset[i] for i in ids])
            targets = batch.pop("targets")  # aligned with the logits in the data
            logits = engine(**batch).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
            )
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[Path(model_dir).name] = {"losses": losses, "keys": sorted(batch)}
        del engine, keep_alive
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    from ntil_ds.dist import exit_process

    main()
    exit_process(0)  # as launch/train.py ends a rank: a plain exit can abort in gloo's threads (exit_process)
