"""NTIL (Numerical Token Integrity Loss, Fei et al., ACL 2025) combined with cross-entropy.

The loss runs in two stages:

1. `vocab_stats.position_stats`: per position, the cross-entropy and the ten digit logits. It is
   the only part that sees the vocabulary, and it works on the full vocabulary or on one rank's
   vocabulary shard (then with two small all-reduces, see that module).
2. This module: everything else, on `[B, T, 10]` tensors that are identical on every rank of a
   vocabulary-parallel group, so the sharded and the unsharded loss share this code exactly.

Paper mode (the defaults) reproduces the authors' released implementation (xfey/NTIL `ntil.py`),
which computed the golden cases in `tests/unit/loss_golden/ntil_reference_cases.json`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ntil_ds.loss.number_terms import (
    kernel_number_terms,
    number_stage,
    number_tables,
    per_sample_sums,
    resolve_number_stage,
    torch_number_terms,
)
from ntil_ds.loss.numbers import NumberParams
from ntil_ds.loss.sequence_shards import SequenceShard, loss_over_shards, noise_for_slice
from ntil_ds.loss.vocab_stats import check_kernel_choice, compute_dtype, position_stats

# Added to NTIL in the rescaling factor CE / (NTIL + eps), as in the reference.
_RESCALE_EPS = 1e-10
NUMBER_STAGES = ("auto", "eager", "compile", "triton")


@dataclass(frozen=True)
class NTILOutput:
    """Result of one `NTILLoss` call (all 0-dim tensors; identical on every rank of a TP group).

    `loss` is differentiable (unless the logits are not); the parts are reported for logging.
    `loss_sum = loss * num_tokens` lets a trainer sum micro-batches and divide by the global
    count of labelled tokens of the optimizer step.
    """

    loss: torch.Tensor  # CE_mean + ntil_lambda * stopgrad(CE_mean / (NTIL + 1e-10)) * NTIL
    ntil: torch.Tensor  # digit_alpha * emd + abs_alpha * rel + mag_alpha * mag
    emd: torch.Tensor  # place-weighted EMD, mean over sequences
    rel: torch.Tensor  # relative number error, mean over sequences
    mag: torch.Tensor  # order-of-magnitude error, mean over sequences
    ce_sum: torch.Tensor  # summed cross-entropy over labelled positions
    ce_mean: torch.Tensor  # ce_sum / num_tokens (0 when there is no labelled token)
    num_tokens: torch.Tensor  # int64 count of labels != ignore_index
    loss_sum: torch.Tensor  # loss * num_tokens


class NTILLoss:
    """Cross-entropy plus NTIL on aligned `logits[B, T, V]` and `labels[B, T]`.

    Paper mode (defaults), with `p_t = softmax(z_t[digits])` and runs of digit labels as numbers:

    - token level: `emd_b = mean over digit labels t of digit_exp**k_t * sum_j p_t[j] |j - d_t|`,
      where `k_t` is the place exponent of the digit in its run (last digit k = 0);
    - sequence level: per run, the predicted number X is read from a hard straight-through
      Gumbel-softmax (temperature `gumbel_tau`, noise `gumbel_noise_scale * Gumbel(0, 1)`) over the
      digit logits, the target Y from the labels; `rel = |X - Y| / (max(X, Y) + 1)` (exactly 0
      when X == Y) and `mag = log((max(X, Y) + 1) / (min(X, Y) + 1))`, each a mean over the runs
      of the sequence (two independent noise samples, as in the reference);
    - `ntil = mean_b(digit_alpha * emd_b + abs_alpha * rel_b + mag_alpha * mag_b)`; digit-free
      sequences count with 0;
    - `loss = ce_mean + ntil_lambda * stopgrad(ce_mean / (ntil + 1e-10)) * ntil`: its value is
      `(1 + ntil_lambda) * ce_mean`, NTIL only shapes the gradient.

    Always on (deviations from the reference that only matter where it breaks): runs longer than
    `max_number_digits` are read modulo `10**max_number_digits` for X and Y, and their EMD place
    weight stops growing at `digit_exp**(max_number_digits - 1)`, so nothing overflows; a batch
    with no labelled token gives loss 0 and zero gradients; `ntil_lambda == 0` gives exactly the
    cross-entropy (NTIL and its parts are still reported, computed without gradient); when
    `abs_alpha == mag_alpha == 0` no Gumbel noise is drawn and `rel`/`mag` are reported from the
    noise-free argmax digits.

    Beyond the paper (off by default):

    - `decimal_numbers=True` (needs `decimal_point_id`): a `.` label between two digit labels
      joins them into one real number when that stretch holds exactly one such dot ("3.015" is
      3.015; "1.2.3" stays three integers). Fractional digits get negative exponents, so their EMD
      weight is `digit_exp**k < 1` and X, Y are real values.
    - `signed_numbers=True` (needs `minus_sign_id`): a `-` label right before a run (and not right
      after a digit) makes Y negative. The predicted sign is the model's: X is negative when the
      minus token is the argmax at the position just before the run, when that position could hold
      a sign (it is labelled and does not follow a digit; the sign has no gradient, cross-entropy
      trains it). With `Xs`, `Ys` the signed
      values and X, Y the magnitudes: `rel = |Xs - Ys| / (max(X, Y) + 1)` (0 when Xs == Ys), which
      stays in [0, 2) and is the unsigned value when the signs agree; `mag` is unchanged (it
      compares magnitudes).

    Vocabulary parallel: pass `process_group` and `vocab_start` and this rank's slice
    `[B, T, V_local]` of the logits (shards may be uneven). Every rank returns the same output and
    gets the gradient of the global loss for its slice. Communication per call: an all-reduce MAX
    of B*T floats and an all-reduce SUM of B*T*(3 + 10 [+1 minus] [+20 noise]) floats; nothing
    depends on V (see `ntil_ds.loss.vocab_stats`). The Gumbel noise is drawn on the group's first
    rank from `generator` (or the default generator) and travels inside the SUM all-reduce, so all
    ranks use the same noise whatever their generators; its shape is `[2, B*T, 10]` (the REL and
    the MAG sample), so the sharded loss with the first rank's generator equals the unsharded loss
    with a generator in the same state.

    Labels outside the vocabulary (neither `ignore_index` nor a valid id) give a NaN loss instead
    of an error, because detecting them would need a host sync.

    Implementation choices (same numbers within float rounding, see docs/loss.md):

    - `kernel`: the vocabulary stage. "auto" runs the fused Triton kernels on CUDA logits in
      fp32/bf16/fp16 where Triton works (a trivial kernel compiled and launched once per process,
      `kernel_choice`; a failure is one warning) and the torch tiles otherwise; "torch" always the torch
      tiles; "triton" always the kernels (an error without Triton; CPU tensors only under Triton's
      interpreter, TRITON_INTERPRET=1).
    - `number_stage`: stage 2. "auto" runs the Triton number kernels (`number_kernel`: one launch
      forward, one backward, deterministic) on CUDA where Triton works, the torch stage otherwise;
      "eager" always the torch stage as written; "compile" the torch stage through
      `torch.compile(dynamic=True)` (compiled at the first call, once per instance); "triton" always
      the kernels (an error without Triton; CPU tensors only under TRITON_INTERPRET=1). fp64 columns
      (fp64 logits on the torch vocabulary path) always take the torch stage.
    """

    def __init__(
        self,
        digit_token_ids: Sequence[int],
        ntil_lambda: float = 0.3,
        digit_alpha: float = 1.0,
        abs_alpha: float = 0.2,
        mag_alpha: float = 0.2,
        digit_exp: float = 1.2,
        gumbel_tau: float = 0.1,
        gumbel_noise_scale: float = 0.01,
        ignore_index: int = -100,
        decimal_numbers: bool = False,
        signed_numbers: bool = False,
        decimal_point_id: int | None = None,
        minus_sign_id: int | None = None,
        max_number_digits: int = 18,
        kernel: Literal["auto", "torch", "triton"] = "auto",
        number_stage: Literal["auto", "eager", "compile", "triton"] = "auto",
        ntil_lambda_ramp_steps: int = 0,
        ntil_ratio: Literal["batch", "sample"] = "batch",
    ) -> None:
        ids = list(digit_token_ids)
        if len(ids) != 10 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(
                f"digit_token_ids must be the 10 integer token ids of '0'..'9' in that order, got {ids!r}; "
                "build them with ntil_ds.loss.digit_token_ids_from_tokenizer(tokenizer)."
            )
        if len(set(ids)) != 10 or min(ids) < 0:
            raise ValueError(f"digit_token_ids must be 10 distinct non-negative ids, got {ids}.")
        for name, value in [("ntil_lambda", ntil_lambda), ("digit_alpha", digit_alpha),
                            ("abs_alpha", abs_alpha), ("mag_alpha", mag_alpha),
                            ("gumbel_noise_scale", gumbel_noise_scale)]:  # fmt: skip
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        for name, value in [("digit_exp", digit_exp), ("gumbel_tau", gumbel_tau)]:
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
        if not 1 <= max_number_digits <= 30:
            raise ValueError(
                f"max_number_digits must be in [1, 30] (float32 place values), got {max_number_digits}."
            )
        if decimal_numbers and decimal_point_id is None:
            raise ValueError("decimal_numbers=True needs decimal_point_id (the token id of '.').")
        if signed_numbers and minus_sign_id is None:
            raise ValueError("signed_numbers=True needs minus_sign_id (the token id of '-').")
        for name, value in [("decimal_point_id", decimal_point_id), ("minus_sign_id", minus_sign_id)]:
            if value is not None and (value < 0 or value in ids):
                raise ValueError(f"{name}={value} must be a non-negative id that is not a digit token.")
        if decimal_numbers and signed_numbers and decimal_point_id == minus_sign_id:
            raise ValueError(
                f"decimal_point_id and minus_sign_id are both {minus_sign_id}: they must differ."
            )
        if isinstance(ntil_lambda_ramp_steps, bool) or not (
            isinstance(ntil_lambda_ramp_steps, int) and ntil_lambda_ramp_steps >= 0
        ):
            raise ValueError(
                f"ntil_lambda_ramp_steps must be an integer >= 0, got {ntil_lambda_ramp_steps!r}."
            )
        if ntil_ratio not in ("batch", "sample"):
            raise ValueError(f"ntil_ratio={ntil_ratio!r}: expected 'batch' or 'sample'.")
        check_kernel_choice(kernel)
        if number_stage not in NUMBER_STAGES:
            raise ValueError(
                f"number_stage={number_stage!r}: expected one of {', '.join(map(repr, NUMBER_STAGES))}."
            )

        self.digit_token_ids = ids
        self.ntil_lambda = float(ntil_lambda)
        self.digit_alpha = float(digit_alpha)
        self.abs_alpha = float(abs_alpha)
        self.mag_alpha = float(mag_alpha)
        self.digit_exp = float(digit_exp)
        self.gumbel_tau = float(gumbel_tau)
        self.gumbel_noise_scale = float(gumbel_noise_scale)
        self.ignore_index = int(ignore_index)
        self.decimal_point_id = decimal_point_id if decimal_numbers else None
        self.minus_sign_id = minus_sign_id if signed_numbers else None
        self.max_number_digits = int(max_number_digits)
        self.kernel = kernel
        self.number_stage = number_stage
        self.ntil_lambda_ramp_steps = ntil_lambda_ramp_steps
        self.ntil_ratio = ntil_ratio
        # Columns gathered per position: the ten digits, then the minus sign in signed mode.
        self._column_ids = ids + ([minus_sign_id] if self.minus_sign_id is not None else [])
        self._params = NumberParams(
            digit_alpha=self.digit_alpha,
            abs_alpha=self.abs_alpha,
            mag_alpha=self.mag_alpha,
            digit_exp=self.digit_exp,
            gumbel_tau=self.gumbel_tau,
            ignore_index=self.ignore_index,
            decimal_point_id=self.decimal_point_id,
            minus_sign_id=self.minus_sign_id,
            max_number_digits=self.max_number_digits,
        )
        self._constants: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._compiled_number_stage = None

    def __repr__(self) -> str:
        return (
            f"NTILLoss(ntil_lambda={self.ntil_lambda}, digit_alpha={self.digit_alpha}, abs_alpha={self.abs_alpha}, "
            f"mag_alpha={self.mag_alpha}, digit_exp={self.digit_exp}, gumbel_tau={self.gumbel_tau}, "
            f"gumbel_noise_scale={self.gumbel_noise_scale}, decimal={self.decimal_point_id is not None}, "
            f"signed={self.minus_sign_id is not None}, kernel={self.kernel!r}, number_stage={self.number_stage!r})"
        )

    @property
    def uses_gumbel(self) -> bool:
        """REL/MAG carry gradient (so their straight-through reconstruction is needed)."""
        return self._params.uses_gumbel

    def _device_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Digit ids, gathered column ids, the float32 place-value table 10**k for k in [-(cap-1),
        cap-1] plus a 0, and the Triton stage's tables (`number_terms.number_tables`); made on the
        device once (a copy per call would sync)."""
        if device not in self._constants:
            cap = self.max_number_digits
            places = [10.0**k for k in range(-(cap - 1), cap)] + [0.0]
            place_values = torch.tensor(places, dtype=torch.float32, device=device)
            self._constants[device] = (
                torch.tensor(self.digit_token_ids, dtype=torch.long, device=device),
                torch.tensor(self._column_ids, dtype=torch.long, device=device),
                place_values,
                number_tables(self._params, place_values),
            )
        return self._constants[device]

    def _check_inputs(
        self, logits: torch.Tensor, labels: torch.Tensor, process_group, vocab_start: int
    ) -> None:
        if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
            raise ValueError(
                f"NTILLoss expects logits [B, T, V] and labels [B, T] (aligned: shift before the loss), "
                f"got logits {tuple(logits.shape)} and labels {tuple(labels.shape)}."
            )
        if not logits.is_floating_point():
            raise TypeError(f"logits must be a float tensor, got {logits.dtype}.")
        if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}.")
        if logits.device != labels.device:
            raise ValueError(f"logits are on {logits.device} but labels on {labels.device}.")
        if process_group is None:
            if vocab_start != 0:
                raise ValueError("vocab_start is only meaningful with a process_group (vocabulary shards).")
            if max(self._column_ids) >= logits.shape[-1]:
                raise ValueError(
                    f"token id {max(self._column_ids)} (digits/minus) is outside the logits' vocabulary of "
                    f"{logits.shape[-1]}: are these the right tokenizer's ids?"
                )
        elif vocab_start < 0:
            raise ValueError(f"vocab_start must be >= 0, got {vocab_start}.")

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        process_group: dist.ProcessGroup | None = None,
        vocab_start: int = 0,
        generator: torch.Generator | None = None,
        unpack_index: torch.Tensor | None = None,
        step: int | None = None,
        sequence: SequenceShard | None = None,
    ) -> NTILOutput:
        """Loss of one micro-batch. See the class docstring; no host sync, any B and T.

        `unpack_index [S, L]` (packed rows, see `ntil_ds.data.packing`): the flat position of each of S
        samples' tokens, -1 past a sample's end. The number terms then see one sequence per sample (their
        means are per sample, as unpacked); the cross-entropy does not depend on the layout.
        `sequence`: the logits and labels are this rank's slice of rows split over a sequence-parallel
        group (`ntil_ds.loss.sequence_shards`); the result is this rank's share of the rows' loss.
        """
        self._check_inputs(logits, labels, process_group, vocab_start)
        batch, length, local_vocab = logits.shape
        labels = labels.long()
        targets, noise = self.position_targets_and_noise(
            labels, compute_dtype(logits.dtype), generator, sequence
        )
        # Vocabulary shards: the first rank's noise reaches every rank inside the SUM all-reduce.
        ce, columns, row_max, received = position_stats(
            logits.reshape(batch * length, local_vocab),
            targets,
            self.column_ids_on(logits.device),
            vocab_start=vocab_start,
            process_group=process_group,
            payload=None if process_group is None else noise,
            kernel=self.kernel,
        )
        if process_group is not None:
            noise = received
        return self.from_position_stats(labels, ce, columns, row_max, noise, unpack_index, step, sequence)

    def column_ids_on(self, device: torch.device) -> torch.Tensor:
        """The token ids whose logits stage 2 reads (the ten digits, then the minus sign in signed mode),
        the int64 tensor on ``device`` that stage 1 gathers (made once per device: no copy per call)."""
        return self._device_constants(device)[1]

    @property
    def noise_width(self) -> int:
        """Gumbel numbers drawn per position: REL's sample of the ten digits, then MAG's."""
        return 2 * 10

    def position_targets_and_noise(
        self,
        labels: torch.Tensor,
        dtype: torch.dtype,
        generator: torch.Generator | None,
        sequence: SequenceShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 1's inputs for ``[B, T]`` labels: flat targets ``[B*T]`` (-1 = no label; other negative
        ids are invalid and must show up as NaN) and the Gumbel noise ``[B*T, 20]`` in ``dtype`` drawn from
        ``generator`` (None when no term uses it). The labelled head takes both at its rows. With
        ``sequence`` the noise is drawn for the whole rows and this slice's part returned."""
        labels = labels.long()
        labelled = labels != self.ignore_index
        targets = torch.where(labelled, torch.where(labels < 0, torch.iinfo(torch.long).max, labels), -1)

        def draw(num_positions: int, generator: torch.Generator | None) -> torch.Tensor | None:
            if not (self.uses_gumbel and self.gumbel_noise_scale > 0):
                return None
            exponential = torch.empty(num_positions, self.noise_width, dtype=dtype, device=labels.device)
            exponential.exponential_(generator=generator)
            return -exponential.log() * self.gumbel_noise_scale

        if sequence is not None:
            return targets.flatten(), noise_for_slice(draw, labels.shape[0], sequence, generator)
        return targets.flatten(), draw(labels.numel(), generator)

    def from_position_stats(
        self,
        labels: torch.Tensor,
        ce: torch.Tensor,
        columns: torch.Tensor,
        row_max: torch.Tensor,
        noise: torch.Tensor | None,
        unpack_index: torch.Tensor | None = None,
        step: int | None = None,
        sequence: SequenceShard | None = None,
    ) -> NTILOutput:
        """The loss from stage 1's per-position results over ``[B, T]`` labels (``[B*T]`` ce and row max,
        ``[B*T, C]`` columns, the noise as stage 1 passed it on): the number stage and the combination.
        With ``sequence``: this rank's share of the loss of the whole rows (``loss_over_shards``)."""
        if sequence is not None:
            whole_rows = functools.partial(self.from_position_stats, unpack_index=unpack_index, step=step)
            return loss_over_shards(whole_rows, labels, ce, columns, row_max, noise, sequence)
        labels = labels.long()
        labelled = labels != self.ignore_index
        num_tokens = labelled.sum()
        ce_sum = ce.sum()
        ce_mean = ce_sum / num_tokens.clamp(min=1)

        if self.ntil_lambda > 0:
            ntil_per_sequence, parts = self._number_terms(labels, columns, row_max, noise, unpack_index)
        else:
            with torch.no_grad():
                ntil_per_sequence, parts = self._number_terms(
                    labels, columns.detach(), row_max, noise, unpack_index
                )
        ntil = ntil_per_sequence.mean()
        emd, rel, mag = parts.mean(dim=0).unbind()  # means over the sequences

        if self.ntil_lambda > 0:
            weight = self.lambda_at(step)
            if self.ntil_ratio == "sample":
                # Each sample's NTIL rescaled to its own summed CE, over the batch's tokens: the value stays
                # (1 + lambda) * ce_mean and no sample's gradient depends on the others of its micro-batch.
                ce_per_sample = per_sample_sums(ce.reshape(labels.shape), unpack_index)
                rescale = (ce_per_sample / (ntil_per_sequence + _RESCALE_EPS)).detach()
                loss = ce_mean + weight * (rescale * ntil_per_sequence).sum() / num_tokens.clamp(min=1)
            else:
                rescale = (ce_mean / (ntil + _RESCALE_EPS)).detach()
                loss = ce_mean + weight * rescale * ntil
        else:
            loss = ce_mean
        return NTILOutput(
            loss=loss,
            ntil=ntil,
            emd=emd,
            rel=rel,
            mag=mag,
            ce_sum=ce_sum,
            ce_mean=ce_mean,
            num_tokens=num_tokens,
            loss_sum=loss * num_tokens,
        )

    def lambda_at(self, step: int | None) -> float:
        """The NTIL weight at optimizer step ``step`` (0-based): ``ntil_lambda * min(1, step / ramp_steps)``
        with a ramp, else ``ntil_lambda``; ``None`` (evaluation, a direct call) is the ramp's end."""
        ramp = self.ntil_lambda_ramp_steps
        if ramp == 0 or step is None or step >= ramp:
            return self.ntil_lambda
        return self.ntil_lambda * step / ramp

    def number_stage_for(self, columns: torch.Tensor) -> str:
        """What runs stage 2 on these columns: "triton", "eager" or "compile" (see the class docstring)."""
        return resolve_number_stage(self.number_stage, columns.dtype, columns.device)

    def _number_terms(
        self, labels, columns, row_max, noise, unpack_index
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ntil `[S]` and (emd, rel, mag) `[S, 3]` per sequence, by the stage `number_stage_for` picks."""
        digit_ids, _, place_values, tables = self._device_constants(columns.device)
        stage = self.number_stage_for(columns)
        if stage == "triton":
            return kernel_number_terms(
                self._params, labels, columns, row_max, noise, unpack_index, digit_ids, tables
            )
        run = functools.partial(number_stage, self._params)
        if stage == "compile":
            if self._compiled_number_stage is None:  # once per instance; dynamic shapes
                self._compiled_number_stage = torch.compile(run, dynamic=True)
            run = self._compiled_number_stage
        return torch_number_terms(
            self._params, run, labels, columns, row_max, noise, unpack_index, digit_ids, place_values
        )
