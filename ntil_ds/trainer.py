"""The training loop: the one module that knows the order of things.

Read :meth:`Trainer.fit` top to bottom: it is the whole job. :meth:`Trainer._train_step` is one
optimizer step and holds the loss-normalization contract.

Files written to ``cfg.output_dir`` (rank 0):

- ``config.yaml`` (the resolved recipe) and ``deepspeed.json`` (the merged DeepSpeed config);
- ``metrics.jsonl``: one JSON object per line, ``{"split": "train", "step": 3, "loss": ..., "ce": ...,
  "ntil": ..., "emd": ..., "rel": ..., "mag": ..., "lr": ..., "grad_norm": ..., "tokens_per_s": ...}``
  and ``{"split": "eval", "step": ..., "loss": ..., "token_acc": ..., "digit_acc": ...}``. After a resume
  the steps past the checkpoint appear again: the last line of a step is the one that counts;
- ``checkpoints/step_XXXXXXXX/`` (see checkpoint.py) and ``export/`` (a Hugging Face folder).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from ntil_ds.checkpoint import (
    TrainerState,
    agree_on_resume_checkpoint,
    check_resume_config,
    load_checkpoint,
    save_checkpoint,
)
from ntil_ds.config import Config, ConfigError, flatten, gradient_accumulation_steps, save_config
from ntil_ds.data import (
    IGNORE_INDEX,
    Collator,
    ConversationDataset,
    ResumableDistributedSampler,
    load_processor,
    tokenizer_of,
)
from ntil_ds.data.packing import PACKING_KEYS, PackedCollator
from ntil_ds.data.steps import StepBatches, step_loader
from ntil_ds.dist import DistInfo
from ntil_ds.ds_config import write_deepspeed_config
from ntil_ds.engine import TrainingEngine, device_for, leave_process_group, peak_memory_mib
from ntil_ds.export import export_hf_folder
from ntil_ds.loss import (
    NTILLoss,
    NTILOutput,
    digit_token_ids_from_tokenizer,
    number_sign_and_point_ids_from_tokenizer,
    number_token_ids,
)
from ntil_ds.loss.ntl import NTLLoss
from ntil_ds.loss.numbers import analyse_numbers
from ntil_ds.model import load_model
from ntil_ds.model.packing import rope_fn_for
from ntil_ds.model.tensor_parallel import VocabShard, find_vocab_shard
from ntil_ds.preemption import PreemptionWatcher
from ntil_ds.tracking import Tracker, build_tracker

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DIGIT_PLACES_REPORTED = 6  # eval logs digit_acc_pos0 (units) .. digit_acc_pos5
EXPORT_DIR = "export"


class NonFiniteLossError(RuntimeError):
    """A NaN/Inf loss or gradient: raised on every rank before the optimizer step, naming step, rank and
    batch."""


@dataclass
class FitResult:
    status: Literal["completed", "preempted"]
    step: int  # optimizer steps completed
    export_dir: Path | None = None


@dataclass
class MicroBatch:
    """One collated micro-batch and where it came from (for error messages)."""

    sample_ids: list[int]  # row indices in data.train_file
    tensors: dict[str, torch.Tensor]  # collator output, including labels


def build_loss(cfg: Config, tokenizer: Any) -> NTILLoss | NTLLoss:
    """NTILLoss from ``cfg.loss``: ``ce`` is NTIL with lambda 0 (parts still reported, no gradient);
    ``emd`` drops the sequence-level terms (the paper's EMD-only baseline); ``ntl`` is that ``ce`` plus
    the ntloss package's number token loss (:mod:`ntil_ds.loss.ntl`)."""
    c = cfg.loss
    if c.name == "ntl":
        return NTLLoss(
            build_loss(replace(cfg, loss=replace(c, name="ce")), tokenizer), tokenizer, c.ntl_lambda
        )
    point_id = minus_id = None
    if c.decimal_numbers or c.signed_numbers:
        minus_id, point_id = number_sign_and_point_ids_from_tokenizer(tokenizer)
    return NTILLoss(
        digit_token_ids=digit_token_ids_from_tokenizer(tokenizer),
        ntil_lambda=0.0 if c.name == "ce" else c.ntil_lambda,
        digit_alpha=c.digit_alpha,
        abs_alpha=0.0 if c.name == "emd" else c.abs_alpha,
        mag_alpha=0.0 if c.name == "emd" else c.mag_alpha,
        digit_exp=c.digit_exp,
        gumbel_tau=c.gumbel_tau,
        gumbel_noise_scale=c.gumbel_noise_scale,
        ignore_index=IGNORE_INDEX,
        decimal_numbers=c.decimal_numbers,
        signed_numbers=c.signed_numbers,
        decimal_point_id=point_id,
        minus_sign_id=minus_id,
        kernel=c.kernel,  # loss.name=ntl gets both through its inner ce loss (the recursion above)
        number_stage=c.number_stage,
    )


def digit_accuracy_by_place(
    predicted: torch.Tensor, labels: torch.Tensor, digit_ids: torch.Tensor, num_places: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced digit accuracy by place value: ``(counts, correct)``, each ``[num_places]``, for
    place 0 (units), 1 (tens), ... Numbers are read from the labels exactly as the loss reads them."""
    layout = analyse_numbers(labels, digit_ids, ignore_index=IGNORE_INDEX)
    counted = layout.is_digit & (layout.place >= 0) & (layout.place < num_places)
    right = counted & (predicted == labels)
    counts = torch.bincount(layout.place[counted], minlength=num_places)
    correct = torch.bincount(layout.place[right], minlength=num_places)
    return counts, correct


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the logits of a causal LM: position t predicts token t+1.

    We shift the (small) labels instead of slicing the (huge) logits, so no copy of the logits is made.
    """
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


class Trainer:
    """Builds every part of a run from the config, then :meth:`fit` trains it.

    Call on every rank, after ``engine.init_distributed()``. ``ds_config`` is the merged DeepSpeed
    config (``ds_config.merge_deepspeed_config``), ``dist_info`` this process's place in the job.
    """

    def __init__(
        self,
        cfg: Config,
        ds_config: dict[str, Any],
        dist_info: DistInfo,
        *,
        preemption: PreemptionWatcher | None = None,
        tracking_tags: Mapping[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist_info
        self.preemption = preemption
        self.output_dir = Path(cfg.output_dir)
        self.grad_accum = gradient_accumulation_steps(cfg, dist_info.dp_size)
        self.device = device_for(dist_info.local_rank)
        # Which checkpoint to continue, decided by rank 0 for all, and checked against this recipe before
        # anything is built or written: a different recipe must not silently continue another run.
        checkpoint = agree_on_resume_checkpoint(cfg.resume, self.output_dir, dist_info)
        if checkpoint is not None:
            check_resume_config(checkpoint, cfg)
        if dist_info.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output_dir / "config.yaml")
            write_deepspeed_config(ds_config, self.output_dir / "deepspeed.json")

        self.processor = load_processor(cfg.model.processor or cfg.model.name_or_path)
        self.loss_fn = build_loss(cfg, tokenizer_of(self.processor))
        # Data before the model: a bad line fails in seconds, not after a 7B model is loaded.
        self.train_data = ConversationDataset(
            cfg.data.train_file, self.processor, cfg.data.max_seq_len, on_bad_sample=cfg.data.on_bad_sample
        )
        self.eval_data = (
            ConversationDataset(
                cfg.data.eval_file, self.processor, cfg.data.max_seq_len, on_bad_sample=cfg.data.on_bad_sample
            )
            if cfg.data.eval_file
            else None
        )
        if dist_info.is_main:
            for data in (self.train_data, self.eval_data):
                if data is not None:
                    log.info("data: %s", data.report.summary())
        # Same seed on every rank: random init is identical everywhere (ZeRO-3 keeps one slice each).
        _seed_everything(cfg.train.seed)
        # keeps the ZeRO-3 config alive with the model; lora: peft adapters when cfg.lora.enabled
        # (lora.head=number_rows trains the head's rows of the tokens NTIL reads)
        number_rows = None
        if cfg.lora.enabled and cfg.lora.head == "number_rows":
            c = cfg.loss
            number_rows = number_token_ids(tokenizer_of(self.processor), c.signed_numbers, c.decimal_numbers)
        self.loaded = load_model(cfg.model, ds_config, self.device, lora=cfg.lora, number_rows=number_rows)
        if dist_info.is_main:
            log.info("attention implementation: %s", self.loaded.attn_implementation)
        self.engine = TrainingEngine(self.loaded.model, cfg, ds_config)
        self.engine.check_layout(dist_info)  # the data sharding and the normalization assume it
        # With AutoTP's vocab-parallel head, this rank's logits are one slice of the vocabulary.
        self.vocab_shard: VocabShard | None = find_vocab_shard(self.engine.module, dist_info.tp_size)
        if self.vocab_shard is not None and cfg.loss.name == "ntl":
            raise ConfigError(
                "loss.name=ntl cannot run on vocabulary-parallel logits (autotp_size > 1 shards the LM head; "
                "ntloss needs the full vocabulary): use loss.name=ntil, emd or ce, or train without tensor "
                "parallelism"
            )

        self.collator = Collator(self.processor, fake_image=cfg.data.fake_image)
        # Sequence packing: training batches pack samples into rows (eval stays padded).
        self.train_collator: Any = self.collator
        if cfg.data.max_tokens_per_micro_batch:
            if cfg.loss.name == "ntl":
                raise ConfigError(
                    "loss.name=ntl does not support packing: set data.max_tokens_per_micro_batch=0"
                )
            rope_fn = rope_fn_for(self.loaded.model)  # raises for model types packing is not verified on
            # flash-attention's varlen kernel: one row, no padding. sdpa/eager build a block-diagonal mask,
            # quadratic in the row length: rows no longer than the longest sample.
            flash = self.loaded.attn_implementation == "flash_attention_2"
            self.train_collator = PackedCollator(
                self.processor,
                fake_image=cfg.data.fake_image,
                rope_fn=rope_fn,
                row_tokens=None if flash else cfg.data.max_seq_len,
            )
        self.sampler = ResumableDistributedSampler(
            len(self.train_data),
            dp_rank=dist_info.dp_rank,
            dp_size=dist_info.dp_size,
            seed=cfg.train.seed,
            shuffle=cfg.data.shuffle,
        )

        self.state = TrainerState(step=0)
        self.resumed = checkpoint is not None
        if checkpoint is not None:
            self.state = load_checkpoint(self.engine, checkpoint, dist_info)
            self.sampler.load_state_dict(self.state.sampler)

        self.tracker: Tracker = build_tracker(
            cfg.tracking,
            is_main=dist_info.is_main,
            output_dir=self.output_dir,
            run_id=self.state.tracker_run_id,
            tags=dict(tracking_tags or {}),
        )
        self.state.tracker_run_id = self.tracker.run_id
        # The run can be reproduced from its artifacts: the resolved recipe and merged DeepSpeed config.
        self.tracker.log_artifact(self.output_dir / "config.yaml")
        self.tracker.log_artifact(self.output_dir / "deepspeed.json")
        if checkpoint is None:
            self.tracker.log_params(flatten(cfg))
            # Nothing is lost silently: skipped samples are counted in the run, not only in the log.
            self.tracker.log_metrics(
                {
                    "data/train_kept": self.train_data.report.kept,
                    "data/train_skipped": self.train_data.report.num_skipped,
                },
                step=0,
            )

    # ------------------------------------------------------------------------------------------------
    # The job

    def fit(self) -> FitResult:
        """Train to ``train.max_steps`` (or until preempted), checkpointing and exporting on the way.

        The whole job: when it returns, this process has left the process group (no collective may
        follow) and the tracking run is ended."""
        cfg = self.cfg
        self.engine.train()
        steps = self._step_batches()
        progress = tqdm(
            total=cfg.train.max_steps,
            initial=self.state.step,
            desc="train",
            unit="step",
            disable=not self.dist.is_main,
            dynamic_ncols=True,
        )
        status: Literal["completed", "preempted"] = "completed"
        saved_at = self.state.step if self.resumed else -1  # no need to save what we just loaded
        export_dir = None
        try:
            while self.state.step < cfg.train.max_steps:
                # A collective at the step boundary: every rank agrees whether to stop now.
                if self.preemption is not None and self.preemption.requested():
                    status = "preempted"
                    break
                # Look ahead: the whole step's micro-batches, so their token count is known up front.
                micro_batches = next(steps)
                metrics = self._train_step(micro_batches)
                self.state.step += 1
                # Advanced by what was trained, never by what the loader prefetched: resume stays exact.
                self.sampler.skip(cfg.train.global_batch_size // self.dist.dp_size)
                self.state.sampler = self.sampler.state_dict()
                self._log_train(metrics, progress)

                step = self.state.step
                if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                    self._log_eval(self.evaluate())
                if cfg.train.save_every and step % cfg.train.save_every == 0:
                    self._save()
                    saved_at = step
            progress.close()
            if saved_at != self.state.step:
                self._save()  # at the end, or on preemption: resume continues exactly here

            if status == "completed":
                evaluated_last_step = cfg.train.eval_every and self.state.step % cfg.train.eval_every == 0
                if self.eval_data is not None and not evaluated_last_step:
                    self._log_eval(self.evaluate())
                if cfg.train.export_at_end:
                    export_dir = export_hf_folder(
                        self.engine, self.processor, self.output_dir / EXPORT_DIR, self.dist.is_main
                    )
                    if cfg.tracking.log_model:
                        self.tracker.log_artifact(export_dir, artifact_path="model")
        except BaseException:
            self.tracker.finish("FAILED")
            raise
        finally:
            progress.close()
        # The ranks' work is done: they leave the process group together, and only then does rank 0
        # deliver its tracking backlog (minutes after a server outage) with no group held open. How the
        # process then ends, and why: ntil_ds.dist.exit_process.
        leave_process_group()
        self.tracker.finish("FINISHED" if status == "completed" else "KILLED")
        return FitResult(status=status, step=self.state.step, export_dir=export_dir)

    # ------------------------------------------------------------------------------------------------
    # One optimizer step

    def _train_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Forward/backward every micro-batch of the step, check the loss, step the optimizer.

        The normalization contract. The objective of one optimizer step is

            L = sum over micro-batches m of the step and data-parallel ranks r of loss_sum[m, r]  /  N

        where ``loss_sum`` is the loss's per-token value times the micro-batch's labelled tokens and N is
        the number of labelled tokens in the whole step (all micro-batches on all DP ranks): every
        labelled token weighs the same, however the batch is split (no mean of per-micro-batch means).
        So each micro-batch contributes ``loss_sum / N``, and N must be known before the first backward:
        we look ahead at the step's micro-batches and all-reduce their counts once (a sync point).
        DeepSpeed would then (a) divide each backward's loss by gradient_accumulation_steps: turned off
        (``TrainingEngine.backward`` passes ``scale_wrt_gas=False``); and (b) average the gradients
        over the DP ranks (ZeRO divides the reduced gradient by dp_size): undone by multiplying by
        dp_size here. The result is the gradient of L. tests/distributed/test_train_normalization.py
        pins it: one process with the full batch == 2 ranks x 2 micro-batches.
        Tensor-parallel ranks of one group read the same batch and compute the same loss, so counts
        summed over all ranks are divided by tp_size.
        """
        started = time.perf_counter()
        step = self.state.step  # 0-based index of the optimizer step being taken
        local_labelled = sum(
            int((shift_labels(mb.tensors["labels"]) != IGNORE_INDEX).sum()) for mb in micro_batches
        )
        global_labelled = self._all_reduce_sum([float(local_labelled)])[0] / self.dist.tp_size
        scale = self.dist.dp_size / max(global_labelled, 1.0)
        lr = self.engine.lr()  # the rate this step uses (the schedule advances inside the step)

        # Per-rank sums of the step, kept on the device (no host sync per micro-batch): loss_sum, ce_sum,
        # ntil, emd, rel, mag (the last four are per-micro-batch means, summed here).
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        micro_loss_sums = []
        input_tokens = 0
        for index, micro_batch in enumerate(micro_batches):
            # Packing varies the forwards per step: DeepSpeed is told which backward ends it.
            self.engine.set_accumulation_boundary(index == len(micro_batches) - 1)
            out = self._loss(micro_batch, generator=self._gumbel_generator(step, index))
            self.engine.backward(out.loss_sum * scale)
            parts = torch.stack([out.loss_sum, out.ce_sum, out.ntil, out.emd, out.rel, out.mag])
            sums += parts.detach().double()
            micro_loss_sums.append(out.loss_sum.detach())
            input_tokens += int(micro_batch.tensors["attention_mask"].sum())  # a CPU tensor
            if index < len(micro_batches) - 1:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step

        # One all_reduce for the log and the NaN check, BEFORE the optimizer step.
        non_finite = ~torch.isfinite(torch.stack(micro_loss_sums))
        extra = torch.tensor([input_tokens, 0.0], dtype=torch.float64, device=self.device)
        extra[1] = non_finite.sum()
        reduced = self._all_reduce_sum(torch.cat([sums, extra]))
        if reduced[7] > 0:
            self._raise_non_finite(micro_batches, micro_loss_sums, non_finite.tolist())
        # A finite loss can still give a NaN/Inf gradient (an overflow in the backward); in bf16/fp32
        # DeepSpeed would apply it and every weight would turn NaN. A collective check, before the step.
        tp = self.dist.tp_size
        loss = reduced[0] / tp / max(global_labelled, 1.0)
        if not self.engine.gradients_are_finite():
            self._raise_non_finite_gradient(micro_batches, loss)
        self.engine.step()  # the accumulation boundary: clip, optimizer step, schedule

        elapsed = time.perf_counter() - started
        means_over = len(micro_batches) * self.dist.world_size  # TP copies are equal: a mean over DP ranks
        return {
            "loss": loss,
            "ce": reduced[1] / tp / max(global_labelled, 1.0),
            "ntil": reduced[2] / means_over,
            "emd": reduced[3] / means_over,
            "rel": reduced[4] / means_over,
            "mag": reduced[5] / means_over,
            "lr": lr,
            "grad_norm": self.engine.grad_norm(),
            "labelled_tokens": global_labelled,
            "tokens_per_s": reduced[6] / tp / elapsed,
            "step_time_s": elapsed,
            "peak_mem_mib": peak_memory_mib(self.device),  # rank 0's; ZeRO-3 ranks are alike
        }

    def _loss(self, micro_batch: MicroBatch, generator: torch.Generator | None) -> NTILOutput:
        return self._loss_of_logits(self._logits(micro_batch), micro_batch, generator)

    def _logits(self, micro_batch: MicroBatch) -> torch.Tensor:
        """One forward (under ZeRO-3: one gather of every parameter); this rank's vocabulary slice."""
        # No labels=: HF would compute its own loss (on full-vocab logits, which may not exist here).
        return self.engine.forward(**self._model_inputs(micro_batch), use_cache=False).logits

    def _loss_of_logits(
        self, logits: torch.Tensor, micro_batch: MicroBatch, generator: torch.Generator | None
    ) -> NTILOutput:
        labels = micro_batch.tensors["labels"].to(self.device, non_blocking=True)
        packing = {
            k: micro_batch.tensors[k].to(self.device) for k in PACKING_KEYS if k in micro_batch.tensors
        }
        shard = self.vocab_shard
        return self.loss_fn(
            logits,
            shift_labels(labels),
            process_group=shard.process_group if shard else None,
            vocab_start=shard.vocab_start if shard else 0,
            generator=generator,
            **packing,  # unpack_index: NTIL's per-sequence terms per packed sample
        )

    def _model_inputs(self, micro_batch: MicroBatch) -> dict[str, torch.Tensor]:
        """The batch without labels, on the device (asynchronous from pinned memory); pixels in the model's
        dtype. A packed batch goes without attention_mask: transformers then separates the samples by
        their restarting position_ids (ntil_ds/data/packing.py)."""
        dtype = self.loaded.dtype
        tensors = micro_batch.tensors
        skip = {"labels", *PACKING_KEYS, *(("attention_mask",) if "unpack_index" in tensors else ())}
        return {
            key: value.to(
                self.device, dtype=dtype if value.is_floating_point() else value.dtype, non_blocking=True
            )
            for key, value in tensors.items()
            if key not in skip
        }

    def _gumbel_generator(self, step: int, micro_index: int, *, evaluation: bool = False) -> torch.Generator:
        """The loss's Gumbel noise: a function of (seed, step, micro-batch, dp_rank) only, so every rank of
        a tensor-parallel group draws the same noise and a resumed run draws what the first run drew."""
        purpose = 1 if evaluation else 0
        seed = np.random.SeedSequence([self.cfg.train.seed, purpose, step, micro_index, self.dist.dp_rank])
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed.generate_state(1, dtype=np.uint64)[0] >> 1))
        return generator

    def _raise_non_finite(
        self, micro_batches: list[MicroBatch], loss_sums: list[torch.Tensor], bad: list[bool]
    ) -> None:
        """Every rank raises the same message, listing every offending micro-batch of every rank."""
        local_bad = [
            f"rank {self.dist.rank} (dp rank {self.dist.dp_rank}), micro-batch {index} of the step, "
            f"samples {micro_batch.sample_ids} of {self.cfg.data.train_file}: loss_sum={float(loss_sum)}"
            for index, (micro_batch, loss_sum, is_bad) in enumerate(
                zip(micro_batches, loss_sums, bad, strict=True)
            )
            if is_bad
        ]
        gathered: list[list[str]] = [local_bad]
        if dist.is_initialized():
            gathered = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, local_bad)
        where = "\n  ".join(line for lines in gathered for line in lines)
        step = self.state.step + 1
        raise NonFiniteLossError(
            f"non-finite loss at step {step} (of {self.cfg.train.max_steps}); the optimizer did not take "
            f"this step, the weights are those after step {step - 1}.\n  {where}\n"
            "Lower optim.lr, check these samples, or use model.dtype=bfloat16 instead of float16."
        )

    def _raise_non_finite_gradient(self, micro_batches: list[MicroBatch], loss: float) -> None:
        step = self.state.step + 1
        samples = [i for micro_batch in micro_batches for i in micro_batch.sample_ids]
        raise NonFiniteLossError(
            f"non-finite gradient at step {step} (of {self.cfg.train.max_steps}) with a finite loss "
            f"({loss:.6g}); the optimizer did not take this step, the weights are those after step "
            f"{step - 1}. Rank {self.dist.rank}'s samples of the step: {samples} of "
            f"{self.cfg.data.train_file}.\nLower optim.lr or optim.grad_clip, or use model.dtype=bfloat16 "
            "instead of float16."
        )

    # ------------------------------------------------------------------------------------------------
    # Evaluation: loss and teacher-forced numeric metrics on data.eval_file

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Eval loss and teacher-forced accuracies: of answer tokens, of digit tokens, of whole answers.

        Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively): ranks
        with fewer eval samples run a repeat of one with every label masked.
        """
        assert self.eval_data is not None
        self.engine.eval()
        n = len(self.eval_data)
        mine = list(range(self.dist.dp_rank, n, self.dist.dp_size))
        mbs = self.cfg.train.micro_batch_size
        num_batches = math.ceil(math.ceil(n / self.dist.dp_size) / mbs)
        digit_ids = torch.tensor(self.loss_fn.digit_token_ids, device=self.device)
        # loss_sum, ce_sum, tokens, correct tokens, digits, correct digits, sequences, all-correct sequences
        sums = torch.zeros(8, dtype=torch.float64)
        # digits seen and digits right, by place value (units first): the "error by digit position" plot
        place_counts = torch.zeros(2, DIGIT_PLACES_REPORTED, dtype=torch.float64)
        for b in range(num_batches):
            ids = mine[b * mbs : (b + 1) * mbs]
            batch = self._collate(self.eval_data, ids or mine[:1] or [0])
            if not ids:
                batch.tensors["labels"].fill_(IGNORE_INDEX)
            logits = self._logits(batch)  # one forward serves the loss and the predictions
            generator = self._gumbel_generator(self.state.step, b, evaluation=True)
            out = self._loss_of_logits(logits, batch, generator)
            labels = shift_labels(batch.tensors["labels"]).to(self.device)
            predicted = self._argmax_over_vocab(logits)
            labelled = labels != IGNORE_INDEX
            is_digit = torch.isin(labels, digit_ids)
            correct = predicted == labels
            answered = labelled.any(dim=1)  # rows with something to predict (not the masked filler)
            all_correct = (correct | ~labelled).all(dim=1) & answered
            sums += torch.tensor(
                [
                    float(out.loss_sum),
                    float(out.ce_sum),
                    float(labelled.sum()),
                    float((correct & labelled).sum()),
                    float(is_digit.sum()),
                    float((correct & is_digit).sum()),
                    float(answered.sum()),
                    float(all_correct.sum()),
                ],
                dtype=torch.float64,
            )
            counts, right = digit_accuracy_by_place(predicted, labels, digit_ids, DIGIT_PLACES_REPORTED)
            place_counts += torch.stack([counts, right]).cpu().double()
        self.engine.train()
        total = self._all_reduce_sum(sums.tolist() + place_counts.flatten().tolist())
        seen, right = total[8 : 8 + DIGIT_PLACES_REPORTED], total[8 + DIGIT_PLACES_REPORTED :]
        by_place = {f"digit_acc_pos{k}": right[k] / seen[k] for k in range(DIGIT_PLACES_REPORTED) if seen[k]}
        tokens = max(total[2], 1.0)
        return {
            "loss": total[0] / tokens,
            "ce": total[1] / tokens,
            "token_acc": total[3] / tokens,
            "digit_acc": total[5] / max(total[4], 1.0),
            "answer_acc": total[7] / max(total[6], 1.0),  # every answer token right (teacher-forced)
            **by_place,
        }

    def _argmax_over_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        values, index = logits.max(dim=-1)
        shard = self.vocab_shard
        if shard is None:
            return index
        # Vocab-parallel: each rank knows the best token of its slice; the group picks the best slice.
        size = dist.get_world_size(shard.process_group)
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_index = [torch.empty_like(index) for _ in range(size)]
        dist.all_gather(all_values, values.contiguous(), group=shard.process_group)
        dist.all_gather(all_index, (index + shard.vocab_start).contiguous(), group=shard.process_group)
        best = torch.stack(all_values).argmax(dim=0, keepdim=True)
        return torch.stack(all_index).gather(0, best).squeeze(0)

    # ------------------------------------------------------------------------------------------------
    # Data

    def _step_batches(self) -> Iterator[list[MicroBatch]]:
        """This rank's micro-batches of each step, forever, from the sampler's current position, prepared by
        data.num_workers processes ahead of training (ntil_ds/data/steps.py; fit advances the sampler)."""
        steps = StepBatches(
            self.train_data,
            self.sampler,
            self.train_collator,
            samples_per_rank=self.cfg.train.global_batch_size // self.dist.dp_size,
            micro_batch_size=self.cfg.train.micro_batch_size,
            max_tokens=self.cfg.data.max_tokens_per_micro_batch,
        )
        for step in step_loader(steps, self.cfg.data.num_workers, pin_memory=self.device.type == "cuda"):
            yield [MicroBatch(sample_ids=ids, tensors=tensors) for ids, tensors in step]

    def _collate(self, dataset: ConversationDataset, ids: list[int]) -> MicroBatch:
        return MicroBatch(sample_ids=list(ids), tensors=self.collator([dataset[i] for i in ids]))

    # ------------------------------------------------------------------------------------------------
    # Checkpoints and logs

    def _save(self) -> None:
        self.state.sampler = self.sampler.state_dict()
        # A tracking server that was down at start gets the run created later: save the id once known.
        self.state.tracker_run_id = self.tracker.run_id or self.state.tracker_run_id
        save_checkpoint(self.engine, self.cfg, self.state, self.dist, self.cfg.train.keep_last)

    def _all_reduce_sum(self, values: list[float] | torch.Tensor) -> list[float]:
        """Sum over all ranks (a sync point); returns host floats."""
        tensor = torch.as_tensor(values, dtype=torch.float64, device=self.device).clone()
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def _log_train(self, metrics: dict[str, float], progress: tqdm) -> None:
        step = self.state.step
        if not self.dist.is_main:
            return
        self._append_metrics({"split": "train", "step": step, **metrics})
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", refresh=False)
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.max_steps:
            self.tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=step)
            progress.write(
                f"step {step}/{self.cfg.train.max_steps} loss {metrics['loss']:.4f} ce {metrics['ce']:.4f} "
                f"ntil {metrics['ntil']:.4f} (emd {metrics['emd']:.4f} rel {metrics['rel']:.4f} "
                f"mag {metrics['mag']:.4f}) lr {metrics['lr']:.3e} grad_norm {metrics['grad_norm']:.3f} "
                f"tokens/s {metrics['tokens_per_s']:.0f}"
            )

    def _log_eval(self, metrics: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        step = self.state.step
        self._append_metrics({"split": "eval", "step": step, **metrics})
        self.tracker.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        log.info("eval at step %d: %s", step, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        tqdm.write(f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _append_metrics(self, record: dict[str, Any]) -> None:
        with (self.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
