"""Where the numbers are in the labels: runs of digit labels, their place exponents, their signs.

Everything here looks at `labels[B, T]` only and is vectorised (no loop over tokens or runs, no
host sync), so its cost is O(B*T*10) whatever the vocabulary. Runs are numbered over the
flattened batch into a fixed-size table of B*T slots (a batch cannot hold more runs than
positions); slot B*T is a dump for non-digit positions. Slots beyond the real run count stay
empty and contribute exact zeros downstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NumberLayout:
    """Per-position and per-run facts about the numbers in a batch of labels."""

    is_digit: torch.Tensor  # [B, T] bool: the label is one of the ten digit tokens
    digit: torch.Tensor  # [B, T] int64: its value 0..9 (0 where not a digit)
    place: torch.Tensor  # [B, T] int64: exponent k of its place value (10**k); negative = fraction
    run_slot: torch.Tensor  # [B*T] int64: run slot of each position, B*T for non-digits
    run_sequence: torch.Tensor  # [B*T] int64: sequence index of each run slot
    run_exists: torch.Tensor  # [B*T] bool: the slot holds a run
    run_negative: torch.Tensor  # [B*T] bool: target is negative (signed mode only)
    run_sign_position: torch.Tensor  # [B*T] int64: flat position just before the run, -1 if none
    digits_per_sequence: torch.Tensor  # [B] int64
    runs_per_sequence: torch.Tensor  # [B] int64


@dataclass(frozen=True)
class NumberParams:
    """The hyperparameters of the number stage (`NTILLoss`'s, see its docstring): here, below both of its
    implementations (`number_terms`, `number_kernel`), which take them."""

    digit_alpha: float
    abs_alpha: float
    mag_alpha: float
    digit_exp: float
    gumbel_tau: float
    ignore_index: int
    decimal_point_id: int | None  # None: paper mode, no decimal numbers
    minus_sign_id: int | None  # None: no signed numbers
    max_number_digits: int

    @property
    def uses_gumbel(self) -> bool:
        """REL/MAG carry gradient (so their straight-through reconstruction is needed)."""
        return self.abs_alpha > 0 or self.mag_alpha > 0


def _shift_right(mask: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """mask[:, t - steps], False where t < steps."""
    out = torch.zeros_like(mask)
    out[:, steps:] = mask[:, :-steps]
    return out


def _shift_left(mask: torch.Tensor) -> torch.Tensor:
    """mask[:, t + 1], False at the last position."""
    out = torch.zeros_like(mask)
    out[:, :-1] = mask[:, 1:]
    return out


def _slot_sum(slots: torch.Tensor, values: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Sum `values` into `num_slots + 1` slots (the last one collects positions outside any run)."""
    out = torch.zeros(num_slots + 1, dtype=values.dtype, device=values.device)
    return out.index_add_(0, slots, values)


def analyse_numbers(
    labels: torch.Tensor,
    digit_ids: torch.Tensor,
    *,
    ignore_index: int,
    decimal_point_id: int | None = None,
    minus_sign_id: int | None = None,
) -> NumberLayout:
    """Find the runs of digit labels and their place exponents.

    Paper mode (`decimal_point_id is None`): a run is a maximal block of consecutive digit labels of
    one sequence; the digit at index i of a run of length n has exponent k = n - 1 - i.

    Decimal mode: a `.` label with a digit label on both sides joins the two digit blocks into one
    real number, but only when that stretch of digits and dots holds exactly one such dot (so
    "3.015" is one number, while "1.2.3" stays three integers as in paper mode). Integer digits get
    k >= 0 as usual, fractional digits k = -1, -2, ... The dot itself is not a digit position.

    Signed mode (`minus_sign_id` given): a run whose first label is directly preceded by a `-` label
    is negative, unless the label before that `-` is a digit ("5-3" and "2024-05" are hyphens, not
    signs). For every run the flat index of the position just before it is kept when that position
    could hold a sign (labelled, not after a digit) so that the loss can read the sign the model
    predicts there.
    """
    batch, length = labels.shape
    num_slots = batch * length
    device = labels.device
    matches = labels[..., None] == digit_ids
    is_digit = matches.any(dim=-1)
    digit = matches.to(torch.uint8).argmax(dim=-1)

    member = is_digit
    decimal_dot = torch.zeros_like(is_digit)
    if decimal_point_id is not None:
        joining_dot = (labels == decimal_point_id) & _shift_right(is_digit) & _shift_left(is_digit)
        in_stretch = is_digit | joining_dot
        stretch_start = in_stretch & ~_shift_right(in_stretch)
        stretch_slot = torch.where(
            in_stretch, stretch_start.flatten().cumsum(0).view_as(labels) - 1, num_slots
        )
        dots = _slot_sum(stretch_slot.flatten(), joining_dot.flatten().long(), num_slots)
        decimal_dot = joining_dot & (dots[stretch_slot] == 1)
        member = is_digit | decimal_dot

    run_start = member & ~_shift_right(member)
    run_slot = torch.where(member, run_start.flatten().cumsum(0).view_as(labels) - 1, num_slots)
    run_slot_flat = run_slot.flatten()

    positions = torch.arange(length, device=device).expand(batch, length)
    # First non-member position at or after t (length if none): the end of t's run.
    breaks = torch.where(member, length, positions)
    run_end = breaks.flip(1).cummin(dim=1).values.flip(1)
    place = run_end - positions - 1
    if decimal_point_id is not None:
        dot_plus_one = _slot_sum(run_slot_flat, ((positions + 1) * decimal_dot).flatten(), num_slots)
        dot = dot_plus_one[run_slot] - 1
        fraction_place = torch.where(positions < dot, dot - positions - 1, dot - positions)
        place = torch.where(dot >= 0, fraction_place, place)

    sequence_index = torch.arange(batch, device=device)[:, None].expand(batch, length)
    run_sequence = _slot_sum(run_slot_flat, (sequence_index * run_start).flatten(), num_slots)[:num_slots]
    run_exists = _slot_sum(run_slot_flat, run_start.flatten().long(), num_slots)[:num_slots] > 0

    # The position before a run can hold a sign if it is labelled and does not follow a digit
    # (after a digit a '-' is a hyphen or an operator). Stored as flat index + 1 (0 = none) so
    # that one slot sum collects it; the run start's own flat index is exactly that value.
    flat_position = torch.arange(num_slots, device=device).view(batch, length)
    can_hold_sign = _shift_right(labels != ignore_index) & ~_shift_right(is_digit, 2) & (positions >= 1)
    sign_position_plus_one = torch.where(run_start & can_hold_sign, flat_position, 0)
    run_sign_position = _slot_sum(run_slot_flat, sign_position_plus_one.flatten(), num_slots)[:num_slots] - 1
    run_negative = torch.zeros(num_slots, dtype=torch.bool, device=device)
    if minus_sign_id is not None:
        minus_before = _shift_right(labels == minus_sign_id) & can_hold_sign
        negative_start = (run_start & minus_before).flatten().long()
        run_negative = _slot_sum(run_slot_flat, negative_start, num_slots)[:num_slots] > 0

    return NumberLayout(
        is_digit=is_digit,
        digit=digit.long(),
        place=place,
        run_slot=run_slot_flat,
        run_sequence=run_sequence,
        run_exists=run_exists,
        run_negative=run_negative,
        run_sign_position=run_sign_position,
        digits_per_sequence=is_digit.sum(dim=1),
        runs_per_sequence=run_start.sum(dim=1),
    )
