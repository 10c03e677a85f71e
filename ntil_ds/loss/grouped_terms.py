"""Stage 2 of the grouped-digit loss in torch (docs/design/ntil_spec.md "Grouped digits").

Inputs as for the digit stage (`number_terms`): the labels, the gathered columns `[N, K]` (here the
number token table's columns, width by width, then the minus sign), the row max, the Gumbel noise
`[N, 2 * 10**max_width]` and the optional `unpack_index` of packed rows. Everything is vectorised over
positions (no host sync): each width's softmax, digit marginals and straight-through values are computed
at every position and kept where the label has that width, so the cost is O(N * K) with K <= 1,110 and
nothing depends on the vocabulary. With the table {1: digits} every term is the digit stage's, op for op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntil_ds.loss.number_terms import unpack
from ntil_ds.loss.numbers import NumberParams, analyse_numbers

WIDTHS = (1, 2, 3)


@dataclass(frozen=True)
class NumberTokenTable:
    """The ids of the number tokens, by width: `ids[w][v]` spells v with exactly w characters ("007" is
    `ids[3][7]`). Widths must be 1..m (m <= 3), each with all 10**w values, all ids distinct."""

    ids: dict[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        widths = sorted(self.ids)
        if not widths or widths != list(range(1, widths[-1] + 1)) or widths[-1] > 3:
            raise ValueError(f"number token table widths must be 1..m with m <= 3, got {widths}.")
        for width in widths:
            ids = self.ids[width]
            if len(ids) != 10**width or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(
                    f"number token table: width {width} needs {10**width} non-negative integer ids (values "
                    f"0..{10**width - 1}), got {len(ids)}."
                )
        if len(set(self.column_ids)) != len(self.column_ids):
            raise ValueError("number token table: the same token id appears for two values/widths.")

    @classmethod
    def of(cls, table) -> NumberTokenTable:
        return (
            table
            if isinstance(table, cls)
            else cls({int(w): tuple(int(i) for i in ids) for w, ids in table.items()})
        )

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.ids))

    @property
    def column_ids(self) -> list[int]:
        """All number token ids, width 1's values first, then width 2's, ... (the gathered columns)."""
        return [i for width in self.widths for i in self.ids[width]]

    @property
    def noise_half(self) -> int:
        """Noise columns per sample (REL's, MAG's): 10**max_width."""
        return 10 ** self.widths[-1]


def _digit_tables(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[width, 10**width]`: δ_j(v), the digit at place j of each value v of this width."""
    values = torch.arange(10**width, device=device)
    return torch.stack([(values // 10**j) % 10 for j in range(width)]).to(dtype)


def grouped_number_terms(
    params: NumberParams,
    table: NumberTokenTable,
    labels: torch.Tensor,
    columns: torch.Tensor,
    row_max: torch.Tensor,
    noise: torch.Tensor | None,
    unpack_index: torch.Tensor | None,
    number_ids: torch.Tensor,
    place_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ntil `[S]` and (emd, rel, mag) `[S, 3]` per sequence. `number_ids`: `table.column_ids` on the device;
    `place_values`: NTILLoss's 10**k table (k from -(cap-1) to cap-1, then a 0)."""
    if unpack_index is not None:
        labels, columns, row_max, noise = unpack(
            unpack_index, params.ignore_index, labels, columns, row_max, noise
        )
    num_numbers = number_ids.numel()
    predicted_minus = None
    if params.minus_sign_id is not None:
        predicted_minus = columns[:, num_numbers].detach() >= row_max
    # Runs, slots and signs as for digits, with every number token playing a digit's part; `digit` is then
    # the index into the table's columns, from which width and value follow.
    layout = analyse_numbers(
        labels,
        number_ids,
        ignore_index=params.ignore_index,
        decimal_point_id=params.decimal_point_id,
        minus_sign_id=params.minus_sign_id,
    )
    batch = labels.shape[0]
    device, dtype = columns.device, columns.dtype
    is_number = layout.is_digit.flatten()
    column = layout.digit.flatten()
    offsets = {w: sum(10**v for v in table.widths if v < w) for w in table.widths}
    # Made on the device (full / arange), not copied from the host: no sync per call.
    column_width = torch.cat([torch.full((10**w,), w, device=device) for w in table.widths])
    column_value = torch.cat([torch.arange(10**w, device=device) for w in table.widths])
    width = torch.where(is_number, column_width[column], 0)
    value = torch.where(is_number, column_value[column], 0)

    # Last-digit place k_t = C_ref - C_t with C the running sum of widths over the flattened batch and C_ref
    # its value at the run's last token (no dot) or at its dot: later integer widths, or minus the fraction
    # widths up to and including t.
    num_slots = is_number.numel()
    slot = layout.run_slot
    running = width.cumsum(0)
    at_end = torch.zeros(num_slots + 1, dtype=running.dtype, device=device)
    at_end = at_end.scatter_reduce(0, slot, running, reduce="amax")
    is_dot = (slot != num_slots) & ~is_number
    at_dot = torch.zeros_like(at_end).index_add_(0, slot, torch.where(is_dot, running + 1, 0))
    reference = torch.where(at_dot > 0, at_dot - 1, at_end)
    place = reference[slot] - running
    digits_per_sequence = width.view(batch, -1).sum(dim=1)

    cap = params.max_number_digits
    digit_values = torch.arange(10, dtype=dtype, device=device)
    table_places = place_values.to(dtype)

    def place_value(k: torch.Tensor) -> torch.Tensor:
        return table_places[torch.where(is_number & (k > -cap) & (k < cap), k + cap - 1, 2 * cap - 1)]

    half = table.noise_half
    rel_noise, mag_noise = (None, None) if noise is None else (noise[:, :half], noise[:, half:])
    emd_position = torch.zeros(num_slots, dtype=dtype, device=device)
    target_position = torch.zeros(num_slots, dtype=dtype, device=device)
    contributions = {"rel": None, "mag": None}

    def straight_through(logits_w: torch.Tensor, noise_w: torch.Tensor | None) -> torch.Tensor:
        noisy = logits_w if noise_w is None else logits_w + noise_w
        soft = (noisy / params.gumbel_tau).softmax(dim=-1)
        hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
        return hard - soft.detach() + soft

    for w in table.widths:
        count = 10**w
        logits_w = columns[:, offsets[w] : offsets[w] + count]
        here = is_number & (width == w)
        digits = _digit_tables(w, dtype, device)
        # Token level: the marginal of each covered digit (view [N, 10, ..., 10], most significant first).
        probabilities = logits_w.softmax(dim=-1).view(-1, *([10] * w))
        term = torch.zeros(num_slots, dtype=dtype, device=device)
        target = torch.zeros(num_slots, dtype=dtype, device=device)
        for j in range(w):
            others = [axis for axis in range(1, w + 1) if axis != w - j]
            marginal = probabilities.sum(dim=others) if others else probabilities
            target_digit = (value // 10**j) % 10
            distance = (digit_values[None, :] - target_digit[:, None]).abs()
            weight = torch.pow(params.digit_exp, (place + j).clamp(max=cap - 1).to(dtype))
            term = term + (marginal * distance).sum(dim=-1) * weight
            target = target + target_digit.to(dtype) * place_value(place + j)
        emd_position = torch.where(here, term, emd_position)
        target_position = torch.where(here, target, target_position)
        # Sequence level: each covered digit of the straight-through value at its place.
        samples = [("rel", rel_noise), ("mag", mag_noise)] if mag_noise is not None else [("rel", rel_noise)]
        for name, sample in samples:
            hard = straight_through(logits_w, None if sample is None else sample[:, :count])
            if not params.uses_gumbel:  # REL/MAG weigh 0: reported, no gradient (detach: torch.compile-able)
                hard = hard.detach()
            predicted = torch.zeros(num_slots, dtype=dtype, device=device)
            for j in range(w):
                predicted = predicted + (hard @ digits[j]) * place_value(place + j)
            previous = contributions[name]
            contributions[name] = torch.where(here, predicted, 0.0 if previous is None else previous)

    weighted = torch.where(is_number, emd_position, 0.0).view(batch, -1)
    emd = weighted.sum(dim=1) / digits_per_sequence.clamp(min=1)

    def run_sum(per_position: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_slots + 1, dtype=per_position.dtype, device=device)
        return out.index_add_(0, slot, per_position)[:num_slots]

    target = run_sum(target_position)
    predicted_for_rel = run_sum(contributions["rel"])
    predicted_for_mag = (
        run_sum(contributions["mag"]) if contributions["mag"] is not None else predicted_for_rel
    )
    rel, mag = _run_errors(
        params, layout, batch, target, predicted_for_rel, predicted_for_mag, predicted_minus
    )
    ntil = params.digit_alpha * emd + params.abs_alpha * rel + params.mag_alpha * mag
    return ntil, torch.stack([emd, rel, mag], dim=1)


def _run_errors(params, layout, batch, target, predicted_for_rel, predicted_for_mag, predicted_minus):
    """REL and MAG per sequence from per-run values: the digit stage's definitions (`number_terms`), unchanged."""
    dtype = target.dtype
    target_sign = torch.where(layout.run_negative, -1.0, 1.0).to(dtype)
    predicted_sign = torch.ones_like(target_sign)
    if predicted_minus is not None:
        sign_position = layout.run_sign_position
        negative = predicted_minus[sign_position.clamp(min=0)] & (sign_position >= 0)
        predicted_sign = torch.where(negative, -1.0, 1.0).to(dtype)
    signed_prediction = predicted_sign * predicted_for_rel
    signed_target = target_sign * target
    rel_per_run = (signed_prediction - signed_target).abs() / (torch.maximum(predicted_for_rel, target) + 1.0)
    rel_per_run = torch.where(signed_prediction == signed_target, 0.0, rel_per_run)
    mag_per_run = torch.log(
        (torch.maximum(predicted_for_mag, target) + 1.0) / (torch.minimum(predicted_for_mag, target) + 1.0)
    )
    runs = layout.runs_per_sequence.clamp(min=1)

    def per_sequence(per_run: torch.Tensor) -> torch.Tensor:
        per_run = torch.where(layout.run_exists, per_run, 0.0)
        out = torch.zeros(batch, dtype=dtype, device=per_run.device)
        return out.index_add_(0, layout.run_sequence, per_run) / runs

    return per_sequence(rel_per_run), per_sequence(mag_per_run)
