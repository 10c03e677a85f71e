"""Stage 2 of the loss in torch: EMD, the straight-through numbers and REL/MAG per sequence.

This is the number stage as written with torch ops (`number_stage="eager"`, or through
`torch.compile` with "compile"), used on CPU and wherever the Triton number kernels
(`ntil_ds.loss.number_kernel`, the default on CUDA) do not run. Both return the same per-sequence
`ntil [S]` and `(emd, rel, mag) [S, 3]` (see `NTILLoss`), and both take the same inputs: the labels, the
gathered columns `[B*T, K]` and the row max of stage 1, the Gumbel noise and the optional
`unpack_index` of packed rows.

About 230 small torch ops per forward + backward (see docs/loss.md): cheap on CPU, a launch each
on CUDA. The float run and sequence sums use `index_add_`, which is sequential (deterministic) on
CPU and atomic (not bitwise reproducible) on CUDA.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from ntil_ds.loss import kernel_choice
from ntil_ds.loss.numbers import NumberLayout, NumberParams, analyse_numbers


def number_tables(params: NumberParams, place_values: torch.Tensor) -> torch.Tensor:
    """`[2, 2 * cap]` float32 for the Triton stage: the place values 10**k (k from -(cap-1) to cap-1, then a
    0), and digit_exp**k from the same torch.pow that `number_terms` calls (so the same bits)."""
    cap = params.max_number_digits
    exponents = torch.arange(-(cap - 1), cap + 1, dtype=torch.float32, device=place_values.device)
    return torch.stack([place_values.float(), torch.pow(params.digit_exp, exponents)])


def torch_number_terms(
    params: NumberParams,
    stage,
    labels: torch.Tensor,
    columns: torch.Tensor,
    row_max: torch.Tensor,
    noise: torch.Tensor | None,
    unpack_index: torch.Tensor | None,
    digit_ids: torch.Tensor,
    place_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ntil `[S]` and (emd, rel, mag) `[S, 3]` per sequence, with `stage` = `number_stage` or its compiled
    form."""
    if unpack_index is not None:  # small [B*T, <=31] tensors regathered sample by sample
        labels, columns, row_max, noise = unpack(
            unpack_index, params.ignore_index, labels, columns, row_max, noise
        )
    predicted_minus = None
    if params.minus_sign_id is not None:
        predicted_minus = columns[:, 10].detach() >= row_max
    digit_logits = columns[:, :10]
    rel_noise, mag_noise = (None, None) if noise is None else (noise[:, :10], noise[:, 10:])
    emd, rel, mag = stage(
        labels, digit_ids, digit_logits, place_values, rel_noise, mag_noise, predicted_minus
    )
    ntil = params.digit_alpha * emd + params.abs_alpha * rel + params.mag_alpha * mag
    return ntil, torch.stack([emd, rel, mag], dim=1)


def number_stage(
    params: NumberParams,
    labels: torch.Tensor,
    digit_ids: torch.Tensor,
    digit_logits: torch.Tensor,
    place_values: torch.Tensor,
    rel_noise: torch.Tensor | None,
    mag_noise: torch.Tensor | None,
    predicted_minus: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence EMD, REL, MAG `[B]` from `[B, T]` labels and `[B*T, 10]` logits (the region that
    number_stage="compile" compiles)."""
    layout = analyse_numbers(
        labels,
        digit_ids,
        ignore_index=params.ignore_index,
        decimal_point_id=params.decimal_point_id,
        minus_sign_id=params.minus_sign_id,
    )
    return number_terms(params, layout, digit_logits, place_values, rel_noise, mag_noise, predicted_minus)


def number_terms(
    params: NumberParams,
    layout: NumberLayout,
    digit_logits: torch.Tensor,
    place_values: torch.Tensor,
    rel_noise: torch.Tensor | None,
    mag_noise: torch.Tensor | None,
    predicted_minus: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence EMD, REL and MAG `[B]` from the digit logits `[B*T, 10]` (fp32)."""
    batch = layout.is_digit.shape[0]
    is_digit = layout.is_digit.flatten()
    digit = layout.digit.flatten()
    place = layout.place.flatten()
    cap = params.max_number_digits

    # Token level: place-weighted EMD between softmax(digit logits) and the one-hot target.
    dtype = digit_logits.dtype
    digit_values = torch.arange(10, dtype=dtype, device=digit_logits.device)
    distance = (digit_values[None, :] - digit[:, None]).abs()
    emd_per_position = (digit_logits.softmax(dim=-1) * distance).sum(dim=-1)
    weight = torch.pow(params.digit_exp, place.clamp(max=cap - 1).to(dtype))
    weighted = torch.where(is_digit, emd_per_position * weight, 0.0).view(batch, -1)
    emd = weighted.sum(dim=1) / layout.digits_per_sequence.clamp(min=1)

    # Sequence level: numbers per run. Digits beyond the cap read as 0 (index of the 0 entry).
    in_range = is_digit & (place > -cap) & (place < cap)
    place_index = torch.where(in_range, place + cap - 1, 2 * cap - 1)
    place_value = place_values.to(dtype)[place_index]
    num_slots = is_digit.numel()

    def run_sum(per_position: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_slots + 1, dtype=per_position.dtype, device=per_position.device)
        return out.index_add_(0, layout.run_slot, per_position * place_value)[:num_slots]

    target = run_sum(digit.to(dtype))
    target_sign = torch.where(layout.run_negative, -1.0, 1.0).to(dtype)
    predicted_sign = torch.ones_like(target_sign)
    if predicted_minus is not None:
        sign_position = layout.run_sign_position
        negative = predicted_minus[sign_position.clamp(min=0)] & (sign_position >= 0)
        predicted_sign = torch.where(negative, -1.0, 1.0).to(dtype)

    def predicted_numbers(noise: torch.Tensor | None) -> torch.Tensor:
        return run_sum(straight_through_digit(digit_logits, noise, params.gumbel_tau))

    if params.uses_gumbel:
        predicted_for_rel = predicted_numbers(rel_noise)
        predicted_for_mag = predicted_numbers(mag_noise) if mag_noise is not None else predicted_for_rel
    else:
        with torch.no_grad():
            predicted_for_rel = predicted_for_mag = predicted_numbers(None)

    signed_prediction = predicted_sign * predicted_for_rel
    signed_target = target_sign * target
    rel_per_run = (signed_prediction - signed_target).abs() / (torch.maximum(predicted_for_rel, target) + 1.0)
    rel_per_run = torch.where(signed_prediction == signed_target, 0.0, rel_per_run)
    mag_per_run = torch.log(
        (torch.maximum(predicted_for_mag, target) + 1.0) / (torch.minimum(predicted_for_mag, target) + 1.0)
    )

    runs = layout.runs_per_sequence.clamp(min=1)
    sequence = layout.run_sequence

    def per_sequence(per_run: torch.Tensor) -> torch.Tensor:
        per_run = torch.where(layout.run_exists, per_run, 0.0)
        return torch.zeros(batch, dtype=dtype, device=per_run.device).index_add_(0, sequence, per_run) / runs

    return emd, per_sequence(rel_per_run), per_sequence(mag_per_run)


def straight_through_digit(
    digit_logits: torch.Tensor, noise: torch.Tensor | None, tau: float
) -> torch.Tensor:
    """Digit value per position: argmax digit forward, Gumbel-softmax gradient backward.

    Written as the reference writes it (`onehot - soft.detach() + soft`, then `@ arange`) so
    the forward values carry the same float32 rounding, which the golden gradients depend on.
    """
    noisy = digit_logits if noise is None else digit_logits + noise
    soft = (noisy / tau).softmax(dim=-1)
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
    straight_through = hard - soft.detach() + soft
    return straight_through @ torch.arange(10, dtype=soft.dtype, device=digit_logits.device)


def unpack(index: torch.Tensor, ignore: int, labels: torch.Tensor, *per_position: torch.Tensor | None):
    """Packed per-position tensors laid out one sample per row: labels `[S, L]` (ignored past each
    sample's end) and the `[B*T, ...]` tensors as `[S*L, ...]` (the gather passes gradients back)."""
    flat = index.flatten().clamp(min=0)
    unpacked = labels.flatten()[flat].view(index.shape).masked_fill(index < 0, ignore)
    return (unpacked, *(None if t is None else t[flat] for t in per_position))


@functools.cache
def number_kernel_module() -> ModuleType | None:
    """The Triton number stage (ntil_ds.loss.number_kernel), or None where triton does not import."""
    try:
        from ntil_ds.loss import number_kernel
    except ImportError:  # no Triton (it is an extra): the torch stage
        return None
    return number_kernel


def resolve_number_stage(choice: str, dtype: torch.dtype, device: torch.device) -> str:
    """The stage `NTILLoss(number_stage=choice)` runs on columns of this dtype and device: "triton", "eager"
    or "compile". auto: the kernels on CUDA where Triton works (`kernel_choice` probes it once per process;
    otherwise the torch stage, with one warning); fp64 (gradcheck) always the torch stage, as the kernels
    compute in fp32."""
    if choice in ("eager", "compile"):
        return choice
    if dtype != torch.float32 or (
        choice == "auto" and not kernel_choice.auto_uses_triton(device, "the number stage")
    ):
        return "eager"
    if number_kernel_module() is None:
        if choice == "triton":
            raise RuntimeError(
                "number_stage='triton' but triton does not import: pip install 'ntil-ds[kernels]' (CUDA "
                "builds of torch bring it), or choose number_stage='auto' or 'eager' (loss.number_stage)."
            )
        return "eager"
    return "triton"


def kernel_number_terms(
    params: NumberParams,
    labels: torch.Tensor,
    columns: torch.Tensor,
    row_max: torch.Tensor,
    noise: torch.Tensor | None,
    unpack_index: torch.Tensor | None,
    digit_ids: torch.Tensor,
    tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_number_terms` on the Triton kernels: the same outputs, differentiable in `columns` `[N, K]`
    (fp32); one launch forward, one backward. `tables`: `number_tables`."""
    if columns.stride(1) != 1:
        columns = columns.contiguous()
    if noise is not None and noise.stride(1) != 1:
        noise = noise.contiguous()
    if unpack_index is not None:
        unpack_index = unpack_index.contiguous()
    return _KernelNumberTerms.apply(
        columns, labels.contiguous(), row_max.contiguous(), noise, unpack_index, digit_ids, tables, params
    )


class _KernelNumberTerms(torch.autograd.Function):
    """(columns [N, K], ...) -> ntil [S], (emd, rel, mag) [S, 3] per sequence, on `number_kernel`."""

    @staticmethod
    def forward(ctx, columns, labels, row_max, noise, unpack_index, digit_ids, tables, params):
        # An output without a gradient (the parts, usually) gets None in the backward, not a zero tensor.
        ctx.set_materialize_grads(False)
        kernel = number_kernel_module()
        ntil, parts, saved = kernel.forward(
            params, labels, columns, row_max, noise, unpack_index, digit_ids, tables
        )
        ctx.params = params
        ctx.save_for_backward(columns, noise, unpack_index, digit_ids, tables, *saved)
        return ntil, parts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ntil, grad_parts):
        columns, noise, unpack_index, digit_ids, tables, *saved = ctx.saved_tensors
        grad_columns = number_kernel_module().backward(
            ctx.params, grad_ntil, grad_parts, columns, noise, unpack_index, digit_ids, tables, saved
        )
        return grad_columns, None, None, None, None, None, None, None


def per_sample_sums(values: torch.Tensor, unpack_index: torch.Tensor | None) -> torch.Tensor:
    """``[S]``: per sequence (a row, or a packed sample of ``unpack_index [S, L]``), the sum of the
    ``[B, T]`` per-position values (0 at unlabelled positions)."""
    if unpack_index is None:
        return values.sum(dim=1)
    flat = values.reshape(-1)
    inside = unpack_index >= 0
    return torch.where(inside, flat[unpack_index.clamp(min=0)], flat.new_zeros(())).sum(dim=1)
