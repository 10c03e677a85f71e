"""Plots logged with a run: loss curves, and the numeric error by digit position.

Drawn with ``matplotlib.figure.Figure`` (no pyplot): no GUI backend, no global figure state, so it
works in a headless job and from any thread.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ntil_ds.scoring import HIGHER_IS_BETTER, TASK_METRICS
from ntil_ds.tracking.step_log import metric_key

# Metric names (last part after "/") drawn in each panel of the loss plot.
OBJECTIVE_KEYS = ("loss", "ce", "ntil")
NTIL_PART_KEYS = ("emd", "rel", "mag")

# Per-position digit accuracy as ntil_ds.scoring.score names it (units = position 0), under any prefix.
DIGIT_POSITION_KEY = re.compile(r"^(?P<prefix>.*?)digit_acc_pos(?P<position>\d+)$")

History = dict[str, dict[int, float]]  # metric key -> {step: value}


def _keys_named(history: History, names: tuple[str, ...]) -> list[str]:
    return sorted(k for k in history if k.rsplit("/", 1)[-1] in names and history[k])


def plot_loss_curves(history: History, path: Path) -> Path | None:
    """Loss, CE and NTIL (train and eval) on the left, NTIL's parts on the right; None without losses."""
    panels = [
        ("objective", _keys_named(history, OBJECTIVE_KEYS)),
        ("NTIL parts", _keys_named(history, NTIL_PART_KEYS)),
    ]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return None
    fig = Figure(figsize=(6 * len(panels), 4.2), layout="constrained")
    for ax, (title, keys) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for key in keys:
            steps = sorted(history[key])
            split, _, name = key.rpartition("/")
            # One colour per quantity, one line style per split: eval/ce sits dashed on train/ce.
            ax.plot(
                steps,
                [history[key][s] for s in steps],
                color=f"C{[*OBJECTIVE_KEYS, *NTIL_PART_KEYS].index(name)}",
                linestyle="--" if split.startswith("eval") else "-",
                marker="." if len(steps) < 50 else None,
                label=key,
            )
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        _finish_axes(ax)
    return _save(fig, path)


def plot_digit_position_error(series: dict[str, dict[int, float]], path: Path) -> Path:
    """Error rate (1 - accuracy) per digit position, units first; one line per series (e.g. per eval step
    or per model), from ``{label: {position: accuracy}}``."""
    fig = Figure(figsize=(6, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, accuracy in series.items():
        positions = sorted(accuracy)
        ax.plot(positions, [1.0 - accuracy[p] for p in positions], marker="o", label=label)
    ax.set_title("numeric error by digit position")
    ax.set_xlabel("digit position (0 = units, 1 = tens, ...)")
    ax.set_ylabel("error rate")
    ax.set_ylim(0.0, 1.05)
    _finish_axes(ax)
    return _save(fig, path)


def _finish_axes(ax) -> None:
    """What every panel shares: whole-number x ticks (steps, positions), a light grid, a legend."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def digit_position_series(history: History) -> dict[str, dict[int, float]]:
    """From a run's history: the per-position accuracies at the first and the last step that has them."""
    by_step: dict[tuple[str, int], dict[int, float]] = {}
    for key, values in history.items():
        match = DIGIT_POSITION_KEY.match(key)
        if match is None:
            continue
        for step, value in values.items():
            by_step.setdefault((match["prefix"], step), {})[int(match["position"])] = value
    if not by_step:
        return {}
    steps = sorted(by_step, key=lambda prefix_step: prefix_step[1])
    chosen = [steps[0]] if steps[0] == steps[-1] else [steps[0], steps[-1]]
    return {f"{prefix}step {step}": by_step[(prefix, step)] for prefix, step in chosen}


def plot_score_curves(history: History, path: Path) -> Path | None:
    """The scores of generated answers during training (``eval/<score>``, the task's shown scores), one
    panel each against the step; None when the run logged none."""
    keys = [
        f"eval/{metric_key(name)}"
        for name in dict.fromkeys(n for shown in TASK_METRICS.values() for n in shown)
    ]
    keys = [key for key in keys if history.get(key)]
    if not keys:
        return None
    fig = Figure(figsize=(3.6 * len(keys) + 0.5, 3.4), layout="constrained")
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys, strict=True):
        steps = sorted(history[key])
        ax.plot(steps, [history[key][s] for s in steps], marker="o", label=key)
        name = key.split("/", 1)[1]
        higher = name in {metric_key(n) for n in HIGHER_IS_BETTER}
        ax.set_title(f"{name} ({'higher' if higher else 'lower'} is better)", fontsize=9)
        ax.set_xlabel("optimizer step")
        _finish_axes(ax)
    fig.suptitle("generated answers during training", fontsize=10)
    return _save(fig, path)


def plot_run_history(history: History, out_dir: Path) -> list[Path]:
    """Every plot the history allows, as PNGs in ``out_dir``: loss curves; the scores of generated
    answers; digit-position error when the run logged ``digit_acc_pos<i>`` metrics."""
    drawn = [
        plot_loss_curves(history, Path(out_dir) / "loss_curves.png"),
        plot_score_curves(history, Path(out_dir) / "eval_scores.png"),
    ]
    series = digit_position_series(history)
    if series:
        drawn.append(plot_digit_position_error(series, Path(out_dir) / "digit_position_error.png"))
    return [path for path in drawn if path is not None]


def plot_comparison(
    summary: dict,
    metrics: tuple[str, ...],
    path: Path,
    title: str,
    higher_is_better: set[str],
    paired: dict | None = None,
) -> Path:
    """One panel per metric: the mean per loss as a bar, the std over seeds as an error bar; with
    ``paired`` (comparison.paired's report) a last panel: each loss's paired change of the first metric
    against the baseline with its 95 % interval, and every seed's own change as a dot."""
    labels = list(summary)
    panels = len(metrics) + bool(paired)
    fig = Figure(figsize=(3.2 * panels + 1, 3.6), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=False):
        means = [summary[label].get(metric, {}).get("mean", math.nan) for label in labels]
        stds = [summary[label].get(metric, {}).get("std", 0.0) for label in labels]
        ax.bar(range(len(labels)), means, yerr=stds, capsize=4, color=[f"C{i}" for i in range(len(labels))])
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        better = "higher" if metric in higher_is_better else "lower"
        ax.set_title(f"{metric} ({better} is better)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    if paired:
        _paired_panel(axes[-1], paired, metrics[0], labels)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _paired_panel(ax, paired: dict, metric: str, labels: list[str]) -> None:
    """Relative change (%) from the paired log-ratio, or the absolute difference where the relative one
    is omitted (a near-zero baseline): a point with its 95 % interval per loss, the seeds as dots."""
    relative = all(p[metric]["relative"] for p in paired.values())
    for x, label in enumerate(paired):
        p = paired[label][metric]
        colour = f"C{labels.index(label)}"
        if relative:
            centre, ci = 100 * p["relative"]["change"], p["relative"]["ci95"]
            ci = ci and [100 * v for v in ci]
            seeds = [100 * math.expm1(v) for v in p["relative"]["log_ratios"]]
        elif p["difference"]:
            centre, ci = p["difference"]["mean"], p["difference"]["ci95"]
            seeds = [s["difference"] for s in p["per_seed"]]
        else:
            continue
        if ci:
            ax.errorbar(
                [x], [centre], yerr=[[centre - ci[0]], [ci[1] - centre]], fmt="o", color=colour, capsize=5
            )
        ax.scatter([x + 0.15] * len(seeds), seeds, s=10, color=colour, alpha=0.6)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(paired)), list(paired), rotation=20, ha="right")
    what = "change, % (paired log-ratio)" if relative else "difference (paired)"
    ax.set_title(f"{metric} vs the baseline: {what}\n95 % CI; dots: the seeds", fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def plot_comparison_curves(
    curves: dict[str, dict[str, dict[int, list[float]]]], metrics: tuple[str, ...], path: Path, title: str
) -> Path | None:
    """One panel per score against the step, one line per loss (the mean over seeds) with the seeds'
    spread as a band (mean +- sample std); ``curves``: {loss: {score: {step: [a value per seed]}}}.
    None when no run logged scores while training (eval.generate_every=0)."""
    shown = [m for m in metrics if any(curves[label].get(m) for label in curves)]
    if not shown:
        return None
    fig = Figure(figsize=(3.8 * len(shown) + 0.5, 3.6), layout="constrained")
    for ax, metric in zip(fig.subplots(1, len(shown), squeeze=False)[0], shown, strict=True):
        for colour, (label, by_metric) in enumerate(curves.items()):
            series = by_metric.get(metric, {})
            steps = sorted(series)
            if not steps:
                continue
            means = [statistics.fmean(series[s]) for s in steps]
            spread = [statistics.stdev(series[s]) if len(series[s]) > 1 else 0.0 for s in steps]
            ax.plot(steps, means, color=f"C{colour}", marker="." if len(steps) < 30 else None, label=label)
            low = [m - s for m, s in zip(means, spread, strict=True)]
            high = [m + s for m, s in zip(means, spread, strict=True)]
            ax.fill_between(steps, low, high, color=f"C{colour}", alpha=0.2)
        ax.set_title(
            f"{metric} ({'higher' if metric in HIGHER_IS_BETTER else 'lower'} is better)", fontsize=9
        )
        ax.set_xlabel("optimizer step")
        _finish_axes(ax)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
