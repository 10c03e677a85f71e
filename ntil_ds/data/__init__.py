"""Data: conversations in (JSONL, Parquet, shard folders, save_to_disk folders: `read_samples`), masked
and padded batches out; synthetic numeric tasks.

How the parts meet (the trainer does this)::

    processor = load_processor(model_dir)
    dataset = ConversationDataset("data/clock/train.jsonl", processor, max_seq_len=512)
    collator = Collator(processor, fake_image=True)
    sampler = ResumableDistributedSampler(len(dataset), dp_rank, dp_size, seed=0)
    batch = collator([dataset[i] for i in itertools.islice(sampler, 4)])
    logits = model(**{k: v for k, v in batch.items() if k != "targets"}).logits  # targets: aligned
"""

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.collate import Collator
from ntil_ds.data.dataset import ConversationDataset, DataReport
from ntil_ds.data.encoding import render
from ntil_ds.data.processor import is_multimodal, load_processor, tokenizer_of
from ntil_ds.data.prompts import prompt_batch, split_last_answer
from ntil_ds.data.records import BadSample, Conversation, DataError, read_jsonl
from ntil_ds.data.sampler import ResumableDistributedSampler
from ntil_ds.data.sources import read_samples

__all__ = [
    "IGNORE_INDEX",
    "BadSample",
    "Collator",
    "Conversation",
    "ConversationDataset",
    "DataError",
    "DataReport",
    "ResumableDistributedSampler",
    "is_multimodal",
    "load_processor",
    "prompt_batch",
    "read_jsonl",
    "read_samples",
    "render",
    "split_last_answer",
    "tokenizer_of",
]
