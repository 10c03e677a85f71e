"""A comparison's outputs: results.json, table.md, comparison.png and curves.png of its runs (what a grid
rewrites after every job, and a merge of grids writes once), and its MLflow parent run closed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ntil_ds.comparison.controls import (
    controls_markdown,
    controls_metrics,
)
from ntil_ds.comparison.paired import paired_markdown, paired_metrics, paired_report
from ntil_ds.comparison.results import (
    RunResult,
    change_error,
    change_vs,
    score_curves,
    slug,
    summarize,
    table_markdown,
)
from ntil_ds.scoring import HIGHER_IS_BETTER
from ntil_ds.tracking.plots import plot_comparison, plot_comparison_curves


def finish_parent_run(parent, out: Path, report: dict) -> None:
    """Close a comparison's MLflow parent run (a grid's or a merge's): the summary per loss, the paired
    statistics and controls as metrics, the outputs under `out` as artifacts."""
    parent.finish(
        {slug(label): stats for label, stats in report["summary"].items()},
        [
            p
            for p in (out / n for n in ("results.json", "table.md", "comparison.png", "curves.png"))
            if p.is_file()
        ],
        any_failed=bool(report["failed"]),
        extra_metrics=paired_metrics(report["paired"]) | controls_metrics(report.get("controls")),
    )


def write_outputs(
    out: Path,
    runs: list[RunResult],
    metrics: tuple[str, ...],
    baseline: str,
    header: dict,
    title: str,
    table_note: str = "",
) -> dict:
    """results.json, table.md, comparison.png and curves.png of ``runs`` (what a grid rewrites after
    every run, and what a merge of grids writes once); ``header``: what was run. Returns the report."""
    summary = summarize(runs, metrics)
    report = {
        **header,
        "metrics": list(metrics),
        "baseline": baseline,
        "summary": summary,
        "change_vs_baseline": {label: change_vs(summary, label, baseline, metrics[0]) for label in summary},
        "change_vs_baseline_error": {  # the standard error of each change (table.md's "± s.e.")
            label: change_error(summary, label, baseline, metrics[0]) for label in summary
        },
        # each loss against the baseline, seed by seed (comparison.paired; the table's second section)
        "paired": paired_report(runs, metrics, baseline, header["task"]),
        "curves": score_curves(runs, metrics),  # scores while training, per seed
        # each record's path relative to out when it is inside (records committed with the results)
        "runs": [asdict(r) | {"record": _relative(r.record, out)} for r in runs],
        "failed": [f"{r.label} seed {r.seed}" for r in runs if r.status != "ok"],
    }
    out.mkdir(parents=True, exist_ok=True)  # no run may have written there (all failed before training)
    (out / "results.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    table = "\n".join(
        [
            table_markdown(runs, summary, metrics, baseline),
            paired_markdown(report["paired"], metrics[0], baseline),
            controls_markdown(header.get("controls"), runs, summary, metrics),
        ]
    )
    (out / "table.md").write_text(table + table_note)
    plot_comparison(summary, metrics, out / "comparison.png", title, HIGHER_IS_BETTER, report["paired"])
    plot_comparison_curves(report["curves"], metrics, out / "curves.png", f"{title}: during training")
    return report


def _relative(path: str, out: Path) -> str:
    if not path or not Path(path).is_relative_to(out):
        return path
    return str(Path(path).relative_to(out))
