"""Stage 2 of the loss as two Triton kernels: the number terms in one launch forward, one backward.

The torch number stage (`number_terms.number_stage`) is ~230 small ops per forward + backward, a launch
each on a GPU. Here the same computation takes stage 1's `[B*T, K]` column logits to the same
per-sequence ntil `[S]` and (emd, rel, mag) `[S, 3]`. Forward: one program per sequence, three passes
over its positions in blocks of `BLOCK`:

1. (left to right) a code per position: its digit 0-9, a decimal point, a minus sign, another label, or
   none (`ignore_index`, past a packed sample's end).
2. (left to right, decimal mode) the joining dots ('.' between two digits) so far in each stretch of
   digits and dots, and where the last one was: a dot is a decimal point only when its stretch holds
   exactly one (the rule of `numbers.analyse_numbers`).
3. (right to left) where each run ends (a running minimum carried from the blocks to the right), hence
   every digit's place exponent; EMD; the straight-through Gumbel digits; Y and X as segmented scans
   restarting at each run's last digit, complete at its first; there, the signs, REL, MAG and their
   derivatives by X, stored at the run's last position with each digit's place and run end.

Backward: one program per block of positions, no scan: dEMD and dX through the Gumbel softmax.
Every sum has a fixed order (tree reductions and scans, no atomics): both directions are bitwise
deterministic. A program's passes share per-position scratch in global memory, ordered by a barrier.
Written for triton >= 3.2; `TRITON_INTERPRET=1` runs it on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ntil_ds.loss.numbers import NumberParams
from ntil_ds.loss.vocab_kernel import on_device

# Positions per step of a program, and warps: from the compile check (tests/unit/test_kernel_compile.py;
# sweep and reasons in docs/loss.md), the same on sm_80/90/100. Forward (a program walks its sequence):
# the widest step without spills; backward (independent blocks): the smallest wide program, spread over
# the most SMs. Tests shrink the blocks to cross their edges.
FORWARD_BLOCK, FORWARD_WARPS = 512, 16
BACKWARD_BLOCK, BACKWARD_WARPS = 128, 4

# Per position, int32: [code, place, run's last position (-1: not a digit), joining dots so far in the
# stretch, position of the last joining dot] (the last two: decimal mode, pass 2 -> pass 3).
_WIDTH = tl.constexpr(5)
# Position codes after the digit values 0-9: a decimal point, a minus sign, another label, no label.
_POINT, _MINUS, _OTHER, _UNLABELLED = tl.constexpr(10), tl.constexpr(11), tl.constexpr(12), tl.constexpr(13)


def _interpreting() -> bool:
    return not isinstance(_forward_kernel, triton.runtime.JITFunction)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _segment_sums(y1, xr1, xm1, restart1, y2, xr2, xm2, restart2):
    # Segmented sum: an element with `restart` begins a new segment (a run, seen from its last digit).
    go_on = restart2 == 0
    y = tl.where(go_on, y1 + y2, y2)
    xr = tl.where(go_on, xr1 + xr2, xr2)
    xm = tl.where(go_on, xm1 + xm2, xm2)
    return y, xr, xm, restart1 | restart2


@triton.jit
def _rows(unpack_ptr, unpack_stride, has_unpack, seq, t, length):
    """Row of stage 1's tensors holding position t of sequence `seq`; -1 where there is none."""
    inside = (t >= 0) & (t < length)
    rows = seq.to(tl.int64) * length + t
    if has_unpack != 0:
        rows = tl.load(unpack_ptr + seq.to(tl.int64) * unpack_stride + t, mask=inside, other=-1)
    return tl.where(inside, rows, -1)


@triton.jit
def _codes(layout_ptr, base, t, length):
    inside = (t >= 0) & (t < length)
    return tl.load(layout_ptr + (base + t) * _WIDTH, mask=inside, other=_UNLABELLED)


@triton.jit
def _softmax(x):
    """Row softmax as torch computes it: exp(x - max) / sum."""
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _straight_through(noisy, tau):
    """(soft [BLOCK, 16], forward digit value): `argmax * ((1 - s_max) + s_max)`, which is what the
    reference's `(onehot - soft.detach() + soft) @ arange` rounds to in float32."""
    soft = _softmax(noisy / tau)
    top = tl.max(soft, axis=1)
    value = tl.argmax(soft, axis=1).to(tl.float32) * ((1.0 - top) + top)
    return soft, value


@triton.jit
def _place_weight(tables_ptr, table_width, place, cap, log2_base, is_digit):
    """digit_exp ** min(place, cap - 1), from the table torch.pow filled (exp2 below the table)."""
    exponent = tl.minimum(place, cap - 1)
    in_table = exponent > -cap
    tabled = tl.load(tables_ptr + table_width + exponent + cap - 1, mask=is_digit & in_table, other=0.0)
    return tl.where(in_table, tabled, tl.exp2(exponent.to(tl.float32) * log2_base))


@triton.jit
def _run_terms(x_rel, x_mag, y, predicted_sign, target_sign):
    """REL, dREL/dX, MAG, dMAG/dX of runs with numbers X (two noise samples) and Y >= 0, as autograd
    differentiates the torch stage's formulas: sign(0) = 0, a tie splits max's and min's gradient."""
    signed_x = predicted_sign * x_rel
    gap = signed_x - target_sign * y
    exact = gap == 0
    denominator = tl.maximum(x_rel, y) + 1.0
    rel = tl.where(exact, 0.0, tl.abs(gap) / denominator)
    d_max = tl.where(x_rel > y, 1.0, tl.where(x_rel == y, 0.5, 0.0))
    gap_sign = tl.where(gap > 0, 1.0, tl.where(gap < 0, -1.0, 0.0))
    d_rel = gap_sign * predicted_sign / denominator - tl.abs(gap) / (denominator * denominator) * d_max
    high = tl.maximum(x_mag, y) + 1.0
    low = tl.minimum(x_mag, y) + 1.0
    d_high = tl.where(x_mag > y, 1.0, tl.where(x_mag == y, 0.5, 0.0))
    d_low = tl.where(x_mag < y, 1.0, tl.where(x_mag == y, 0.5, 0.0))
    d_mag = (low / high) * (d_high / low - d_low * high / (low * low))
    return rel, tl.where(exact, 0.0, d_rel), tl.log(high / low), d_mag


# Ints not specialized (== 1 would be a constexpr, % 16 == 0 a hint): one compile serves all calls. The 0/1
# flags (bools break the interpreter); sizes and strides, which packing changes each step (~1 s a compile).
@triton.jit(do_not_specialize=["has_unpack", "decimal", "signed", "has_noise",
            "unpack_stride", "columns_stride", "noise_stride", "table_width", "length"])  # fmt: skip
def _forward_kernel(
    labels_ptr, unpack_ptr, unpack_stride, has_unpack,
    digit_ids_ptr, ignore_index, point_id, decimal, minus_id, signed,
    columns_ptr, columns_stride, row_max_ptr, noise_ptr, noise_stride, has_noise,
    tables_ptr, table_width, cap, log2_base, tau, digit_alpha, abs_alpha, mag_alpha,
    layout_ptr, coef_ptr, ntil_ptr, parts_ptr, counts_ptr, length,
    BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    base = seq.to(tl.int64) * length
    lanes = tl.arange(0, BLOCK)
    digit_lanes = tl.arange(0, 16)
    is_lane = digit_lanes < 10
    digit_ids = tl.load(digit_ids_ptr + digit_lanes, mask=is_lane, other=0)
    num_blocks = tl.cdiv(length, BLOCK)

    # Pass 1: a code per position.
    for block in range(0, num_blocks):
        t = block * BLOCK + lanes
        rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t, length)
        label = tl.load(labels_ptr + rows, mask=rows >= 0, other=ignore_index)
        match = (label[:, None] == digit_ids[None, :]) & is_lane[None, :]
        code = tl.where(label == ignore_index, _UNLABELLED, _OTHER)
        code = tl.where((decimal != 0) & (label == point_id), _POINT, code)
        code = tl.where((signed != 0) & (label == minus_id), _MINUS, code)
        digit = tl.sum(tl.where(match, digit_lanes[None, :], 0), axis=1)  # the ids are distinct
        code = tl.where(tl.max(match.to(tl.int32), axis=1) > 0, digit, code)
        tl.store(layout_ptr + (base + t) * _WIDTH, code, mask=t < length)
    tl.debug_barrier()

    # Pass 2 (decimal mode): joining dots so far in each stretch, and the last one's position.
    if decimal != 0:
        dots = 0  # joining dots of the sequence so far
        dots_at_break = 0  # ... at the last position outside a stretch
        last_dot = -1
        for block in range(0, num_blocks):
            t = block * BLOCK + lanes
            code = _codes(layout_ptr, base, t, length)
            joining = (code == _POINT) & (_codes(layout_ptr, base, t - 1, length) < 10)
            joining = joining & (_codes(layout_ptr, base, t + 1, length) < 10)
            stretch = (code < 10) | joining
            count = tl.cumsum(joining.to(tl.int32), axis=0) + dots
            at_break = tl.where(stretch, 0, count)
            since_break = count - tl.maximum(tl.associative_scan(at_break, 0, _maximum), dots_at_break)
            last = tl.maximum(tl.associative_scan(tl.where(joining, t, -1), 0, _maximum), last_dot)
            tl.store(layout_ptr + (base + t) * _WIDTH + 3, since_break, mask=t < length)
            tl.store(layout_ptr + (base + t) * _WIDTH + 4, last, mask=t < length)
            dots += tl.sum(joining.to(tl.int32), axis=0)
            dots_at_break = tl.maximum(dots_at_break, tl.max(at_break, axis=0))
            last_dot = tl.maximum(last_dot, tl.max(last, axis=0))
        tl.debug_barrier()

    # Pass 3, right to left: places, EMD, run sums (complete at each run's first digit), REL, MAG.
    stretch_carry, run_carry = length, length  # first position outside a stretch / a run, right of here
    carry_y, carry_xr, carry_xm = 0.0, 0.0, 0.0  # sums of the run open at this block's right edge
    emd_sum, rel_sum, mag_sum = 0.0, 0.0, 0.0
    digits, runs = 0, 0
    for block in range(0, num_blocks):
        t = length - 1 - block * BLOCK - lanes  # descending: a scan over lanes runs right to left
        inside = t >= 0
        code = _codes(layout_ptr, base, t, length)
        before = _codes(layout_ptr, base, t - 1, length)
        before2 = _codes(layout_ptr, base, t - 2, length)
        is_digit = code < 10
        member = is_digit
        member_before = before < 10
        one_dot = lanes < 0  # (all False) the position's stretch holds exactly one joining dot
        dot_at = t
        if decimal != 0:
            joining = (code == _POINT) & (before < 10) & (_codes(layout_ptr, base, t + 1, length) < 10)
            stretch = is_digit | joining
            outside = tl.where(stretch, length, t)
            stretch_stop = tl.minimum(tl.associative_scan(outside, 0, _minimum), stretch_carry)
            stretch_carry = tl.minimum(stretch_carry, tl.min(tl.where(inside, outside, length), axis=0))
            stretch_last = base + stretch_stop - 1
            dots_in_stretch = tl.load(layout_ptr + stretch_last * _WIDTH + 3, mask=stretch, other=0)
            one_dot = stretch & (dots_in_stretch == 1)
            dot_at = tl.load(layout_ptr + stretch_last * _WIDTH + 4, mask=one_dot, other=0)
            member = is_digit | (joining & one_dot)
            joining_before = (before == _POINT) & (before2 < 10) & is_digit
            member_before = (before < 10) | (joining_before & one_dot)
        outside_run = tl.where(member, length, t)
        run_stop = tl.minimum(tl.associative_scan(outside_run, 0, _minimum), run_carry)
        run_carry = tl.minimum(run_carry, tl.min(tl.where(inside, outside_run, length), axis=0))
        place = run_stop - t - 1
        place = tl.where(one_dot, tl.where(t < dot_at, dot_at - t - 1, dot_at - t), place)
        run_start = member & ~member_before
        run_last = member & (run_stop == t + 1)

        # Token level: place-weighted EMD of softmax(digit logits) to the target digit.
        rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t, length)
        digit = tl.where(is_digit, code, 0).to(tl.float32)
        tile = is_digit[:, None] & is_lane[None, :]
        pointers = rows[:, None] * columns_stride + digit_lanes[None, :]
        logits = tl.load(columns_ptr + pointers, mask=tile, other=0.0)
        logits = tl.where(is_lane[None, :], logits, float("-inf"))
        distance = tl.abs(digit_lanes[None, :].to(tl.float32) - digit[:, None])
        emd = tl.sum(_softmax(logits) * distance, axis=1)
        weight = _place_weight(tables_ptr, table_width, place, cap, log2_base, is_digit)
        emd_sum += tl.sum(tl.where(is_digit, emd * weight, 0.0), axis=0)
        digits += tl.sum(is_digit.to(tl.int32), axis=0)

        # Sequence level: X (two noise samples) and Y per run.
        noise_pointers = rows[:, None] * noise_stride + digit_lanes[None, :]
        noise = tl.load(noise_ptr + noise_pointers, mask=tile & (has_noise != 0), other=0.0)
        _, value_rel = _straight_through(logits + noise, tau)
        value_mag = value_rel
        if has_noise != 0:
            noise = tl.load(noise_ptr + noise_pointers + 10, mask=tile, other=0.0)
            _, value_mag = _straight_through(logits + noise, tau)
        in_range = is_digit & (place > -cap) & (place < cap)
        place_value = tl.load(tables_ptr + place + cap - 1, mask=in_range, other=0.0)
        sums = tl.associative_scan(
            (digit * place_value, value_rel * place_value, value_mag * place_value, run_last.to(tl.int32)),
            0,
            _segment_sums,
        )
        open_right = sums[3] == 0  # before this block's first run end: the run open at its right edge
        y = tl.where(open_right, sums[0] + carry_y, sums[0])
        x_rel = tl.where(open_right, sums[1] + carry_xr, sums[1])
        x_mag = tl.where(open_right, sums[2] + carry_xm, sums[2])
        continues = (lanes == BLOCK - 1) & member & ~run_start
        carry_y = tl.sum(tl.where(continues, y, 0.0), axis=0)
        carry_xr = tl.sum(tl.where(continues, x_rel, 0.0), axis=0)
        carry_xm = tl.sum(tl.where(continues, x_mag, 0.0), axis=0)

        # Runs complete at their first digit: signs, REL, MAG and their derivatives by X.
        can_sign = (t >= 1) & (before != _UNLABELLED) & (before2 >= 10)
        target_sign = tl.where((signed != 0) & can_sign & (before == _MINUS), -1.0, 1.0)
        sign_rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t - 1, length)
        reads_sign = (signed != 0) & run_start & can_sign
        minus_logit = tl.load(columns_ptr + sign_rows * columns_stride + 10, mask=reads_sign, other=0.0)
        row_max = tl.load(row_max_ptr + sign_rows, mask=reads_sign, other=0.0)
        predicted_sign = tl.where(reads_sign & (minus_logit >= row_max), -1.0, 1.0)
        rel, d_rel, mag, d_mag = _run_terms(x_rel, x_mag, y, predicted_sign, target_sign)
        rel_sum += tl.sum(tl.where(run_start, rel, 0.0), axis=0)
        mag_sum += tl.sum(tl.where(run_start, mag, 0.0), axis=0)
        runs += tl.sum(run_start.to(tl.int32), axis=0)
        coef_pointers = coef_ptr + (base + run_stop - 1) * 2
        tl.store(coef_pointers, d_rel, mask=run_start)
        tl.store(coef_pointers + 1, d_mag, mask=run_start)
        tl.store(layout_ptr + (base + t) * _WIDTH + 1, place, mask=inside)
        tl.store(layout_ptr + (base + t) * _WIDTH + 2, tl.where(is_digit, run_stop - 1, -1), mask=inside)

    emd_mean = emd_sum / tl.maximum(digits, 1).to(tl.float32)
    rel_mean = rel_sum / tl.maximum(runs, 1).to(tl.float32)
    mag_mean = mag_sum / tl.maximum(runs, 1).to(tl.float32)
    tl.store(ntil_ptr + seq, digit_alpha * emd_mean + abs_alpha * rel_mean + mag_alpha * mag_mean)
    tl.store(parts_ptr + seq * 3, emd_mean)
    tl.store(parts_ptr + seq * 3 + 1, rel_mean)
    tl.store(parts_ptr + seq * 3 + 2, mag_mean)
    tl.store(counts_ptr + seq * 2, digits)
    tl.store(counts_ptr + seq * 2 + 1, runs)


@triton.jit(do_not_specialize=["has_ntil_grad", "has_parts_grad", "has_unpack", "has_noise",
    "numbers_have_grad", "unpack_stride", "columns_stride", "noise_stride", "table_width", "length",
    "num_positions", "num_columns", "grad_columns_stride", "grad_ntil_stride", "grad_parts_stride_seq",
    "grad_parts_stride_part"])  # fmt: skip
def _backward_kernel(
    grad_ntil_ptr, grad_ntil_stride, has_ntil_grad, grad_parts_ptr, grad_parts_stride_seq,
    grad_parts_stride_part, has_parts_grad,
    counts_ptr, layout_ptr, coef_ptr, unpack_ptr, unpack_stride, has_unpack,
    columns_ptr, columns_stride, num_columns, noise_ptr, noise_stride, has_noise,
    tables_ptr, table_width, cap, log2_base, tau, digit_alpha, abs_alpha, mag_alpha, numbers_have_grad,
    grad_columns_ptr, grad_columns_stride, length, num_positions,
    BLOCK: tl.constexpr,
):  # fmt: skip
    position = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = position < num_positions
    seq = position // length
    t = position - seq * length
    digit_lanes = tl.arange(0, 16)
    is_lane = digit_lanes < 10
    code = tl.load(layout_ptr + position * _WIDTH, mask=inside, other=_UNLABELLED)
    place = tl.load(layout_ptr + position * _WIDTH + 1, mask=inside, other=0)
    run_last = tl.load(layout_ptr + position * _WIDTH + 2, mask=inside, other=-1)
    is_digit = inside & (code < 10)
    rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, tl.where(inside, t, -1), length)

    # Upstream gradients per sequence: of ntil = a * emd + b * rel + c * mag, and of the parts themselves.
    grad_ntil = tl.load(grad_ntil_ptr + seq * grad_ntil_stride, mask=inside & (has_ntil_grad != 0), other=0.0)
    parts = grad_parts_ptr + seq * grad_parts_stride_seq
    has_parts = inside & (has_parts_grad != 0)
    grad_emd = tl.load(parts, mask=has_parts, other=0.0) + digit_alpha * grad_ntil
    grad_rel = tl.load(parts + grad_parts_stride_part, mask=has_parts, other=0.0) + abs_alpha * grad_ntil
    grad_mag = tl.load(parts + 2 * grad_parts_stride_part, mask=has_parts, other=0.0) + mag_alpha * grad_ntil
    digits = tl.maximum(tl.load(counts_ptr + seq * 2, mask=inside, other=1), 1).to(tl.float32)
    runs = tl.maximum(tl.load(counts_ptr + seq * 2 + 1, mask=inside, other=1), 1).to(tl.float32)

    tile = is_digit[:, None] & is_lane[None, :]
    logits = tl.load(
        columns_ptr + rows[:, None] * columns_stride + digit_lanes[None, :], mask=tile, other=0.0
    )
    logits = tl.where(is_lane[None, :], logits, float("-inf"))
    lane_values = digit_lanes[None, :].to(tl.float32)

    # EMD: softmax backward of sum_j p_j |j - d| with weight digit_exp ** place.
    digit = tl.where(is_digit, code, 0).to(tl.float32)
    distance = tl.abs(lane_values - digit[:, None])
    p = _softmax(logits)
    emd = tl.sum(p * distance, axis=1)
    weight = _place_weight(tables_ptr, table_width, place, cap, log2_base, is_digit)
    grad = (grad_emd / digits * weight)[:, None] * p * (distance - emd[:, None])

    if numbers_have_grad != 0:
        # X = sum of digit values * 10**place; a digit value's gradient is the Gumbel softmax's mean digit.
        in_range = is_digit & (place > -cap) & (place < cap)
        place_value = tl.load(tables_ptr + place + cap - 1, mask=in_range, other=0.0)
        coef = coef_ptr + (seq * length + run_last) * 2
        d_rel = tl.load(coef, mask=in_range, other=0.0)
        d_mag = tl.load(coef + 1, mask=in_range, other=0.0)
        noise_pointers = noise_ptr + rows[:, None] * noise_stride + digit_lanes[None, :]
        noise = tl.load(noise_pointers, mask=tile & (has_noise != 0), other=0.0)
        soft, _ = _straight_through(logits + noise, tau)
        mean_digit = tl.sum(soft * lane_values, axis=1)
        scale_rel = grad_rel / runs * d_rel * place_value / tau
        scale_mag = grad_mag / runs * d_mag * place_value / tau
        if has_noise != 0:
            grad += scale_rel[:, None] * soft * (lane_values - mean_digit[:, None])
            noise = tl.load(noise_pointers + 10, mask=tile, other=0.0)
            soft, _ = _straight_through(logits + noise, tau)
            mean_digit = tl.sum(soft * lane_values, axis=1)
            grad += scale_mag[:, None] * soft * (lane_values - mean_digit[:, None])
        else:
            grad += (scale_rel + scale_mag)[:, None] * soft * (lane_values - mean_digit[:, None])

    grad = tl.where(tile, grad, 0.0)  # the minus sign's column (lane 10) has no gradient
    written = (rows >= 0)[:, None] & (digit_lanes < num_columns)[None, :]
    tl.store(
        grad_columns_ptr + rows[:, None] * grad_columns_stride + digit_lanes[None, :], grad, mask=written
    )


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not _interpreting():
        raise RuntimeError(
            f"the Triton number-stage kernels got a tensor on {tensor.device}: they run on CUDA, or on CPU "
            "tensors only under Triton's interpreter (TRITON_INTERPRET=1 set before ntil_ds.loss.number_kernel "
            "is imported); pass number_stage='auto' or 'eager' (loss.number_stage in a recipe)."
        )


def forward(params: NumberParams, labels, columns, row_max, noise, unpack_index, digit_ids, tables):
    """(ntil [S], (emd, rel, mag) [S, 3], what the backward needs); one launch. `labels` `[B, T]`; the
    other tensors as `number_terms.kernel_number_terms` takes them (contiguous rows)."""
    _check_device(columns)
    num_sequences, length = (unpack_index if unpack_index is not None else labels).shape
    device = columns.device
    layout = torch.empty(num_sequences * length, _WIDTH.value, dtype=torch.int32, device=device)
    coef = torch.empty(num_sequences * length, 2, dtype=torch.float32, device=device)
    ntil = torch.empty(num_sequences, dtype=torch.float32, device=device)
    parts = torch.empty(num_sequences, 3, dtype=torch.float32, device=device)
    counts = torch.empty(num_sequences, 2, dtype=torch.int32, device=device)
    args = _shared_arguments(params, digit_ids, columns, noise, unpack_index)
    if num_sequences:
        with on_device(columns):
            _forward_kernel[(num_sequences,)](
                labels.reshape(-1), args["unpack"], args["unpack_stride"], args["has_unpack"],
                digit_ids, params.ignore_index, *args["point"], *args["minus"],
                columns, columns.stride(0), row_max, args["noise"], args["noise_stride"], args["has_noise"],
                tables, tables.stride(0), params.max_number_digits, args["log2_base"], params.gumbel_tau,
                params.digit_alpha, params.abs_alpha, params.mag_alpha,
                layout, coef, ntil, parts, counts, length,
                BLOCK=FORWARD_BLOCK, num_warps=FORWARD_WARPS,
            )  # fmt: skip
    return ntil, parts, (layout, coef, counts)


def backward(
    params: NumberParams, grad_ntil, grad_parts, columns, noise, unpack_index, digit_ids, tables, saved
):
    """The gradient of `columns` `[N, K]` from those of ntil `[S]` and of the parts `[S, 3]` (either may be
    None); one launch (plus a zero fill for packed rows)."""
    layout, coef, counts = saved
    num_positions = layout.shape[0]
    length = num_positions // max(counts.shape[0], 1)
    args = _shared_arguments(params, digit_ids, columns, noise, unpack_index)
    # An absent gradient is read as 0; its pointer may be any fp32 tensor.
    ntil_arg = grad_ntil if grad_ntil is not None else coef[:, 0]
    parts_arg = grad_parts if grad_parts is not None else coef
    # Packed rows: only the samples' positions are written (each row at most once); the rest stay 0.
    grad_columns = torch.zeros_like(columns) if unpack_index is not None else torch.empty_like(columns)
    if num_positions:
        with on_device(columns):
            _backward_kernel[(triton.cdiv(num_positions, BACKWARD_BLOCK),)](
                ntil_arg, ntil_arg.stride(0), int(grad_ntil is not None),
                parts_arg, parts_arg.stride(0), parts_arg.stride(1), int(grad_parts is not None),
                counts, layout, coef, args["unpack"], args["unpack_stride"], args["has_unpack"],
                columns, columns.stride(0), columns.shape[1], args["noise"], args["noise_stride"],
                args["has_noise"], tables, tables.stride(0), params.max_number_digits, args["log2_base"],
                params.gumbel_tau, params.digit_alpha, params.abs_alpha, params.mag_alpha,
                int(params.uses_gumbel), grad_columns, grad_columns.stride(0), length, num_positions,
                BLOCK=BACKWARD_BLOCK, num_warps=BACKWARD_WARPS,
            )  # fmt: skip
    return grad_columns


def _shared_arguments(params, digit_ids, columns, noise, unpack_index) -> dict:
    """Pointers and strides both kernels take; absent tensors are replaced by any tensor (never read)."""
    return {
        "has_unpack": int(unpack_index is not None),
        "has_noise": int(noise is not None),
        "unpack": unpack_index if unpack_index is not None else digit_ids,  # any int64 tensor
        "unpack_stride": unpack_index.stride(0) if unpack_index is not None else 0,
        "noise": noise if noise is not None else columns,
        "noise_stride": noise.stride(0) if noise is not None else 0,
        "log2_base": math.log2(params.digit_exp),
        # (token id, mode on): the decimal point and the minus sign
        "point": (-1, 0) if params.decimal_point_id is None else (params.decimal_point_id, 1),
        "minus": (-1, 0) if params.minus_sign_id is None else (params.minus_sign_id, 1),
    }
