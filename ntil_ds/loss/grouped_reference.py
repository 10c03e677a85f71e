"""A slow, literal grouped-digit NTIL: docs/design/ntil_spec.md "Grouped digits", line by line.

Not for training: the independent float64 reference of the grouped fast path (`GroupedNTILLoss`). It loops
over sequences, runs and tokens and builds each digit marginal by summing the values whose digit matches,
so that a reader can check it against the spec. Paper mode plus the decimal and signed options; the Gumbel
noise is passed in (already scaled) so that the fast path's draw can be replayed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F


def _digit(value: int, place: int) -> int:
    """δ_j(v): the digit of v at place j (j = 0 is the last digit)."""
    return (value // 10**place) % 10


def _runs(row: list[int], number: Mapping[int, tuple[int, int]], point_id: int | None):
    """Each run as (integer-part positions, fraction-part positions); the spec's run rule."""
    is_number = [token in number for token in row]
    joining = [
        point_id is not None
        and token == point_id
        and 0 < t < len(row) - 1
        and is_number[t - 1]
        and is_number[t + 1]
        for t, token in enumerate(row)
    ]
    stretches, current = [], []
    for t in range(len(row) + 1):
        if t < len(row) and (is_number[t] or joining[t]):
            current.append(t)
        elif current:
            stretches.append(current)
            current = []
    runs = []
    for stretch in stretches:
        dots = [t for t in stretch if joining[t]]
        if len(dots) == 1:
            runs.append(([t for t in stretch if t < dots[0]], [t for t in stretch if t > dots[0]]))
            continue
        block = []
        for t in [*stretch, None]:
            if t is not None and is_number[t]:
                block.append(t)
            elif block:
                runs.append((block, []))
                block = []
    return runs, is_number


def reference_grouped_ntil_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    table: Mapping[int, Sequence[int]],
    *,
    ntil_lambda: float = 0.3,
    digit_alpha: float = 1.0,
    abs_alpha: float = 0.2,
    mag_alpha: float = 0.2,
    digit_exp: float = 1.2,
    gumbel_tau: float = 0.1,
    ignore_index: int = -100,
    decimal_point_id: int | None = None,
    minus_sign_id: int | None = None,
    max_number_digits: int = 18,
    noise: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """loss, ntil, emd, rel, mag, ce_mean for aligned `logits[B, T, V]`, `labels[B, T]`.

    `table`: width -> the ids of the values 0..10**width - 1 of that width (zero-padded spellings).
    `noise`: `[B*T, 2 * 10**max_width]`, scaled Gumbel noise (first half REL's sample, second MAG's), or None.
    """
    batch, length, vocab = logits.shape
    cap = max_number_digits
    half = 10 ** max(table)
    number = {token: (width, value) for width, ids in table.items() for value, token in enumerate(ids)}
    ce_mean = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=ignore_index)
    if not bool((labels != ignore_index).any()):
        ce_mean = logits.sum() * 0.0
    zero = logits.new_zeros(())
    uses_gumbel = abs_alpha > 0 or mag_alpha > 0

    def place_value(place: int) -> float:
        return 10.0**place if -cap < place < cap else 0.0

    def straight_through_number(b, positions, places, sample):
        total = zero
        for t, k in zip(positions, places, strict=True):
            width, _ = number[int(labels[b, t])]
            z = logits[b, t, list(table[width])]
            if noise is not None and uses_gumbel:
                z = z + noise[b * length + t, sample * half : sample * half + 10**width]
            soft = (z / gumbel_tau).softmax(dim=-1)
            hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
            h = hard - soft.detach() + soft
            for j in range(width):
                digits = torch.tensor([_digit(v, j) for v in range(10**width)], dtype=logits.dtype)
                total = total + (h @ digits) * place_value(k + j)
        return total

    emds, rels, mags = [], [], []
    for b in range(batch):
        row = labels[b].tolist()
        runs, is_number = _runs(row, number, decimal_point_id)
        weighted, digit_places, rel_terms, mag_terms = [], 0, [], []
        for integer, fraction in runs:
            widths = {t: number[row[t]][0] for t in integer + fraction}
            # Last-digit place: later integer widths; minus the fraction widths up to and including t.
            places = [sum(widths[s] for s in integer if s > t) for t in integer]
            places += [-sum(widths[s] for s in fraction if s <= t) for t in fraction]
            positions = integer + fraction
            target = 0.0
            for t, k in zip(positions, places, strict=True):
                width, value = number[row[t]]
                p = logits[b, t, list(table[width])].softmax(dim=-1)
                for j in range(width):
                    marginal = torch.stack(
                        [p[[v for v in range(10**width) if _digit(v, j) == c]].sum() for c in range(10)]
                    )
                    distance = (torch.arange(10, dtype=logits.dtype) - _digit(value, j)).abs()
                    weighted.append(digit_exp ** min(k + j, cap - 1) * (marginal * distance).sum())
                    target += _digit(value, j) * place_value(k + j)
                digit_places += width
            start = positions[0]
            can_hold_sign = (
                start >= 1 and row[start - 1] != ignore_index and not (start >= 2 and is_number[start - 2])
            )
            target_sign = (
                -1.0
                if minus_sign_id is not None and can_hold_sign and row[start - 1] == minus_sign_id
                else 1.0
            )
            predicted_sign = 1.0
            if minus_sign_id is not None and can_hold_sign:
                before = logits[b, start - 1]
                predicted_sign = -1.0 if bool(before[minus_sign_id] >= before.max()) else 1.0
            y = torch.tensor(target, dtype=logits.dtype)
            x_rel = straight_through_number(b, positions, places, 0)
            x_mag = straight_through_number(b, positions, places, 1) if noise is not None else x_rel
            if not uses_gumbel:
                x_rel, x_mag = x_rel.detach(), x_mag.detach()
            xs, ys = predicted_sign * x_rel, target_sign * y
            rel_terms.append(zero if bool(xs == ys) else (xs - ys).abs() / (torch.maximum(x_rel, y) + 1))
            mag_terms.append(torch.log((torch.maximum(x_mag, y) + 1) / (torch.minimum(x_mag, y) + 1)))
        emds.append(torch.stack(weighted).sum() / digit_places if weighted else zero)
        rels.append(torch.stack(rel_terms).mean() if rel_terms else zero)
        mags.append(torch.stack(mag_terms).mean() if mag_terms else zero)
    emd, rel, mag = torch.stack(emds), torch.stack(rels), torch.stack(mags)
    ntil = (digit_alpha * emd + abs_alpha * rel + mag_alpha * mag).mean()
    loss = ce_mean + ntil_lambda * (ce_mean / (ntil + 1e-10)).detach() * ntil
    return {
        "loss": loss,
        "ntil": ntil,
        "emd": emd.mean(),
        "rel": rel.mean(),
        "mag": mag.mean(),
        "ce_mean": ce_mean,
    }
