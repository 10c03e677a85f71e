"""Stage 2 of the grouped-digit loss (docs/design/ntil_spec.md "Grouped digits") as three Triton kernels,
from stage 1's `[N, K]` columns (the table's, width by width: up to 1,110, then the minus sign) to the
per-sequence ntil `[S]` and (emd, rel, mag) of `grouped_terms.grouped_number_terms` (~850 torch ops):

1. `_position_kernel` (`ROWS` rows a program): softmax over the label width's columns (`LANES` lanes),
   each covered digit's EMD term `E_j = sum_v p(v) |digit_j(v) - digit_j(label)|`, and the straight-through
   samples' argmax and float32 factor `(1 - s_max) + s_max`: 8 floats a row.
2. `_sequence_kernel` (a program a sequence): `number_kernel`'s passes with each number token playing a
   digit's part, on those scalars; a token's place is `W(ref) - W(t)` with W the running sum of widths and
   ref the run's last token or its dot.
3. `_backward_kernel` (`ROWS` positions a program): dEMD and dX through the softmaxes.
Memory O(N * K); nothing depends on the vocabulary. `TRITON_INTERPRET=1` runs it on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ntil_ds.loss.number_kernel import (
    _maximum,
    _minimum,
    _place_weight,
    _rows,
    _run_terms,
    _segment_sums,
    _softmax,
)
from ntil_ds.loss.numbers import NumberParams
from ntil_ds.loss.vocab_kernel import on_device

ROWS, ROW_WARPS = 2, 8  # the position kernels' [ROWS, LANES] tiles; then the sequence kernel's step
SEQUENCE_BLOCK, SEQUENCE_WARPS = 256, 8
# Per row: E_0, E_1, E_2, argmax (REL sample), its factor, argmax (MAG sample), its factor, 0. A constexpr:
# compiled kernels can read no other global (the interpreter can; test_kernel_compile.py compiles them).
STATS = tl.constexpr(8)

# Per position, int32: [code, place, run's last position, joining dots so far, last joining dot, W].
_WIDTH = tl.constexpr(6)
# Codes: the column 0..1,109 of a number token; then a decimal point, a minus sign, another label, none.
_POINT, _MINUS, _OTHER, _UNLABELLED = (
    tl.constexpr(2000),
    tl.constexpr(2001),
    tl.constexpr(2002),
    tl.constexpr(2003),
)


def _interpreting() -> bool:
    return not isinstance(_sequence_kernel, triton.runtime.JITFunction)


@triton.jit
def _width_of(column):
    """(width, first column of that width, value) of a table column; width 0 where column < 0."""
    width = tl.where(column < 0, 0, tl.where(column < 10, 1, tl.where(column < 110, 2, 3)))
    offset = tl.where(width == 3, 110, tl.where(width == 2, 10, 0))
    return width, offset, tl.where(column < 0, 0, column - offset)


@triton.jit
def _digit(value, j: tl.constexpr):
    """Digit j (0: units) of non-negative ints."""
    if j == 0:
        return value % 10
    elif j == 1:
        return (value // 10) % 10
    else:
        return (value // 100) % 10


@triton.jit
def _place_value(tables_ptr, k, cap, covered):
    """10**k from the table (0 past the cap or where not covered)."""
    return tl.load(tables_ptr + k + cap - 1, mask=covered & (k > -cap) & (k < cap), other=0.0)


@triton.jit
def _tile(columns_ptr, columns_stride, rows, column, LANES: tl.constexpr):
    """The logits of each row's label width ([ROWS, LANES], -inf past 10**width; one 0 lane where none)."""
    width, offset, value = _width_of(column)
    count = tl.where(width == 3, 1000, tl.where(width == 2, 100, tl.where(width == 1, 10, 1)))
    lanes = tl.arange(0, LANES)
    valid = lanes[None, :] < count[:, None]
    tile = valid & (width > 0)[:, None] & (rows >= 0)[:, None]
    pointers = rows[:, None] * columns_stride + offset[:, None] + lanes[None, :]
    return lanes, tile, tl.where(valid, 0.0, float("-inf")), pointers, width, value


@triton.jit
def _sample(logits, noise, tau, out, inside):
    """A straight-through sample's argmax and its float32 factor (1 - s_max) + s_max."""
    soft = _softmax((logits + noise) / tau)
    top = tl.max(soft, axis=1)
    tl.store(out, tl.argmax(soft, axis=1).to(tl.float32), mask=inside)
    tl.store(out + 1, (1.0 - top) + top, mask=inside)


@triton.jit(do_not_specialize=["columns_stride", "noise_stride", "has_noise", "noise_half", "num_rows"])
def _position_kernel(
    column_ptr, columns_ptr, columns_stride, noise_ptr, noise_stride, has_noise, noise_half, tau,
    stats_ptr, num_rows, ROWS: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    inside = rows < num_rows
    column = tl.load(column_ptr + rows, mask=inside, other=-1)
    lanes, tile, base, pointers, _, value = _tile(columns_ptr, columns_stride, rows, column, LANES)
    logits = base + tl.load(columns_ptr + pointers, mask=tile, other=0.0)
    p = _softmax(logits)
    out = stats_ptr + rows * STATS
    for j in tl.static_range(3):
        distance = tl.abs(_digit(lanes, j)[None, :] - _digit(value, j)[:, None]).to(tl.float32)
        tl.store(out + j, tl.sum(p * distance, axis=1), mask=inside)
    noise = noise_ptr + rows[:, None] * noise_stride + lanes[None, :]
    _sample(logits, tl.load(noise, mask=tile & (has_noise != 0), other=0.0), tau, out + 3, inside)
    if has_noise != 0:  # the MAG sample (without noise: the REL sample again)
        _sample(logits, tl.load(noise + noise_half, mask=tile, other=0.0), tau, out + 5, inside)
    else:
        _sample(logits, tl.zeros_like(logits), tau, out + 5, inside)


@triton.jit
def _codes(layout_ptr, base, t, length):
    inside = (t >= 0) & (t < length)
    return tl.load(layout_ptr + (base + t) * _WIDTH, mask=inside, other=_UNLABELLED)


@triton.jit
def _digit_sum(value, place, width, factor, tables_ptr, cap, is_number):
    """sum over the token's covered digits j of digit_j(value) * factor * 10**(place + j) (0 past the cap)."""
    total = tl.zeros_like(factor)
    for j in tl.static_range(3):
        total += (
            _digit(value, j).to(tl.float32)
            * factor
            * _place_value(tables_ptr, place + j, cap, is_number & (j < width))
        )
    return total


@triton.jit(do_not_specialize=["has_unpack", "decimal", "signed", "unpack_stride", "columns_stride",
            "minus_column", "table_width", "length"])  # fmt: skip
def _sequence_kernel(
    labels_ptr, column_ptr, unpack_ptr, unpack_stride, has_unpack, ignore_index, point_id, decimal,
    minus_id, signed, columns_ptr, columns_stride, minus_column, row_max_ptr, stats_ptr,
    tables_ptr, table_width, cap, log2_base, digit_alpha, abs_alpha, mag_alpha,
    layout_ptr, coef_ptr, ntil_ptr, parts_ptr, counts_ptr, length, BLOCK: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    base = seq.to(tl.int64) * length
    lanes = tl.arange(0, BLOCK)
    num_blocks = tl.cdiv(length, BLOCK)

    # Pass 1: a code per position and the running sum of widths W.
    widths_so_far = 0
    for block in range(0, num_blocks):
        t = block * BLOCK + lanes
        rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t, length)
        label = tl.load(labels_ptr + rows, mask=rows >= 0, other=ignore_index)
        column = tl.load(column_ptr + rows, mask=rows >= 0, other=-1)
        code = tl.where(label == ignore_index, _UNLABELLED, _OTHER)
        code = tl.where((decimal != 0) & (label == point_id), _POINT, code)
        code = tl.where((signed != 0) & (label == minus_id), _MINUS, code)
        code = tl.where(column >= 0, column, code)
        width, _, _ = _width_of(tl.where(rows >= 0, column, -1))
        running = tl.cumsum(width, axis=0) + widths_so_far
        widths_so_far += tl.sum(width, axis=0)
        tl.store(layout_ptr + (base + t) * _WIDTH, code, mask=t < length)
        tl.store(layout_ptr + (base + t) * _WIDTH + 5, running, mask=t < length)
    tl.debug_barrier()

    # Pass 2 (decimal mode): joining dots so far in each stretch, and the last one's position.
    if decimal != 0:
        dots, dots_at_break, last_dot = 0, 0, -1
        for block in range(0, num_blocks):
            t = block * BLOCK + lanes
            code = _codes(layout_ptr, base, t, length)
            joining = (code == _POINT) & (_codes(layout_ptr, base, t - 1, length) < _POINT)
            joining = joining & (_codes(layout_ptr, base, t + 1, length) < _POINT)
            stretch = (code < _POINT) | joining
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

    # Pass 3, right to left: places, EMD, run sums (complete at each run's first token), REL, MAG.
    stretch_carry, run_carry = length, length
    carry_y, carry_xr, carry_xm = 0.0, 0.0, 0.0
    emd_sum, rel_sum, mag_sum = 0.0, 0.0, 0.0
    digits, runs = 0, 0
    for block in range(0, num_blocks):
        t = length - 1 - block * BLOCK - lanes
        inside = t >= 0
        code = _codes(layout_ptr, base, t, length)
        before = _codes(layout_ptr, base, t - 1, length)
        before2 = _codes(layout_ptr, base, t - 2, length)
        is_number = code < _POINT
        member = is_number
        member_before = before < _POINT
        one_dot = lanes < 0
        dot_at = t
        if decimal != 0:
            joining = (
                (code == _POINT) & (before < _POINT) & (_codes(layout_ptr, base, t + 1, length) < _POINT)
            )
            stretch = is_number | joining
            outside = tl.where(stretch, length, t)
            stretch_stop = tl.minimum(tl.associative_scan(outside, 0, _minimum), stretch_carry)
            stretch_carry = tl.minimum(stretch_carry, tl.min(tl.where(inside, outside, length), axis=0))
            stretch_last = base + stretch_stop - 1
            dots_in_stretch = tl.load(layout_ptr + stretch_last * _WIDTH + 3, mask=stretch, other=0)
            one_dot = stretch & (dots_in_stretch == 1)
            dot_at = tl.load(layout_ptr + stretch_last * _WIDTH + 4, mask=one_dot, other=0)
            member = is_number | (joining & one_dot)
            joining_before = (before == _POINT) & (before2 < _POINT) & is_number
            member_before = (before < _POINT) | (joining_before & one_dot)
        outside_run = tl.where(member, length, t)
        run_stop = tl.minimum(tl.associative_scan(outside_run, 0, _minimum), run_carry)
        run_carry = tl.minimum(run_carry, tl.min(tl.where(inside, outside_run, length), axis=0))
        # Place of the token's last digit: the widths after it up to its run's end, or up to / down to the dot.
        reference = tl.where(one_dot, dot_at, run_stop - 1)
        w_reference = tl.load(layout_ptr + (base + reference) * _WIDTH + 5, mask=is_number, other=0)
        w_here = tl.load(layout_ptr + (base + t) * _WIDTH + 5, mask=is_number, other=0)
        place = w_reference - w_here
        run_start = member & ~member_before
        run_last = member & (run_stop == t + 1)

        width, _, value = _width_of(tl.where(is_number, code, -1))
        rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t, length)
        stats = stats_ptr + rows * STATS
        emd = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(3):
            covered = is_number & (j < width)
            term = tl.load(stats + j, mask=covered, other=0.0)
            weight = _place_weight(tables_ptr, table_width, place + j, cap, log2_base, covered)
            emd += tl.where(covered, term * weight, 0.0)
        emd_sum += tl.sum(emd, axis=0)
        digits += tl.sum(width, axis=0)

        ones = tl.full([BLOCK], 1.0, tl.float32)
        y = _digit_sum(value, place, width, ones, tables_ptr, cap, is_number)
        arg_rel = tl.load(stats + 3, mask=is_number, other=0.0).to(tl.int32)
        arg_mag = tl.load(stats + 5, mask=is_number, other=0.0).to(tl.int32)
        x_rel = _digit_sum(
            arg_rel, place, width, tl.load(stats + 4, mask=is_number, other=0.0), tables_ptr, cap, is_number
        )
        x_mag = _digit_sum(
            arg_mag, place, width, tl.load(stats + 6, mask=is_number, other=0.0), tables_ptr, cap, is_number
        )
        sums = tl.associative_scan((y, x_rel, x_mag, run_last.to(tl.int32)), 0, _segment_sums)
        open_right = sums[3] == 0
        y = tl.where(open_right, sums[0] + carry_y, sums[0])
        x_rel = tl.where(open_right, sums[1] + carry_xr, sums[1])
        x_mag = tl.where(open_right, sums[2] + carry_xm, sums[2])
        continues = (lanes == BLOCK - 1) & member & ~run_start
        carry_y = tl.sum(tl.where(continues, y, 0.0), axis=0)
        carry_xr = tl.sum(tl.where(continues, x_rel, 0.0), axis=0)
        carry_xm = tl.sum(tl.where(continues, x_mag, 0.0), axis=0)

        can_sign = (t >= 1) & (before != _UNLABELLED) & (before2 >= _POINT)
        target_sign = tl.where((signed != 0) & can_sign & (before == _MINUS), -1.0, 1.0)
        sign_rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, t - 1, length)
        reads_sign = (signed != 0) & run_start & can_sign
        minus_logit = tl.load(
            columns_ptr + sign_rows * columns_stride + minus_column, mask=reads_sign, other=0.0
        )
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
        tl.store(layout_ptr + (base + t) * _WIDTH + 2, tl.where(is_number, run_stop - 1, -1), mask=inside)

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
    "numbers_have_grad", "unpack_stride", "columns_stride", "noise_stride", "noise_half", "table_width",
    "length", "num_positions", "grad_ntil_stride", "grad_parts_stride_seq", "grad_parts_stride_part"])  # fmt: skip
def _backward_kernel(
    grad_ntil_ptr, grad_ntil_stride, has_ntil_grad, grad_parts_ptr, grad_parts_stride_seq,
    grad_parts_stride_part, has_parts_grad, counts_ptr, layout_ptr, coef_ptr, unpack_ptr, unpack_stride,
    has_unpack, columns_ptr, columns_stride, noise_ptr, noise_stride, has_noise, noise_half,
    tables_ptr, table_width, cap, log2_base, tau, digit_alpha, abs_alpha, mag_alpha, numbers_have_grad,
    grad_columns_ptr, length, num_positions, ROWS: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    position = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    inside = position < num_positions
    seq = position // length
    t = position - seq * length
    code = tl.load(layout_ptr + position * _WIDTH, mask=inside, other=_UNLABELLED)
    place = tl.load(layout_ptr + position * _WIDTH + 1, mask=inside, other=0)
    run_last = tl.load(layout_ptr + position * _WIDTH + 2, mask=inside, other=-1)
    is_number = inside & (code < _POINT)
    rows = _rows(unpack_ptr, unpack_stride, has_unpack, seq, tl.where(inside, t, -1), length)
    rows = tl.where(is_number, rows, -1)
    column = tl.where(is_number, code, -1)
    lanes, tile, base, pointers, width, value = _tile(columns_ptr, columns_stride, rows, column, LANES)

    grad_ntil = tl.load(grad_ntil_ptr + seq * grad_ntil_stride, mask=inside & (has_ntil_grad != 0), other=0.0)
    parts = grad_parts_ptr + seq * grad_parts_stride_seq
    has_parts = inside & (has_parts_grad != 0)
    grad_emd = tl.load(parts, mask=has_parts, other=0.0) + digit_alpha * grad_ntil
    grad_rel = tl.load(parts + grad_parts_stride_part, mask=has_parts, other=0.0) + abs_alpha * grad_ntil
    grad_mag = tl.load(parts + 2 * grad_parts_stride_part, mask=has_parts, other=0.0) + mag_alpha * grad_ntil
    digits = tl.maximum(tl.load(counts_ptr + seq * 2, mask=inside, other=1), 1).to(tl.float32)
    runs = tl.maximum(tl.load(counts_ptr + seq * 2 + 1, mask=inside, other=1), 1).to(tl.float32)

    logits = base + tl.load(columns_ptr + pointers, mask=tile, other=0.0)
    p = _softmax(logits)
    grad = tl.zeros([ROWS, LANES], dtype=tl.float32)
    values = tl.zeros([ROWS, LANES], dtype=tl.float32)  # a lane's value at the token's places: dX/dvalue
    for j in tl.static_range(3):
        covered = is_number & (j < width)
        lane_digit = _digit(lanes, j)[None, :]
        distance = tl.abs(lane_digit - _digit(value, j)[:, None]).to(tl.float32)
        term = tl.sum(p * distance, axis=1)
        weight = _place_weight(tables_ptr, table_width, place + j, cap, log2_base, covered)
        scale = tl.where(covered, grad_emd / digits * weight, 0.0)
        grad += scale[:, None] * p * (distance - term[:, None])
        values += lane_digit.to(tl.float32) * _place_value(tables_ptr, place + j, cap, covered)[:, None]

    if numbers_have_grad != 0:
        coef = coef_ptr + (seq * length + run_last) * 2
        d_rel = tl.load(coef, mask=is_number, other=0.0)
        d_mag = tl.load(coef + 1, mask=is_number, other=0.0)
        noise_pointers = noise_ptr + rows[:, None] * noise_stride + lanes[None, :]
        noise = tl.load(noise_pointers, mask=tile & (has_noise != 0), other=0.0)
        soft = _softmax((logits + noise) / tau)
        mean = tl.sum(soft * values, axis=1)
        scale_rel = grad_rel / runs * d_rel / tau
        scale_mag = grad_mag / runs * d_mag / tau
        if has_noise != 0:
            grad += scale_rel[:, None] * soft * (values - mean[:, None])
            noise = tl.load(noise_pointers + noise_half, mask=tile, other=0.0)
            soft = _softmax((logits + noise) / tau)
            mean = tl.sum(soft * values, axis=1)
            grad += scale_mag[:, None] * soft * (values - mean[:, None])
        else:
            grad += (scale_rel + scale_mag)[:, None] * soft * (values - mean[:, None])
    tl.store(grad_columns_ptr + pointers, grad, mask=tile)


def _check_device(tensor: torch.Tensor) -> None:
    if not tensor.is_cuda and not _interpreting():
        raise RuntimeError(
            f"the grouped Triton number-stage kernels got a tensor on {tensor.device}: they run on CUDA, or on "
            "CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 set before ntil_ds.loss.grouped_kernel "
            "is imported); pass number_stage='auto' or 'eager' (loss.number_stage in a recipe)."
        )


def _common(params: NumberParams, columns, noise, unpack) -> dict:
    none = torch.empty(1, dtype=torch.long, device=columns.device)  # an int64 pointer, never read
    return {
        "has_unpack": int(unpack is not None),
        "unpack": none if unpack is None else unpack,
        "unpack_stride": unpack.stride(0) if unpack is not None else 0,
        "has_noise": int(noise is not None),
        "noise": noise if noise is not None else columns,
        "noise_stride": noise.stride(0) if noise is not None else 0,
        "log2_base": math.log2(params.digit_exp),
    }


def forward(
    params: NumberParams, labels, columns, row_max, noise, unpack_index, column_map, tables, noise_half
):
    """(ntil [S], (emd, rel, mag) [S, 3], what the backward needs); two launches. `column_map` [N] int32:
    each row's label's table column, -1 for none; `noise_half`: 10**max_width (a sample's columns)."""
    _check_device(columns)
    num_sequences, length = (unpack_index if unpack_index is not None else labels).shape
    device = columns.device
    num_rows = columns.shape[0]
    stats = torch.empty(num_rows, STATS.value, dtype=torch.float32, device=device)
    layout = torch.empty(num_sequences * length, _WIDTH.value, dtype=torch.int32, device=device)
    coef = torch.empty(num_sequences * length, 2, dtype=torch.float32, device=device)
    ntil = torch.empty(num_sequences, dtype=torch.float32, device=device)
    parts = torch.empty(num_sequences, 3, dtype=torch.float32, device=device)
    counts = torch.empty(num_sequences, 2, dtype=torch.int32, device=device)
    args = _common(params, columns, noise, unpack_index)
    point = (-1, 0) if params.decimal_point_id is None else (params.decimal_point_id, 1)
    minus = (-1, 0) if params.minus_sign_id is None else (params.minus_sign_id, 1)
    with on_device(columns):
        if num_rows:
            _position_kernel[(triton.cdiv(num_rows, ROWS),)](
                column_map, columns, columns.stride(0), args["noise"], args["noise_stride"], args["has_noise"],
                noise_half, params.gumbel_tau, stats, num_rows,
                ROWS=ROWS, LANES=triton.next_power_of_2(noise_half), num_warps=ROW_WARPS,
            )  # fmt: skip
        if num_sequences:
            _sequence_kernel[(num_sequences,)](
                labels.reshape(-1), column_map, args["unpack"], args["unpack_stride"], args["has_unpack"],
                params.ignore_index, *point, *minus, columns, columns.stride(0), columns.shape[1] - 1,
                row_max, stats, tables, tables.stride(0), params.max_number_digits, args["log2_base"],
                params.digit_alpha, params.abs_alpha, params.mag_alpha,
                layout, coef, ntil, parts, counts, length,
                BLOCK=SEQUENCE_BLOCK, num_warps=SEQUENCE_WARPS,
            )  # fmt: skip
    return ntil, parts, (layout, coef, counts)


def backward(
    params: NumberParams, grad_ntil, grad_parts, columns, noise, unpack_index, tables, noise_half, saved
):
    """The gradient of `columns` `[N, K]` from those of ntil `[S]` and the parts `[S, 3]` (either may be
    None): a zero fill and one launch (only the label width's columns of number rows are written)."""
    layout, coef, counts = saved
    num_positions = layout.shape[0]
    length = num_positions // max(counts.shape[0], 1)
    args = _common(params, columns, noise, unpack_index)
    ntil_arg = grad_ntil if grad_ntil is not None else coef[:, 0]
    parts_arg = grad_parts if grad_parts is not None else coef
    grad_columns = torch.zeros_like(columns)
    if num_positions:
        with on_device(columns):
            _backward_kernel[(triton.cdiv(num_positions, ROWS),)](
                ntil_arg, ntil_arg.stride(0), int(grad_ntil is not None),
                parts_arg, parts_arg.stride(0), parts_arg.stride(1), int(grad_parts is not None),
                counts, layout, coef, args["unpack"], args["unpack_stride"], args["has_unpack"],
                columns, columns.stride(0), args["noise"], args["noise_stride"], args["has_noise"], noise_half,
                tables, tables.stride(0), params.max_number_digits, args["log2_base"], params.gumbel_tau,
                params.digit_alpha, params.abs_alpha, params.mag_alpha, int(params.uses_gumbel),
                grad_columns, length, num_positions,
                ROWS=ROWS, LANES=triton.next_power_of_2(noise_half), num_warps=ROW_WARPS,
            )  # fmt: skip
    return grad_columns
