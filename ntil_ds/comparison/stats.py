"""Paired statistics of a comparison: a loss against the baseline (CE) seed by seed.

Seeds are paired by construction: the same ``train.seed`` gives every loss the same initial weights and
batch order, so the per-seed difference removes the seed's own luck. For each (loss, baseline) pair:

- the paired seeds (both runs finished with a finite score) and the unpaired ones (a run missing or
  failed on one side), which are listed and left out of every paired statistic;
- the absolute change: the mean paired difference with its paired-t 95 % interval (n-1 df);
- the relative change from the paired log-ratio: the mean of ln(other / baseline) over paired seeds,
  its t interval (n-1 df), both sent back through exp(.) - 1 (a geometric-mean ratio, so +-x % are
  not symmetric). Omitted, with the reason, when the baseline is near zero (:data:`NEAR_ZERO_RULE`);
- the delta-method standard error of the unpaired relative change of the means (every finished run,
  seeds treated as independent): what a grid whose seeds do not pair can still say;
- the exact two-sided sign test on the paired wins (ties left out);
- a two-level bootstrap (:func:`paired_bootstrap`) over seeds and, within a seed, test items, paired
  on both levels (the same seeds and the same item indices for both losses).

The t distribution and the sign test are scipy.stats' (tested against tabulated and hand-computed
values); the two-level paired bootstrap is numpy here, scipy.stats.bootstrap resampling one level only.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import scipy.stats

NEAR_ZERO_RULE = (
    "relative change omitted when a paired value is <= 0 (no log-ratio) or the baseline's mean is within "
    "2 standard errors of zero (a ratio to it says nothing)"
)
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


# ----------------------------------------------------------------------------------------------------
# distributions (scipy.stats)


def t_two_sided_probability(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with an integer ``df`` >= 1 (scipy.stats.t)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    return float(2 * scipy.stats.t.cdf(abs(t), df) - 1)


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t (0.975 -> the 95 % two-sided critical value)."""
    if not 0 < probability < 1:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    return float(scipy.stats.t.ppf(probability, df))


def sign_test_p(wins: int, n: int) -> float:
    """Exact two-sided sign test: the chance, if each of ``n`` paired seeds were a fair coin, of a win
    count at least as far from n/2 as ``wins`` (scipy.stats.binomtest; p = 0.5 is symmetric, so this is
    2 * the smaller binomial tail, capped at 1)."""
    if not 0 <= wins <= n:
        raise ValueError(f"{wins} wins out of {n}")
    if n == 0:
        return 1.0
    return float(scipy.stats.binomtest(wins, n, 0.5, alternative="two-sided").pvalue)


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The t interval of the mean of ``values`` (n - 1 df); None with fewer than two values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


# ----------------------------------------------------------------------------------------------------
# a loss against the baseline


def delta_method_change(other: list[float], baseline: list[float]) -> dict[str, float | None] | None:
    """Unpaired: mean(other) / mean(baseline) - 1 and its delta-method standard error,
    sqrt(se_o^2 / m_c^2 + m_o^2 se_c^2 / m_c^4) with se the standard error of each mean (std / sqrt n);
    the SE is None without two values on each side, the whole None without a nonzero baseline mean."""
    if not other or not baseline or statistics.fmean(baseline) == 0:
        return None
    m_o, m_c = statistics.fmean(other), statistics.fmean(baseline)
    se = None
    if min(len(other), len(baseline)) >= 2:
        se_o = statistics.stdev(other) / math.sqrt(len(other))
        se_c = statistics.stdev(baseline) / math.sqrt(len(baseline))
        se = math.sqrt(se_o**2 / m_c**2 + m_o**2 * se_c**2 / m_c**4)
    return {"change": m_o / m_c - 1, "se": se}


def near_zero_reason(baseline: list[float], other: list[float]) -> str | None:
    """Why a relative change of these paired values would mislead (:data:`NEAR_ZERO_RULE`), or None."""
    if any(v <= 0 for v in (*baseline, *other)):
        return "a paired value is <= 0"
    if len(baseline) >= 2:
        se = statistics.stdev(baseline) / math.sqrt(len(baseline))
        if abs(statistics.fmean(baseline)) <= 2 * se:
            return "the baseline's mean is within 2 standard errors of zero"
    return None


def paired_comparison(
    other: dict[int, float | None],
    baseline: dict[int, float | None],
    higher_is_better: bool,
) -> dict:
    """One loss against the baseline on one metric; ``other`` / ``baseline``: {seed: the run's value, or
    None for a run that failed or has no finite value}. Seeds on one side only, or None on either, are
    listed as unpaired and left out of the paired statistics."""
    paired = sorted(
        s for s in other.keys() & baseline.keys() if other[s] is not None and baseline[s] is not None
    )
    unpaired = []
    for seed in sorted(other.keys() | baseline.keys()):
        if seed in paired:
            continue
        missing = [
            side for side, values in (("other", other), ("baseline", baseline)) if values.get(seed) is None
        ]
        state = {
            side: ("failed or no value" if seed in values else "no run")
            for side, values in (("other", other), ("baseline", baseline))
            if side in missing
        }
        unpaired.append({"seed": seed, **state})
    o = [other[s] for s in paired]
    c = [baseline[s] for s in paired]
    differences = [a - b for a, b in zip(o, c, strict=True)]
    wins = sum((d > 0) if higher_is_better else (d < 0) for d in differences)
    ties = sum(d == 0 for d in differences)
    result = {
        "paired_seeds": paired,
        "unpaired": unpaired,
        "per_seed": [
            {"seed": s, "baseline": b, "other": a, "difference": a - b}
            for s, a, b in zip(paired, o, c, strict=True)
        ],
        "difference": None,
        "relative": None,
        "relative_omitted": None,
        "sign_test": {
            "wins": wins,
            "losses": len(paired) - wins - ties,
            "ties": ties,
            "p": sign_test_p(wins, len(paired) - ties),
        },
        "unpaired_delta_method": delta_method_change(
            [v for v in other.values() if v is not None], [v for v in baseline.values() if v is not None]
        ),
    }
    if paired:
        interval = mean_interval(differences)
        result["difference"] = {"mean": statistics.fmean(differences), "ci95": interval and list(interval)}
        reason = near_zero_reason(c, o)
        if reason:
            result["relative_omitted"] = reason
        else:
            logs = [math.log(a / b) for a, b in zip(o, c, strict=True)]
            log_interval = mean_interval(logs)
            result["relative"] = {
                "change": math.exp(statistics.fmean(logs)) - 1,
                "ci95": log_interval and [math.exp(x) - 1 for x in log_interval],
                "log_ratios": logs,
            }
    return result


def paired_bootstrap(
    items: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    relative: bool = True,
) -> dict:
    """Two-level paired bootstrap of the change of the mean score: resample the paired seeds with
    replacement, then within each drawn seed the test items with replacement, the same item indices for
    both losses. ``items``: per paired seed (baseline values, baseline weights, other values, other
    weights) over the same test items; a run's score is sum(values * weights) / sum(weights) (weights
    0/1: which items the metric counts, e.g. the parsed answers of a mean error). Returns the 95 %
    percentile intervals of the absolute and (unless ``relative`` is False) relative change."""
    if not items:
        raise ValueError("no paired seeds to bootstrap")
    sizes = {len(part) for row in items for part in row}
    if len(sizes) != 1:
        raise ValueError(f"paired runs must score the same test items; item counts {sorted(sizes)}")
    (m,) = sizes
    rng = np.random.default_rng(seed)
    stacked = [np.stack([np.asarray(row[k], dtype=float) for row in items]) for k in range(4)]
    cv, cw, ov, ow = stacked  # (seeds, items)
    n = len(items)
    base_sum, other_sum = np.zeros(resamples), np.zeros(resamples)
    for _ in range(n):  # each of the n seed draws of every resample
        drawn = rng.integers(0, n, size=resamples)
        idx = rng.integers(0, m, size=(resamples, m))
        with np.errstate(invalid="ignore", divide="ignore"):
            base_sum += (cv[drawn[:, None], idx] * cw[drawn[:, None], idx]).sum(1) / cw[
                drawn[:, None], idx
            ].sum(1)
            other_sum += (ov[drawn[:, None], idx] * ow[drawn[:, None], idx]).sum(1) / ow[
                drawn[:, None], idx
            ].sum(1)
    base_mean, other_mean = base_sum / n, other_sum / n
    defined = np.isfinite(base_mean) & np.isfinite(other_mean)  # a draw with no counted item: no score
    result = {
        "resamples": resamples,
        "seed": seed,
        "undefined": int((~defined).sum()),
        "difference_ci95": _percentiles(other_mean[defined] - base_mean[defined]),
        "relative_ci95": None,
    }
    if relative:
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = other_mean[defined] / base_mean[defined] - 1
        result["relative_ci95"] = _percentiles(ratio[np.isfinite(ratio)])
    return result


def _percentiles(values: np.ndarray) -> list[float] | None:
    return [float(v) for v in np.percentile(values, [2.5, 97.5])] if len(values) else None
