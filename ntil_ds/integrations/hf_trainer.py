"""NTIL in Hugging Face's ``Trainer`` and TRL's ``SFTTrainer``: one call, :func:`attach_ntil`.

Two routes to the same loss and gradients (the ones ntil-ds's own trainer computes):

- ``head="logits"``: the trainer's ``compute_loss_func`` hook. The model returns its logits at every
  position, as it does for the trainer's own cross-entropy, and :class:`NTILComputeLoss` reads them.
- ``head="labelled"``: the trainer's ``compute_loss`` is replaced by one that runs the output head only at
  the positions with a target, in chunks fused with the loss's vocabulary stage
  (:mod:`ntil_ds.labelled_forward`, the same code as ``loss.logits=labelled``): no ``[B, T, V]`` logits
  exist, so the peak memory of a long prompt with a short numeric answer drops to that of its answer.
  Evaluation then returns the loss only (no logits for ``compute_metrics``).

Normalisation, as the Trainer does for its own loss: with ``num_items_in_batch`` (the step's count of targets
over every accumulated micro-batch and, with ``average_tokens_across_devices``, every rank) the micro-batch
returns its *summed* loss divided by that count, times the number of processes that DeepSpeed/DDP then
average over; so the step's gradient is that of the step's summed loss over its global count, whatever the
accumulation, exactly ntil-ds's contract (``docs/design/architecture.md``, "Normalisation").

Labels: Hugging Face's (``labels[t]`` is the token at ``t``, shifted inside the loss) or a collator's
``shift_labels`` (already aligned with the logits), as the Trainer's own causal-LM loss reads them.

The loss's parts (``ce``, ``ntil``, ``emd``, ``rel``, ``mag``) go into the trainer's logs at each logging step
(means since the last, over every rank; ``eval_``-prefixed for evaluation), merged in before the trainer's
``log`` hands them to its history and its reporting callbacks: MLflow records them with the loss.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.dist import all_reduce_sums, read_to_host
from ntil_ds.integrations.loss import ntil_loss
from ntil_ds.labelled_forward import (
    applied_softcap,
    head_module,
    head_returns_row_stats,
    loss_from_rows,
    row_inputs,
)
from ntil_ds.loss import NTILLoss, NTILOutput

_MEAN_PARTS = ("ntil", "emd", "rel", "mag")  # means over micro-batches, as the recipe's trainer logs them


def aligned_targets(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, length: int
) -> torch.Tensor:
    """``[B, length]`` targets aligned with the logits (``targets[t]`` is the token at ``t + 1``): Hugging Face
    ``labels`` shifted left with -100 at the end, or ``shift_labels`` as they are (one shorter: padded)."""
    if shift_labels is not None:
        targets = shift_labels
        if targets.shape[-1] == length - 1:
            targets = torch.nn.functional.pad(targets, (0, 1), value=IGNORE_INDEX)
    elif labels is not None:
        targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    else:
        raise ValueError(
            "NTIL needs the batch's labels: the data collator must return 'labels' (or 'shift_labels'), e.g. "
            "DataCollatorForLanguageModeling or a chat collator that masks the prompt with -100"
        )
    if targets.dim() != 2 or targets.shape[-1] != length:
        raise ValueError(
            f"labels of shape {tuple(targets.shape)} do not match the model's {length} positions: give labels "
            "[batch, sequence] as long as input_ids (or shift_labels already shifted)"
        )
    return targets


class PartsMeter:
    """The loss's parts since the last log, per mode (``train``/``eval``), summed on this rank."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.step: int | None = None  # the optimizer step being taken: the loss's lambda ramp reads it

    def add(self, out: NTILOutput, mode: str) -> None:
        values = {
            "ce_sum": out.ce_sum.detach(),
            "num_tokens": out.num_tokens,
            "micro_batches": torch.ones((), device=out.ce_sum.device),
            **{part: getattr(out, part).detach() for part in _MEAN_PARTS},
        }
        sums = self.pending.setdefault(mode, {})
        for name, value in values.items():
            sums[name] = sums[name] + value.double() if name in sums else value.double()

    def take(self, mode: str, device: torch.device) -> dict[str, float]:
        """COLLECTIVE (every rank calls it at the same log): the means over all ranks, then forgotten."""
        names = ("ce_sum", "num_tokens", "micro_batches", *_MEAN_PARTS)
        mine = self.pending.pop(mode, {})
        sums = read_to_host(all_reduce_sums({name: mine.get(name, 0.0) for name in names}, device))
        if sums["micro_batches"] == 0:
            return {}
        means = {part: sums[part] / sums["micro_batches"] for part in _MEAN_PARTS}
        return {"ce": sums["ce_sum"] / max(sums["num_tokens"], 1.0), **means}


class NTILStepCallback(TrainerCallback):
    """Tells the loss which optimizer step is being taken (its lambda ramp reads it)."""

    def __init__(self, meter: PartsMeter) -> None:
        self.meter = meter

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.step = state.global_step


def report_parts(trainer: Any, meter: PartsMeter) -> None:
    """``trainer.log`` with the parts merged in first: into the log history, the console and every reporting
    callback (MLflow's included), with the loss they belong to; and the step the loss's ramp reads."""
    own_log = trainer.log  # a subclass's (TRL's, ms-swift's) included

    def log(logs: dict[str, float], *args, **kwargs):
        for mode, key, prefix in (("train", "loss", ""), ("eval", "eval_loss", "eval_")):
            if key in logs:
                parts = meter.take(mode, trainer.args.device)
                logs = {**logs, **{f"{prefix}{name}": value for name, value in parts.items()}}
        return own_log(logs, *args, **kwargs)

    trainer.log = log
    trainer.add_callback(NTILStepCallback(meter))


class NTILComputeLoss:
    """``compute_loss_func(outputs, labels, num_items_in_batch=None)`` for ``transformers.Trainer``: NTIL on
    the outputs' logits (see the module docstring for the normalisation)."""

    def __init__(self, loss: NTILLoss) -> None:
        self.loss = loss
        self.meter = PartsMeter()

    def __call__(self, outputs: Any, labels: torch.Tensor | None, num_items_in_batch=None, shift_labels=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        targets = aligned_targets(labels, shift_labels, logits.shape[1]).to(logits.device)
        out = self.loss(logits, targets, step=self.meter.step if torch.is_grad_enabled() else None)
        self.meter.add(out, "train" if torch.is_grad_enabled() else "eval")
        return self.normalised(out, num_items_in_batch)

    def normalised(self, out: NTILOutput, num_items_in_batch) -> torch.Tensor:
        if num_items_in_batch is None:  # no count of the step: this micro-batch's mean, as the Trainer does
            return out.loss
        return out.loss_sum / num_items_in_batch


def attach_ntil(
    trainer: Any,
    tokenizer_or_processor: Any,
    *,
    head: Literal["logits", "labelled"] = "logits",
    **loss_keys: Any,
) -> NTILComputeLoss:
    """Train ``trainer`` (a ``transformers.Trainer`` or TRL ``SFTTrainer``, already built) with NTIL: the
    recipe's ``loss.*`` keys as keyword arguments (:func:`ntil_ds.integrations.ntil_loss`). Returns the hook,
    whose ``.loss`` is the :class:`NTILLoss`. Call it on every rank (under DeepSpeed on CPU it takes a barrier)."""
    _check_trainer(trainer)
    loss = ntil_loss(tokenizer_or_processor, **loss_keys)
    if not isinstance(loss, NTILLoss):
        raise ValueError(
            f"attach_ntil trains NTIL (loss name ntil, emd or ce); got {type(loss).__name__}: for ntloss's "
            "number token loss use its own package"
        )
    if head not in ("logits", "labelled"):
        raise ValueError(
            f"head={head!r}: expected 'logits' (compute_loss_func) or 'labelled' (the labelled head)"
        )
    hook = NTILComputeLoss(loss)
    # Set either way: the Trainer counts num_items_in_batch, and leaves the accumulation scaling to the loss,
    # when a compute_loss_func is set.
    trainer.compute_loss_func = hook
    if head == "labelled":
        trainer.compute_loss = types.MethodType(_labelled_compute_loss, trainer)
    report_parts(trainer, hook.meter)
    # Only if the Trainer runs DeepSpeed (then it imported it): the adapter never imports DeepSpeed for nothing.
    if "deepspeed" in sys.modules:
        from ntil_ds.engine import unlink_cpu_allreduce_workspace_of_started_group

        # On CPU, DeepSpeed's allreduce leaves 64 MiB per rank in /dev/shm after the job (engine.py says why);
        # the process group exists once the Trainer is built, so it is unlinked here, on every rank.
        unlink_cpu_allreduce_workspace_of_started_group()
    return hook


def _labelled_compute_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """``Trainer.compute_loss`` through the labelled head (see the module docstring)."""
    hook: NTILComputeLoss = trainer.compute_loss_func
    inputs = dict(inputs)
    labels, shift_labels = inputs.pop("labels", None), inputs.pop("shift_labels", None)
    given = labels if labels is not None else shift_labels
    length = inputs["input_ids"].shape[1] if "input_ids" in inputs else getattr(given, "shape", (0, 0))[1]
    targets = aligned_targets(labels, shift_labels, length)
    module = trainer.accelerator.unwrap_model(model)
    head, softcap = head_module(module), applied_softcap(module)
    targets = targets.to(head.weight.device)
    rows = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    training = module.training
    target_rows, noise, _ = row_inputs(hook.loss, targets, rows, head.weight.dtype, None, False)
    with head_returns_row_stats(module, head, hook.loss, rows, target_rows, None, None, softcap):
        outputs = model(**inputs, use_cache=False)
    step = hook.meter.step if training else None
    out = loss_from_rows(hook.loss, targets, rows, outputs["logits"], noise, None, step)
    hook.meter.add(out, "train" if training else "eval")
    loss = hook.normalised(out, num_items_in_batch)
    if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * _averaged_processes(
            trainer
        )  # as Trainer.compute_loss: DDP/DeepSpeed then average over the ranks
    return (loss, {"loss": loss}) if return_outputs else loss


def _averaged_processes(trainer: Any) -> int:
    tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
    return trainer.accelerator.num_processes // tp


def _check_trainer(trainer: Any) -> None:
    """Refuse what would silently not train NTIL."""
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and getattr(parallelism, "sp_enabled", False):
        raise ValueError(
            "the Trainer's sequence parallelism computes the model's own loss and bypasses compute_loss_func: "
            "NTIL would not train. Train long sequences with ntil-ds's trainer (parallel.sequence_parallel_size), "
            "or drop parallelism_config's sp_size"
        )
    loss_type = getattr(trainer.args, "loss_type", None)
    if loss_type not in (None, "nll"):
        raise ValueError(
            f"SFTConfig(loss_type={loss_type!r}) computes its own loss, which NTIL cannot share a step with: use "
            "loss_type='nll' (NTIL already holds the cross-entropy)"
        )
    if getattr(trainer.args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel=True patches the model to skip the logits NTIL reads: turn it off, or use "
            "attach_ntil(..., head='labelled'), which never builds whole logits either"
        )
