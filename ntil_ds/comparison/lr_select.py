"""The learning rate of each loss, chosen on validation before the paired seeds run (``launch/compare.py
--lr-grid 1.5e-4,3e-4,6e-4 --select-seed 100``).

Each loss trains once per lr of the grid on the selection seed; each export is scored on the validation
split (``data.eval_file``), never on the test split, and the lr with the best validation score on the
comparison's primary metric is that loss's lr for all its paired seeds. The selection seed is not one of
the paired seeds, so no paired run was seen by the choice. Pure functions; the runs are the grid's.
"""

from __future__ import annotations

import math

from ntil_ds.scoring import HIGHER_IS_BETTER


def parse_lr_grid(text: str | None) -> list[float]:
    """ "1.5e-4,3e-4" -> [0.00015, 0.0003]: distinct positive rates, sorted; empty or None: no selection."""
    if not text:
        return []
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(
            f"--lr-grid must be numbers separated by commas, e.g. 1.5e-4,3e-4; got {text!r}"
        ) from None
    if not rates or len(set(rates)) != len(rates) or not all(math.isfinite(r) and r > 0 for r in rates):
        raise SystemExit(f"--lr-grid must be distinct positive numbers, e.g. 1.5e-4,3e-4,6e-4; got {text!r}")
    return sorted(rates)


def check_selection(lr_grid: list[float], select_seed: int | None, seeds: list[int]) -> None:
    """--lr-grid needs --select-seed, a seed that is not one of the paired seeds (and the reverse)."""
    if bool(lr_grid) != (select_seed is not None):
        raise SystemExit("--lr-grid and --select-seed go together: give both (or neither)")
    if select_seed is not None and select_seed in seeds:
        raise SystemExit(
            f"--select-seed {select_seed} is one of --seeds: the lr would be chosen on a paired run; pick a "
            "seed outside them"
        )


def pick_lr(scores: dict[float, float | None], metric: str) -> float | None:
    """The lr with the best validation ``metric`` (higher or lower is better as the metric says); runs
    that failed or gave no finite score (None) are not candidates; a tie goes to the smaller lr. None when
    no lr has a score."""
    valid = {lr: v for lr, v in scores.items() if isinstance(v, int | float) and math.isfinite(v)}
    if not valid:
        return None
    sign = -1.0 if metric in HIGHER_IS_BETTER else 1.0
    return min(valid, key=lambda lr: (sign * valid[lr], lr))


def selection_label(label: str, lr: float) -> str:
    """The selection run of ``label`` at ``lr`` (its folder and MLflow name): "ntil@lr=0.0003"."""
    return f"{label}@lr={lr:g}"
