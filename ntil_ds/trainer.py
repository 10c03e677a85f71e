"""The training loop: the one module that knows the order of things.

Read :meth:`Trainer.fit` top to bottom: it is the whole job. :meth:`Trainer.train_step` is one optimizer
step and holds the loss-normalization contract. Everything else is a call into the room that owns it:
the loss (``loss/build.py``), the forward and loss of a micro-batch (``objective.py``), the step's
micro-batches (``data/steps.py``), collectives (``dist.py``), the non-finite checks (``nonfinite.py``),
checkpoint cadence (``checkpoint.Checkpointer``), the step log (``tracking/step_log.py``), evaluation
(``evaluation/``) and the Hugging Face export (``export.py``).

Files written to ``cfg.output_dir`` (rank 0): ``config.yaml`` (the resolved recipe) and ``deepspeed.json``
(the merged DeepSpeed config); ``metrics.jsonl`` (see tracking/step_log.py); ``checkpoints/step_XXXXXXXX/``
(see checkpoint.py) and ``export/`` (a Hugging Face folder).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ntil_ds.checkpoint import (
    Checkpointer,
    TrainerState,
    agree_on_resume_checkpoint,
    check_resume_config,
    load_checkpoint,
)
from ntil_ds.config import Config, flatten, gradient_accumulation_steps, save_config
from ntil_ds.data import Collator, ResumableDistributedSampler, load_processor, tokenizer_of
from ntil_ds.data.batch import MicroBatch
from ntil_ds.data.cached_dataset import AnyConversationDataset
from ntil_ds.data.packing import PackedCollator
from ntil_ds.data.steps import StepBatches, step_loader
from ntil_ds.data.weighted import WeightedSources, load_weighted
from ntil_ds.dist import (
    DistInfo,
    all_reduce_host_sums,
    all_reduce_sums,
    broadcast_from_main,
    leave_process_group,
    read_to_host,
)
from ntil_ds.ds_config import write_deepspeed_config
from ntil_ds.engine import TrainingEngine, check_optimizer_build, device_for, peak_memory_mib
from ntil_ds.evaluation.numeric import NumericEval
from ntil_ds.evaluation.teacher_forced import TeacherForcedEval
from ntil_ds.export import export_hf_folder
from ntil_ds.loss import NTILOutput, number_token_ids
from ntil_ds.loss.build import build_loss, check_loss_supports, head_on_labelled_rows
from ntil_ds.model import load_model
from ntil_ds.model.packing import rope_fn_for
from ntil_ds.model.sequence_parallel import check_sequence_parallel_at_start
from ntil_ds.model.tensor_parallel import find_vocab_shard
from ntil_ds.moe import router_terms_for
from ntil_ds.nonfinite import raise_non_finite_gradient, raise_non_finite_loss
from ntil_ds.objective import Objective, gumbel_generator
from ntil_ds.preemption import PreemptionWatcher
from ntil_ds.tracking import Tracker, build_tracker
from ntil_ds.tracking.step_log import StepLog

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
# The loss's parts summed over a step's micro-batches (loss_sum, ce_sum: sums over targets; the rest are
# per-micro-batch means, reported as their mean over micro-batches and ranks).
_STEP_PARTS = ("loss_sum", "ce_sum", "ntil", "emd", "rel", "mag")


@dataclass
class FitResult:
    status: Literal["completed", "preempted"]
    step: int  # optimizer steps completed
    export_dir: Path | None = None


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
        self.cfg, self.dist, self.preemption = cfg, dist_info, preemption
        self.output_dir = Path(cfg.output_dir)
        self.grad_accum = gradient_accumulation_steps(cfg, dist_info.dp_size)
        self.device = device_for(dist_info.local_rank)
        check_optimizer_build(ds_config)  # an optimizer op that cannot build fails now, not after the model
        if cfg.parallel.sequence_parallel_size > 1:  # the model's config alone, before any weight loads
            check_sequence_parallel_at_start(cfg, self.device)
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
        loss_fn = build_loss(cfg, tokenizer_of(self.processor))
        # Data before the model: a bad line fails in seconds, not after a 7B model is loaded.
        self.train_data = self._dataset(cfg.data.train_file, cfg.data.mixture)
        self.eval_data = self._dataset(cfg.data.eval_file) if cfg.data.eval_file else None
        # Same seed on every rank: random init is identical everywhere (ZeRO-3 keeps one slice each).
        _seed_everything(cfg.train.seed)
        # lora: peft adapters when cfg.lora.enabled (lora.head=number_rows: the head's rows NTIL reads)
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
        vocab_shard = find_vocab_shard(self.engine.module, dist_info.tp_size)
        check_loss_supports(cfg, vocab_parallel=vocab_shard is not None)
        labelled = head_on_labelled_rows(cfg)
        if dist_info.is_main and cfg.loss.logits == "labelled" and not labelled:
            log.info(
                "loss.name=%s reads the logits of every position: the head runs on all of them", cfg.loss.name
            )
        router = router_terms_for(self.loaded.model, cfg.model.router_aux_loss_coef)  # MoE: aux loss, load
        self.objective = Objective(self.engine, loss_fn, vocab_shard, self.device, self.loaded.dtype, labelled,
                                   router, self.engine.sequence_group)  # fmt: skip

        self.collator = Collator(self.processor, fake_image=cfg.data.fake_image)
        self.train_collator = self._train_collator()
        self.sampler = ResumableDistributedSampler.for_dataset(
            self.train_data,
            dp_rank=dist_info.dp_rank,
            dp_size=dist_info.dp_size,
            seed=cfg.train.seed,
            shuffle=cfg.data.shuffle,
        )
        self.state = TrainerState(step=0)
        if checkpoint is not None:
            self.state = load_checkpoint(self.engine, checkpoint, dist_info)
            self.sampler.load_state_dict(self.state.sampler)
        self.checkpoints = Checkpointer(
            self.engine, cfg, dist_info, loaded_step=self.state.step if checkpoint is not None else None
        )
        self.tracker = self._start_tracking(resumed=checkpoint is not None, tags=tracking_tags)
        # Evaluation on data.eval_file: teacher-forced accuracies; scores of generated answers when asked
        self.evaluator = self.numeric_eval = None
        if self.eval_data is not None:
            self.evaluator = TeacherForcedEval(cfg, self.eval_data, self.collator, self.objective, dist_info)
            if cfg.eval.generate_every:
                self.numeric_eval = NumericEval(
                    cfg, self.eval_data, self.processor, self.objective, dist_info
                )

    # ------------------------------------------------------------------------------------------------
    # The job

    def fit(self) -> FitResult:
        """Train to ``train.max_steps`` (or until preempted), checkpointing and exporting on the way.

        The whole job: when it returns, this process has left the process group (no collective may
        follow) and the tracking run is ended."""
        cfg = self.cfg
        self.engine.train()
        steps = self.step_batches()
        step_log = StepLog(
            self.tracker,
            self.output_dir,
            max_steps=cfg.train.max_steps,
            log_every=cfg.train.log_every,
            is_main=self.dist.is_main,
            first_step=self.state.step,
        )
        status: Literal["completed", "preempted"] = "completed"
        export_dir = None
        try:
            while self.state.step < cfg.train.max_steps:
                # A collective at the step boundary (on the host group): every rank agrees whether to stop now.
                if self.preemption is not None and self.preemption.requested():
                    status = "preempted"
                    break
                # Look ahead: the whole step's micro-batches, so their target count is known up front.
                metrics = self.train_step(next(steps))
                self._advance_state()
                step_log.train(self.state.step, metrics)
                if self.evaluator is not None and self.evaluator.due(self.state.step):
                    step_log.eval(self.state.step, self.evaluator.run(self.state.step))
                if self.numeric_eval is not None and self.numeric_eval.due(self.state.step):
                    step_log.numeric(self.state.step, self.numeric_eval.run(self.state.step))
                self.checkpoints.maybe_save(self.state)
            step_log.close()
            self.checkpoints.save_final(self.state)  # at the end, or on preemption: resume continues here

            if status == "completed":
                if self.evaluator is not None and not self.evaluator.due(self.state.step):
                    step_log.eval(self.state.step, self.evaluator.run(self.state.step))
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
            step_log.close()
        # The ranks' work is done: they leave the process group together, and only then does rank 0
        # deliver its tracking backlog (minutes after a server outage) with no group held open. How the
        # process then ends, and why: ntil_ds.dist.exit_process.
        leave_process_group()
        self.tracker.finish("FINISHED" if status == "completed" else "KILLED")
        return FitResult(status=status, step=self.state.step, export_dir=export_dir)

    def evaluate(self) -> dict[str, float]:
        """COLLECTIVE: teacher-forced metrics on data.eval_file now (see evaluation/teacher_forced.py)."""
        assert self.evaluator is not None, "no data.eval_file"
        return self.evaluator.run(self.state.step)

    # ------------------------------------------------------------------------------------------------
    # One optimizer step

    def train_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Forward/backward every micro-batch of the step, check the loss, step the optimizer.

        The normalization contract. The objective of one optimizer step is

            L = sum over micro-batches m of the step and data-parallel ranks r of loss_sum[m, r]  /  N

        where ``loss_sum`` is the loss's per-token value times the micro-batch's labelled tokens and N is
        the number of labelled tokens in the whole step (all micro-batches on all DP ranks): every
        labelled token weighs the same, however the batch is split (no mean of per-micro-batch means).
        So each micro-batch contributes ``loss_sum / N``, and N must be known before the first backward:
        we look ahead at the step's micro-batches and all-reduce their counts once (a collective).
        DeepSpeed would then (a) divide each backward's loss by gradient_accumulation_steps: turned off
        (``TrainingEngine.backward`` passes ``scale_wrt_gas=False``); and (b) average the gradients
        over the DP ranks (ZeRO divides the reduced gradient by dp_size): undone by multiplying by
        dp_size here. The result is the gradient of L. tests/distributed/test_train_normalization.py
        pins it: one process with the full batch == 2 ranks x 2 micro-batches.
        Tensor-parallel ranks of one group read the same batch and compute the same loss, so counts
        summed over all ranks are divided by tp_size. Sequence-parallel ranks each hold a slice of the rows:
        counts and loss shares add up (what DeepSpeed divides by: ``engine.gradient_average_size``).

        One host sync per step, none per micro-batch (tests/distributed/test_host_syncs.py counts them): the
        target count is known on the host and reduced on the host group; every device sum stays on the
        device until the one read after the optimizer step.
        """
        started = time.perf_counter()
        step, tp = self.state.step, self.dist.tp_size  # step: 0-based index of the step being taken
        local_count = {"targets": float(sum(mb.num_targets for mb in micro_batches))}  # known on the host
        labelled = all_reduce_host_sums(local_count)["targets"] / tp  # on the host group: no device wait
        scale = self.engine.gradient_average_size / max(labelled, 1.0)
        lr = self.engine.lr()  # the rate this step uses (the schedule advances inside the step)

        sums: dict[str, torch.Tensor] = {}  # this rank's sums of the step, on the device
        loss_sums = []
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            self.engine.set_accumulation_boundary(last)  # packing varies the forwards per step
            generator = gumbel_generator(self.cfg.train.seed, step, index, self.dist.dp_rank, self.device)
            out = self.objective.loss(micro_batch, generator, step)  # step: the loss's lambda ramp
            self.engine.backward(self.objective.step_sum(out, micro_batch) * scale)  # + a MoE's aux term
            _add_parts(sums, out)
            self.objective.add_router_sums(sums, micro_batch)
            loss_sums.append(out.loss_sum.detach())
            if not last:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        sums["non_finite_losses"] = (~torch.isfinite(torch.stack(loss_sums))).sum()
        sums["input_tokens"] = torch.tensor(float(sum(mb.num_input_tokens for mb in micro_batches)))
        totals = all_reduce_sums(sums, self.device)
        if not self.engine.refuses_non_finite_steps and not self.engine.gradients_are_finite():
            # before the step: it would apply them
            raise_non_finite_gradient(step + 1, self.cfg, self.dist, micro_batches, self.train_data)
        self.engine.step()  # the boundary: clip, optimizer step, schedule; skipped on non-finite gradients

        # THE host sync of the step: one read of everything the log and the checks need, once the device
        # has the whole step queued. (DeepSpeed's own overflow check inside step() is its own.)
        host = read_to_host({**totals, "grad_norm": self.engine.grad_norm()})
        if host["non_finite_losses"]:  # the same sum on every rank: all raise together
            bad = [float(s) for s in loss_sums]
            raise_non_finite_loss(step + 1, self.cfg, self.dist, micro_batches, bad, self.train_data,
                                  applied=self.engine.step_applied())  # fmt: skip
        loss = host["loss_sum"] / tp / max(labelled, 1.0)
        if not self.engine.step_applied():  # a finite loss, yet DeepSpeed found the gradients non-finite
            raise_non_finite_gradient(step + 1, self.cfg, self.dist, micro_batches, self.train_data, loss)

        elapsed = time.perf_counter() - started
        means_over = len(micro_batches) * self.dist.world_size  # TP copies are equal: a mean over DP ranks
        return {
            "loss": loss,
            "ce": host["ce_sum"] / tp / max(labelled, 1.0),
            **{part: host[part] / means_over for part in ("ntil", "emd", "rel", "mag")},
            "lr": lr,
            "grad_norm": host["grad_norm"],
            "labelled_tokens": labelled,
            "micro_batches": len(micro_batches),  # forwards in the step (packing decides it from the tokens)
            "tokens_per_s": host["input_tokens"] / tp / elapsed,
            "step_time_s": elapsed,
            "peak_mem_mib": peak_memory_mib(self.device),  # rank 0's; ZeRO-3 ranks are alike
            **self.objective.router_metrics(host, labelled, tp),  # MoE: aux_loss, expert load
        }

    def step_batches(self) -> Iterator[list[MicroBatch]]:
        """This rank's micro-batches of each step, forever, from the sampler's current position, prepared by
        data.num_workers processes ahead of training (ntil_ds/data/steps.py; fit advances the sampler)."""
        steps = StepBatches(
            self.train_data,
            self.sampler,
            self.train_collator,
            samples_per_rank=self.cfg.train.global_batch_size // self.dist.dp_size,
            micro_batch_size=self.cfg.train.micro_batch_size,
            max_tokens=self.cfg.data.max_tokens_per_micro_batch,
            sequence_slice=(self.dist.sp_rank, self.dist.sp_size) if self.dist.sp_size > 1 else None,
            multimodal=self.objective.multimodal,  # under SP: whole rows in, sliced after merging images
        )
        return step_loader(steps, self.cfg.data.num_workers, pin_memory=self.device.type == "cuda")

    # ------------------------------------------------------------------------------------------------
    # Building and bookkeeping

    def _dataset(self, path: str, mixture=()) -> AnyConversationDataset | WeightedSources:
        d = self.cfg.data  # encoded once into the cache by the main rank, mapped by all (data/cache.py)
        data = load_weighted([(path, 1.0)] if path else [(m.file, m.weight) for m in mixture], self.processor,
                             d.max_seq_len, d.on_bad_sample, cache=d.cache, cache_dir=d.cache_dir,
                             output_dir=self.output_dir, is_main=self.dist.is_main, share=broadcast_from_main,
                             ranks=self.dist.local_world_size, encode_workers=d.encode_workers)  # fmt: skip
        if self.dist.is_main:
            log.info("data: %s", data.report.summary())
        return data

    def _train_collator(self) -> Collator | PackedCollator:
        """Padded rows, or (data.max_tokens_per_micro_batch > 0) packed rows; evaluation stays padded."""
        if not self.cfg.data.max_tokens_per_micro_batch:
            return self.collator
        rope_fn = rope_fn_for(self.loaded.model)  # raises for model types packing is not verified on
        # flash-attention's varlen kernel: one row, no padding. sdpa/eager build a block-diagonal mask,
        # quadratic in the row length (flex_attention's BlockMask is not, but it is measured on these rows):
        # rows no longer than the longest sample.
        flash = self.loaded.attn_implementation == "flash_attention_2"
        return PackedCollator(self.processor, fake_image=self.cfg.data.fake_image, rope_fn=rope_fn,
                              row_tokens=None if flash else self.cfg.data.max_seq_len)  # fmt: skip

    def _start_tracking(self, *, resumed: bool, tags: Mapping[str, str] | None) -> Tracker:
        tracker = build_tracker(
            self.cfg.tracking,
            is_main=self.dist.is_main,
            output_dir=self.output_dir,
            run_id=self.state.tracker_run_id,
            tags=dict(tags or {}),
        )
        self.state.tracker_run_id = tracker.run_id
        # The run can be reproduced from its artifacts: the resolved recipe and merged DeepSpeed config.
        tracker.log_artifact(self.output_dir / "config.yaml")
        tracker.log_artifact(self.output_dir / "deepspeed.json")
        if not resumed:
            resolved = {"model.experts_implementation_resolved": self.loaded.experts_implementation or "none"}
            tracker.log_params(flatten(self.cfg) | resolved)
            # Nothing is lost silently: skipped samples are counted in the run, not only in the log.
            report = self.train_data.report
            tracker.log_metrics(
                {"data/train_kept": report.kept, "data/train_skipped": report.num_skipped}, step=0
            )
        return tracker

    def _advance_state(self) -> None:
        """After a step: count it, and record the data position and the tracking run for a checkpoint."""
        self.state.step += 1
        # Advanced by what was trained, never by what the loader prefetched: resume stays exact.
        self.sampler.skip(self.cfg.train.global_batch_size // self.dist.dp_size)
        self.state.sampler = self.sampler.state_dict()
        # A tracking server that was down at start gets the run created later: save the id once known.
        self.state.tracker_run_id = self.tracker.run_id or self.state.tracker_run_id


def _add_parts(sums: dict[str, torch.Tensor], out: NTILOutput) -> None:
    for part in _STEP_PARTS:
        value = getattr(out, part).detach().double()
        sums[part] = sums[part] + value if part in sums else value


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
