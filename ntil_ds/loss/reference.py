"""A slow, literal NTIL: loops over sequences and runs, as the authors' implementation does.

Not for training. It is the independent reference of the tests (run it in float64) and the
"naive" baseline of `benchmarks/loss_speed.py`. Paper mode only, Gumbel noise off, no vocabulary
sharding: it follows docs/design/ntil_spec.md line by line so that a reader can check it against the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _straight_through_number(digit_logits: torch.Tensor, tau: float) -> torch.Tensor:
    soft = (digit_logits / tau).softmax(dim=-1)
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
    digits = (hard - soft.detach() + soft) @ torch.arange(10, dtype=soft.dtype, device=soft.device)
    places = torch.tensor(
        [10.0**k for k in range(len(digits) - 1, -1, -1)], dtype=soft.dtype, device=soft.device
    )
    return (digits * places).sum()


def reference_ntil_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    digit_token_ids: Sequence[int],
    *,
    ntil_lambda: float = 0.3,
    digit_alpha: float = 1.0,
    abs_alpha: float = 0.2,
    mag_alpha: float = 0.2,
    digit_exp: float = 1.2,
    gumbel_tau: float = 0.1,
    ignore_index: int = -100,
    ntil_ratio: str = "batch",
) -> dict[str, torch.Tensor]:
    """Returns loss, ntil, emd, rel, mag, ce_mean for aligned `logits[B, T, V]`, `labels[B, T]`.
    ``ntil_ratio="sample"``: each sequence's NTIL rescaled by its own summed CE (docs/loss.md)."""
    batch, _, vocab = logits.shape
    ce_mean = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=ignore_index)
    if not bool((labels != ignore_index).any()):
        ce_mean = logits.sum() * 0.0
    digit_of = {token: value for value, token in enumerate(digit_token_ids)}
    columns = list(digit_token_ids)
    zero = logits.new_zeros(())
    emds, rels, mags = [], [], []
    for b in range(batch):
        row = labels[b].tolist()
        runs, start = [], None  # [start, stop) of each maximal block of digit labels
        for t, token in enumerate([*row, None]):
            if token in digit_of and start is None:
                start = t
            elif token not in digit_of and start is not None:
                runs.append((start, t))
                start = None
        emd_terms, rel_terms, mag_terms = [], [], []
        for run_start, run_stop in runs:
            digit_logits = logits[b, run_start:run_stop][:, columns]
            targets = [digit_of[token] for token in row[run_start:run_stop]]
            for i, target in enumerate(targets):
                place = len(targets) - 1 - i
                distance = (torch.arange(10, dtype=logits.dtype, device=logits.device) - target).abs()
                emd = (digit_logits[i].softmax(dim=-1) * distance).sum()
                emd_terms.append(digit_exp**place * emd)
            x = _straight_through_number(digit_logits, gumbel_tau)
            y = torch.tensor(float(int("".join(map(str, targets)))), dtype=logits.dtype, device=logits.device)
            rel = zero if bool(x == y) else (x - y).abs() / (torch.maximum(x, y) + 1)
            rel_terms.append(rel)
            mag_terms.append(torch.log((torch.maximum(x, y) + 1) / (torch.minimum(x, y) + 1)))
        emds.append(torch.stack(emd_terms).mean() if emd_terms else zero)
        rels.append(torch.stack(rel_terms).mean() if rel_terms else zero)
        mags.append(torch.stack(mag_terms).mean() if mag_terms else zero)
    emd, rel, mag = torch.stack(emds), torch.stack(rels), torch.stack(mags)
    per_sequence = digit_alpha * emd + abs_alpha * rel + mag_alpha * mag
    ntil = per_sequence.mean()
    if ntil_ratio == "sample":
        total = 0.0
        for b in range(batch):
            ce_sum_b = F.cross_entropy(logits[b], labels[b], ignore_index=ignore_index, reduction="sum")
            total = total + (ce_sum_b / (per_sequence[b] + 1e-10)).detach() * per_sequence[b]
        loss = ce_mean + ntil_lambda * total / max(int((labels != ignore_index).sum()), 1)
    else:
        loss = ce_mean + ntil_lambda * (ce_mean / (ntil + 1e-10)).detach() * ntil
    return {
        "loss": loss,
        "ntil": ntil,
        "emd": emd.mean(),
        "rel": rel.mean(),
        "mag": mag.mean(),
        "ce_mean": ce_mean,
    }
