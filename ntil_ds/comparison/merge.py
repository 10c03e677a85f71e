"""Grids run apart, read as one: a grid extended later with more seeds, or other losses run beside it
on the same test split. Their runs (results and training curves) go into one results.json, table.md,
comparison.png and curves.png, as if one ``launch/compare.py`` had run them all.

Nothing is trained or scored again: the runs' metrics come from each grid's results.json and their
curves from each run's own metrics.jsonl (so the grids' ``runs/`` folders must still be where they
were written). Runs scored on another test split, or the same (loss, seed) twice, are refused: they
are not the same comparison.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ntil_ds.comparison.grid import write_outputs
from ntil_ds.comparison.results import RunResult
from ntil_ds.tracking.step_log import METRICS_FILE


def merge_comparisons(grids: list[Path], out: Path) -> dict:
    """Merge the grids' results into ``out``; returns the merged report (what results.json holds)."""
    reports = [_read_results(grid) for grid in grids]
    first = reports[0]
    for grid, report in zip(grids[1:], reports[1:], strict=True):
        for key in ("task", "test_split"):
            if report[key] != first[key]:
                raise SystemExit(
                    f"cannot merge {grid}: its {key} is {report[key]!r}, {grids[0]}'s is {first[key]!r}; "
                    "only runs scored on the same test split are one comparison"
                )
    runs: list[RunResult] = []
    owner: dict[tuple[str, int], Path] = {}
    for grid, report in zip(grids, reports, strict=True):
        for record in report["runs"]:
            run = RunResult(**record)
            if (run.label, run.seed) in owner:
                raise SystemExit(
                    f"{run.label} seed {run.seed} is in both {owner[run.label, run.seed]} and {grid}; "
                    "merge grids whose (loss, seed) runs are distinct"
                )
            owner[run.label, run.seed] = grid
            runs.append(run)
    lost = [
        r.output_dir for r in runs if r.status == "ok" and not (Path(r.output_dir) / METRICS_FILE).is_file()
    ]
    if lost:
        print(
            f"note: {len(lost)} runs have no {METRICS_FILE} where their grid wrote it (moved?), so their "
            f"loss has no curve: {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}",
            flush=True,
        )
    labels = list(dict.fromkeys(label for report in reports for label in report["losses"]))
    losses = {run.label: run.loss for run in runs}
    baseline = next((label for label in labels if losses.get(label) == "ce"), labels[0])
    seeds = sorted({run.seed for run in runs})
    sources = [
        {key: report.get(key) for key in ("name", "recipe", "command", "overrides", "nproc", "wall_s")}
        | {"path": str(grid)}
        for grid, report in zip(grids, reports, strict=True)
    ]
    header = {
        "name": f"merge-{time.strftime('%Y%m%d-%H%M%S')}",
        "task": first["task"],
        "test_split": first["test_split"],
        "train_split": first.get("train_split"),
        "controls": first.get("controls"),  # the same test split: the first grid's controls hold for all
        "losses": labels,
        "seeds": seeds,
        "complete": all(report.get("complete", False) for report in reports),
        "merged_from": sources,
        "recipe_differences": _recipe_differences(grids, reports),
    }
    note = "\nMerged from:\n" + "".join(
        f"- {grid} ({report['command']})\n" for grid, report in zip(grids, reports, strict=True)
    )
    for grid, difference in header["recipe_differences"].items():
        note += f"- note: {grid} differs from {grids[0]}: {difference}\n"
    out.mkdir(parents=True, exist_ok=True)
    title = f"{first['task']}: merged from {len(grids)} grids, seeds {','.join(map(str, seeds))}"
    return write_outputs(out, runs, tuple(first["metrics"]), baseline, header, title, note)


def _read_results(grid: Path) -> dict:
    path = grid / "results.json"
    if not path.is_file():
        raise SystemExit(f"{grid} holds no results.json: give the --out folder of a launch/compare.py grid")
    return json.loads(path.read_text())


def _recipe_differences(grids: list[Path], reports: list[dict]) -> dict[str, str]:
    """What each later grid ran differently from the first: its recipe, its nproc, the overrides only one
    of them has (a merge is meant for grids run alike; the differences are shown, not judged)."""
    first = reports[0]
    differences = {}
    for grid, report in zip(grids[1:], reports[1:], strict=True):
        parts = [
            f"{key} {report.get(key)} (not {first.get(key)})"
            for key in ("recipe", "nproc")
            if report.get(key) != first.get(key)
        ]
        only_here = [o for o in report.get("overrides", []) if o not in first.get("overrides", [])]
        only_first = [o for o in first.get("overrides", []) if o not in report.get("overrides", [])]
        if only_here:
            parts.append(f"only it has {' '.join(only_here)}")
        if only_first:
            parts.append(f"it lacks {' '.join(only_first)}")
        if parts:
            differences[str(grid)] = "; ".join(parts)
    return differences
