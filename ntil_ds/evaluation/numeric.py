"""Numeric metrics while training: greedy answers to a fixed subset of ``data.eval_file``, scored with the
task's metrics (clock deviation, box IoU and Acc@0.5, MAE ...: ``ntil_ds.scoring``), every
``eval.generate_every`` steps and at the last step. The answers of each evaluation are written to
``<output_dir>/generated/step_XXXXXXXX.jsonl`` (rank 0).

Under ZeRO-3 every forward gathers the parameters collectively, so every rank must run the same forwards:

- the subset is split over the data-parallel ranks in batches that every rank runs in the same order and
  number (a rank that runs out repeats a sample, whose answer is dropped);
- batches with images come first and batches without after, on every rank alike, so no rank runs the
  vision tower while another does not;
- ``generate(synced_gpus=True)`` keeps a rank whose answers are done stepping with the others until all
  are (DeepSpeed's and Hugging Face's way to generate under ZeRO-3).

Under AutoTP's vocabulary-parallel head each rank's logits are one slice of the vocabulary; a logits
processor gathers the slices of the tensor-parallel group before the greedy choice (only the last
position's scores, ``[batch, vocabulary]`` per new token). The ranks of a group answer the same prompts.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor

from ntil_ds.config import Config
from ntil_ds.data import ConversationDataset, prompt_batch, split_last_answer, tokenizer_of
from ntil_ds.dist import DistInfo, all_gather_objects, all_gather_tensors, broadcast_from_main
from ntil_ds.evaluation.generate import task_of
from ntil_ds.objective import Objective
from ntil_ds.scoring import score

ANSWERS_DIR = "generated"  # under output_dir: each evaluation's answers, one JSONL per step
# Scores of generated answers that are not logged while training: teacher-forced evaluation logs a
# digit accuracy under these names already (ntil_ds/evaluation/teacher_forced.py).
_NOT_LOGGED = ("digit_acc",)


def plan_batches(
    has_image: list[bool], reader: int, readers: int, batch_size: int
) -> list[list[tuple[int, bool]]]:
    """This rank's batches as (subset position, answer counted) pairs, image batches first: every rank
    gets as many batches of each kind, in the same order (see the module docstring). A rank with fewer
    prompts of a kind repeats one of that kind, uncounted."""
    batches: list[list[tuple[int, bool]]] = []
    for kind in (True, False):
        positions = [i for i, image in enumerate(has_image) if image is kind]
        if not positions:
            continue
        per_rank = math.ceil(len(positions) / readers)
        mine = [(i, True) for i in positions[reader::readers]]
        mine += [(positions[0], False)] * (per_rank - len(mine))
        batches += [mine[start : start + batch_size] for start in range(0, per_rank, batch_size)]
    return batches


class FullVocabularyScores(LogitsProcessor):
    """Vocabulary-parallel generation: this rank's slice of the next-token scores -> the whole
    vocabulary's, gathered from the tensor-parallel group. ``sizes``: every group rank's slice width, in
    rank order (uneven splits are padded for the gather, then cut)."""

    def __init__(self, group, sizes: list[int]) -> None:
        self.group, self.sizes, self.width = group, sizes, max(sizes)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        padded = scores.new_full((scores.shape[0], self.width), float("-inf"))
        padded[:, : scores.shape[1]] = scores
        slices = all_gather_tensors(padded, self.group)
        return torch.cat([piece[:, :size] for piece, size in zip(slices, self.sizes, strict=True)], dim=1)


class NumericEval:
    """``run(step)`` generates and scores; ``due(step)`` says whether eval.generate_every asks for it."""

    def __init__(
        self, run: Config, dataset: ConversationDataset, processor, objective: Objective, dist_info: DistInfo
    ) -> None:
        cfg = run.eval
        self.processor, self.engine, self.dist, self.cfg = processor, objective.engine, dist_info, cfg
        self.max_steps, self.float_dtype, self.device = run.train.max_steps, objective.dtype, objective.device
        self.output_dir = Path(run.output_dir)
        vocab_shard = objective.vocab_shard
        self.task = cfg.task or task_of(dataset.path)
        self.subset = dataset.conversations[: cfg.generate_samples]
        self.references = [split_last_answer(c)[2] for c in self.subset]
        has_image = [bool(c.images) for c in self.subset]
        # whole rows: the ranks of a sequence-parallel group answer different prompts (a group generates each
        # once); those of a tensor-parallel group answer the same ones
        reader, readers = dist_info.rank // dist_info.tp_size, dist_info.world_size // dist_info.tp_size
        self.batches = plan_batches(has_image, reader, readers, cfg.batch_size)
        self.full_vocabulary = None
        if vocab_shard is not None:
            sizes = all_gather_objects(
                vocab_shard.vocab_end - vocab_shard.vocab_start, vocab_shard.process_group
            )
            self.full_vocabulary = FullVocabularyScores(vocab_shard.process_group, sizes)

    def due(self, step: int) -> bool:
        every = self.cfg.generate_every
        return bool(every) and (step % every == 0 or step == self.max_steps)

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        """COLLECTIVE: the scores of the subset's greedy answers (the same dict on every rank)."""
        started = time.perf_counter()
        tokenizer = tokenizer_of(self.processor)
        model = self.engine.module
        self.engine.eval()
        answers: dict[int, str] = {}
        for batch in self.batches:
            prompts = [self.subset[i] for i, _ in batch]
            inputs = {
                key: value.to(
                    self.device, dtype=self.float_dtype if value.is_floating_point() else value.dtype
                )
                for key, value in prompt_batch(self.processor, prompts).items()
            }
            output = model.generate(
                **inputs,
                max_new_tokens=self.cfg.max_new_tokens,
                do_sample=False,
                synced_gpus=self.dist.world_size > 1,  # ZeRO-3: every rank steps until all are done
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                logits_processor=[self.full_vocabulary] if self.full_vocabulary is not None else None,
            )
            texts = tokenizer.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            answers.update(
                {i: text.strip() for (i, counted), text in zip(batch, texts, strict=True) if counted}
            )
        self.engine.train()
        # Every rank's answers to rank 0 (the ranks of a tensor-parallel group answer alike)
        by_position: dict[int, str] = {}
        for part in all_gather_objects(answers):
            by_position.update(part)
        scores = None
        if self.dist.is_main:
            predictions = [by_position[i] for i in range(len(self.subset))]
            self._write_answers(step, predictions)
            scores = {
                name: float(value)
                for name, value in score(self.task, predictions, self.references).items()
                if not name.startswith(_NOT_LOGGED)
                and isinstance(value, (int, float))
                and math.isfinite(value)
            }
            scores["generate_s"] = time.perf_counter() - started
        return broadcast_from_main(scores)

    def _write_answers(self, step: int, predictions: list[str]) -> Path:
        """Every answer of this evaluation, for reading: ``<output_dir>/generated/step_XXXXXXXX.jsonl``."""
        path = self.output_dir / ANSWERS_DIR / f"step_{step:08d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = zip(self.subset, self.references, predictions, strict=True)
        path.write_text(
            "".join(
                json.dumps({"source": c.source, "reference": r, "prediction": p}) + "\n" for c, r, p in rows
            )
        )
        return path
