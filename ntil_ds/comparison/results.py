"""The comparison's records and their aggregation: pure functions, but for :func:`score_curves`, which
reads what each run logged while training."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ntil_ds.scoring import HIGHER_IS_BETTER
from ntil_ds.tracking.step_log import METRICS_FILE

EXTRA_COLUMNS = ("train_s",)  # per-run wall time of the training job (launcher start to exit)


@dataclass
class RunResult:
    label: str  # the loss spec as given: "ntil" or "ntil:loss.ntil_lambda=0.6"
    loss: str
    seed: int
    output_dir: str
    status: str = "pending"  # ok | failed
    stage: str = ""  # where a failed run failed: config, train, evaluate
    error: str = ""
    exit_code: int | None = None
    train_s: float | None = None
    eval_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    shuffled: dict[str, Any] = field(default_factory=dict)  # scores on the shuffled-input check, if run
    mlflow_run_id: str | None = None
    # The job's record (comparison.records): its scored items and curve; empty: read from output_dir
    record: str = ""


def parse_loss_specs(text: str) -> list[tuple[str, str, list[str]]]:
    """Each loss spec as (label, loss name, its overrides): "ce,ntil:loss.ntil_lambda=0.6" ->
    [("ce", "ce", ["loss.name=ce"]), ("ntil:...", "ntil", ["loss.name=ntil", "loss.ntil_lambda=0.6"])]."""
    specs = []
    for label in (part.strip() for part in text.split(",")):
        if not label:
            continue
        name, *extra = label.split(":")
        specs.append((label, name, [f"loss.name={name}", *extra]))
    labels = [label for label, _, _ in specs]
    if not specs or len(set(labels)) != len(labels):
        raise SystemExit(f"--losses must name distinct losses, e.g. ce,emd,ntil,ntl; got {text!r}")
    return specs


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds must be integers separated by commas, e.g. 0,1,2; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must be distinct integers, e.g. 0,1,2; got {text!r}")
    return seeds


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def summarize(runs: list[RunResult], metrics: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    """{label: {metric: {"mean", "std", "n"}}} over the runs that finished; std is the sample standard
    deviation over seeds (0 with one run)."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label in dict.fromkeys(r.label for r in runs):
        ok = [r for r in runs if r.label == label and r.status == "ok"]
        summary[label] = {}
        for name in (*metrics, *EXTRA_COLUMNS):
            values = [v for r in ok if _finite(v := _value(r, name))]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                summary[label][name] = {"mean": statistics.fmean(values), "std": std, "n": len(values)}
    return summary


def _finite(value) -> bool:
    """A number the summary averages (what summarize keeps): the per-seed lines and counts use the same."""
    return isinstance(value, int | float) and math.isfinite(value)


def _value(run: RunResult, name: str):
    return getattr(run, name) if name in EXTRA_COLUMNS else run.metrics.get(name)


def change_vs(summary: dict, label: str, baseline: str, metric: str) -> float | None:
    """Relative change of `metric`'s mean against the baseline's (-0.25: 25 % lower)."""
    base, this = summary.get(baseline, {}).get(metric), summary.get(label, {}).get(metric)
    if not base or not this or base["mean"] == 0:
        return None
    return this["mean"] / base["mean"] - 1


def change_error(summary: dict, label: str, baseline: str, metric: str) -> float | None:
    """The delta-method standard error of that change (unpaired: seeds taken as independent),
    sqrt(se_o^2 / m_c^2 + m_o^2 se_c^2 / m_c^4): the baseline's mean is uncertain too, not a constant
    to divide by. None without two runs on each side; the paired analysis is in comparison.paired."""
    base, this = summary.get(baseline, {}).get(metric), summary.get(label, {}).get(metric)
    if not base or not this or base["mean"] == 0 or min(base["n"], this["n"]) < 2:
        return None
    se_o, se_c = this["std"] / math.sqrt(this["n"]), base["std"] / math.sqrt(base["n"])
    m_o, m_c = this["mean"], base["mean"]
    return math.sqrt(se_o**2 / m_c**2 + m_o**2 * se_c**2 / m_c**4)


def seed_values(runs: list[RunResult], label: str, metric: str) -> list[tuple[int, float]]:
    """(seed, value) of ``label``'s finished runs that have a finite ``metric`` (what the summary averages)."""
    return [
        (r.seed, v) for r in runs if r.label == label and r.status == "ok" and _finite(v := _value(r, metric))
    ]


def seeds_better_than(
    runs: list[RunResult], label: str, baseline_mean: float, metric: str
) -> tuple[int, int]:
    """(how many of ``label``'s runs beat the baseline's mean on ``metric``, how many have a value)."""
    values = [value for _, value in seed_values(runs, label, metric)]
    better = sum(v > baseline_mean if metric in HIGHER_IS_BETTER else v < baseline_mean for v in values)
    return better, len(values)


def table_markdown(runs: list[RunResult], summary: dict, metrics: tuple[str, ...], baseline: str) -> str:
    """Mean +- sample std per loss; the primary metric's change against the baseline +- its standard
    error, and how many seeds beat the baseline's mean (the project's bar: every one of them)."""
    primary = metrics[0]
    columns = [*metrics, *EXTRA_COLUMNS]
    header = [
        "loss",
        "runs ok",
        *(
            f"{m} ({'higher' if m in HIGHER_IS_BETTER else 'lower'} is better)" if m in metrics else m
            for m in columns
        ),
        f"{primary} vs {baseline} (± s.e., delta method)",
        f"seeds better than {baseline}'s mean",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, stats in summary.items():
        total = sum(r.label == label for r in runs)
        ok = sum(r.label == label and r.status == "ok" for r in runs)
        cells = [label, f"{ok}/{total}"]
        for m in columns:
            s = stats.get(m)
            cells.append("n/a" if s is None else f"{s['mean']:.4g} ± {s['std']:.2g}")
        change, error = (
            change_vs(summary, label, baseline, primary),
            change_error(summary, label, baseline, primary),
        )
        if label == baseline or change is None:  # no change: no baseline mean either
            cells += ["", ""] if label == baseline else ["n/a", "n/a"]
        else:
            cells.append(f"{change:+.1%}" + ("" if error is None else f" ± {error:.1%}"))
            better, total = seeds_better_than(runs, label, summary[baseline][primary]["mean"], primary)
            cells.append(f"{better}/{total}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Per seed, {primary}:")
    for label in summary:
        values = [f"{value:.4g} (seed {seed})" for seed, value in seed_values(runs, label, primary)]
        lines.append(f"- {label}: {', '.join(values) or 'none'}")
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        lines += ["", f"Failed runs ({len(failed)}):"]
        lines += [
            f"- {r.label} seed {r.seed}: {r.stage} failed: {r.error.splitlines()[-1] if r.error else '?'}"
            f" (see {r.output_dir})"
            for r in failed
        ]
    return "\n".join(lines) + "\n"


def score_curves(
    runs: list[RunResult], metrics: tuple[str, ...]
) -> dict[str, dict[str, dict[int, list[float]]]]:
    """{label: {score: {step: [one value per seed]}}} from what each finished run logged while training
    (the "generate" records of its metrics.jsonl; steps every run of a label reached)."""
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    for label in dict.fromkeys(r.label for r in runs):
        per_seed = [_generated_scores(r) for r in runs if r.label == label and r.status == "ok"]
        curves[label] = {}
        for metric in metrics:
            steps = set.intersection(*(set(s.get(metric, {})) for s in per_seed)) if per_seed else set()
            if steps:
                curves[label][metric] = {step: [s[metric][step] for s in per_seed] for step in sorted(steps)}
    return curves


def _generated_scores(run: RunResult) -> dict[str, dict[int, float]]:
    """{score: {step: value}} of a run's generate records (the last record of a step wins), from its
    record, or from the metrics.jsonl in its folder (a grid from before records)."""
    if run.record:
        logged = json.loads(Path(run.record).read_text())["curve"]
    else:
        path = Path(run.output_dir) / METRICS_FILE
        lines = path.read_text().splitlines() if path.is_file() else []
        logged = [record for line in lines if (record := json.loads(line)).get("split") == "generate"]
    scores: dict[str, dict[int, float]] = {}
    for record in logged:
        for name, value in record.items():
            if name not in ("split", "step"):
                scores.setdefault(name, {})[record["step"]] = value
    return scores
