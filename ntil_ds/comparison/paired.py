"""Every loss of a comparison against its baseline, seed by seed (:mod:`~ntil_ds.comparison.stats`):
what results.json's "paired" holds, its section of table.md, and the flat metrics of the MLflow parent
run. The bootstrap re-scores the predictions each run's ``eval_test.json`` saved, item by item."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ntil_ds.comparison.results import RunResult, _finite, _value, slug
from ntil_ds.comparison.stats import NEAR_ZERO_RULE, paired_bootstrap, paired_comparison
from ntil_ds.scoring import HIGHER_IS_BETTER, item_scores

EVAL_FILE = "eval_test.json"  # written by the grid into each run's folder: metrics and every prediction


def seed_map(runs: list[RunResult], label: str, metric: str) -> dict[int, float | None]:
    """{seed: the run's finite value, or None (failed, or no finite value)} of every run of ``label``."""
    return {
        r.seed: (v if r.status == "ok" and _finite(v := _value(r, metric)) else None)
        for r in runs
        if r.label == label
    }


def paired_report(
    runs: list[RunResult], metrics: tuple[str, ...], baseline: str, task: str, *, bootstrap: bool = True
) -> dict[str, dict[str, dict]]:
    """{label: {metric: paired statistics}} for every label but the baseline; the primary metric (the
    first) also gets the two-level bootstrap when every paired run's predictions are where it saved them
    (else "bootstrap" says why not)."""
    report: dict[str, dict[str, dict]] = {}
    base_runs = {r.seed: r for r in runs if r.label == baseline}
    for label in dict.fromkeys(r.label for r in runs):
        if label == baseline:
            continue
        report[label] = {}
        for metric in metrics:
            result = paired_comparison(
                seed_map(runs, label, metric), seed_map(runs, baseline, metric), metric in HIGHER_IS_BETTER
            )
            if metric == metrics[0] and bootstrap and result["paired_seeds"]:
                other_runs = {r.seed: r for r in runs if r.label == label}
                pairs = [(base_runs[s], other_runs[s]) for s in result["paired_seeds"]]
                result["bootstrap"] = _bootstrap(pairs, task, metric, result["relative"] is not None)
            report[label][metric] = result
    return report


def _bootstrap(pairs: list[tuple[RunResult, RunResult]], task: str, metric: str, relative: bool):
    items = []
    for base, other in pairs:
        rows = []
        for run in (base, other):
            path = Path(run.record or Path(run.output_dir) / EVAL_FILE)
            if not path.is_file():
                return f"not run: {run.label} seed {run.seed} has no {path.name}"
            rows.append(json.loads(path.read_text())["samples"])
        if [r["reference"] for r in rows[0]] != [r["reference"] for r in rows[1]]:
            return f"not run: seed {base.seed}'s two runs were scored on different test items"
        try:
            scored = [
                item_scores(task, metric, [r["prediction"] for r in rs], [r["reference"] for r in rs])
                for rs in rows
            ]
        except ValueError as e:
            return f"not run: {e}"
        items.append(tuple(np.asarray(part) for pair in scored for part in pair))
    return paired_bootstrap(items, relative=relative)


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _interval(ci, fmt) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "n/a (1 seed)"


def paired_markdown(paired: dict, metric: str, baseline: str) -> str:
    """The table.md section: per loss, the paired change of ``metric`` and its intervals."""
    if not paired:
        return ""
    better = "higher" if metric in HIGHER_IS_BETTER else "lower"
    header = [
        "loss",
        "paired seeds",
        f"{metric} difference (95 % CI, paired t)",
        "change (95 % CI, paired log-ratio)",
        "wins (sign test p)",
        "bootstrap change 95 % (seeds x items)",
        "unpaired change ± s.e. (delta method)",
    ]
    lines = [
        f"Paired against {baseline} (the same train.seed; {metric}, {better} is better):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    notes = []

    def number(x):
        return f"{x:+.4g}"

    for label, by_metric in paired.items():
        p = by_metric[metric]
        n = len(p["paired_seeds"])
        difference = p["difference"]
        cells = [label, str(n)]
        cells.append(
            "n/a"
            if difference is None
            else f"{number(difference['mean'])} {_interval(difference['ci95'], number)}"
        )
        if p["relative"]:
            cells.append(f"{_pct(p['relative']['change'])} {_interval(p['relative']['ci95'], _pct)}")
        else:
            cells.append(f"omitted: {p['relative_omitted']}" if p["relative_omitted"] else "n/a")
        sign = p["sign_test"]
        cells.append(
            f"{sign['wins']}/{n}"
            + (f", {sign['ties']} tied" if sign["ties"] else "")
            + f" (p={sign['p']:.3g})"
        )
        boot = p.get("bootstrap")
        if isinstance(boot, dict):
            ci = boot["relative_ci95"] if boot["relative_ci95"] else boot["difference_ci95"]
            cells.append(_interval(ci, _pct if boot["relative_ci95"] else number))
        else:
            cells.append(boot or "n/a")
        delta = p["unpaired_delta_method"]
        cells.append(
            "n/a"
            if delta is None
            else _pct(delta["change"]) + ("" if delta["se"] is None else f" ± {delta['se']:.1%}")
        )
        lines.append("| " + " | ".join(cells) + " |")
        for u in p["unpaired"]:
            sides = ", ".join(
                f"{label if side == 'other' else baseline}: {state}"
                for side, state in u.items()
                if side != "seed"
            )
            notes.append(
                f"- unpaired, left out of the paired statistics: {label} vs {baseline} seed {u['seed']} ({sides})"
            )
    lines += ["", *notes] if notes else []
    lines += [
        "",
        f"Wins: paired seeds where the loss beats {baseline}. Change: exp(mean ln(loss/{baseline})) - 1; "
        f"{NEAR_ZERO_RULE}. Bootstrap: 2,000 resamples of seeds, then test items within each seed, the "
        "same for both losses (percentile interval of the change of the means).",
        "",
    ]
    return "\n".join(lines)


def paired_metrics(paired: dict) -> dict[str, float]:
    """Flat metrics for the MLflow parent run: ``<label>/paired/<metric>_<what>``."""
    flat: dict[str, float] = {}
    for label, by_metric in paired.items():
        for metric, p in by_metric.items():
            key = f"{slug(label)}/paired/{metric}"
            flat[f"{key}_n"] = len(p["paired_seeds"])
            flat[f"{key}_wins"] = p["sign_test"]["wins"]
            flat[f"{key}_sign_p"] = p["sign_test"]["p"]
            if p["difference"]:
                flat[f"{key}_difference"] = p["difference"]["mean"]
                if p["difference"]["ci95"]:
                    flat[f"{key}_difference_ci_low"], flat[f"{key}_difference_ci_high"] = p["difference"][
                        "ci95"
                    ]
            if p["relative"]:
                flat[f"{key}_change"] = p["relative"]["change"]
                if p["relative"]["ci95"]:
                    flat[f"{key}_change_ci_low"], flat[f"{key}_change_ci_high"] = p["relative"]["ci95"]
            boot = p.get("bootstrap")
            if isinstance(boot, dict) and boot["relative_ci95"]:
                flat[f"{key}_bootstrap_ci_low"], flat[f"{key}_bootstrap_ci_high"] = boot["relative_ci95"]
    return flat
