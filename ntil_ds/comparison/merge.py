"""Grids run apart, read as one: a grid extended later with more seeds, or other losses run beside it
on the same test split. Their runs (results and training curves) go into one results.json, table.md,
comparison.png and curves.png, as if one ``launch/compare.py`` had run them all.

Nothing is trained or scored again: the runs' metrics come from each grid's results.json and their
curves from each run's own metrics.jsonl (so the grids' ``runs/`` folders must still be where they
were written). Runs scored on other test items (the test splits' content hashes differ, whatever their
paths), a test split that shares items with a grid's training split, or the same (loss, seed) twice,
are refused: they are not the same comparison. The merge gets its own MLflow parent run (``--out``'s
mlflow.db unless MLFLOW_TRACKING_URI says otherwise) with the merged summary and paired statistics.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ntil_ds.comparison.controls import control_scores
from ntil_ds.comparison.outputs import finish_parent_run, write_outputs
from ntil_ds.comparison.results import RunResult
from ntil_ds.comparison.splits import refuse_overlap, split_hash
from ntil_ds.tracking import resolve_tracking_uri
from ntil_ds.tracking.mlflow_comparison import ComparisonRuns
from ntil_ds.tracking.step_log import METRICS_FILE


def merge_comparisons(grids: list[Path], out: Path) -> dict:
    """Merge the grids' results into ``out``; returns the merged report (what results.json holds)."""
    reports = [_read_results(grid) for grid in grids]
    first = reports[0]
    for grid, report in zip(grids[1:], reports[1:], strict=True):
        if report["task"] != first["task"]:
            raise SystemExit(
                f"cannot merge {grid}: its task is {report['task']!r}, {grids[0]}'s is {first['task']!r}; "
                "only runs scored on the same test split are one comparison"
            )
    test_hash = _same_test_items(grids, reports)
    _no_test_item_trained_on(grids, reports)
    runs: list[RunResult] = []
    owner: dict[tuple[str, int], Path] = {}
    for grid, report in zip(grids, reports, strict=True):
        for record in report["runs"]:
            run = RunResult(**record)
            if run.record:  # written relative to its grid's folder when inside it
                run.record = str(grid / run.record)
            if (run.label, run.seed) in owner:
                raise SystemExit(
                    f"{run.label} seed {run.seed} is in both {owner[run.label, run.seed]} and {grid}; "
                    "merge grids whose (loss, seed) runs are distinct"
                )
            owner[run.label, run.seed] = grid
            runs.append(run)
    lost = [
        r.output_dir
        for r in runs
        if r.status == "ok" and not r.record and not (Path(r.output_dir) / METRICS_FILE).is_file()
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
        {
            key: report.get(key)
            for key in ("name", "recipe", "command", "overrides", "nproc", "wall_s", "lr_selection")
        }
        | {"path": str(grid)}
        for grid, report in zip(grids, reports, strict=True)
    ]
    header = {
        "name": f"merge-{time.strftime('%Y%m%d-%H%M%S')}",
        "task": first["task"],
        "test_split": first["test_split"],
        "test_split_sha256": test_hash,
        "train_splits": _train_splits(first),
        # the same test split: the first grid's controls hold for all (made now for a grid that has none)
        "controls": first.get("controls") or _constants_now(first),
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
    uri = resolve_tracking_uri("", out, os.environ.get("MLFLOW_TRACKING_URI"))
    experiment = (first.get("mlflow") or {}).get("experiment", "ntil-ds")
    params = {
        "merged_from": " ".join(map(str, grids)),
        "task": first["task"],
        "test_split": first["test_split"],
    }
    parent = ComparisonRuns(uri, experiment, header["name"], params | {"test_split_sha256": test_hash})
    header["mlflow"] = {"uri": uri, "experiment": experiment, "parent_run_id": parent.parent}
    report = write_outputs(out, runs, tuple(first["metrics"]), baseline, header, title, note)
    finish_parent_run(parent, out, report)
    return report


def _same_test_items(grids: list[Path], reports: list[dict]) -> str:
    """The test splits' content hash, one for all grids, or SystemExit. A grid written before the hash
    was recorded is hashed now from its test split's path (refused if that file is gone)."""
    hashes = []
    for grid, report in zip(grids, reports, strict=True):
        recorded = report.get("test_split_sha256")
        if recorded is None:
            path = Path(report["test_split"])
            if not path.exists():
                raise SystemExit(
                    f"cannot merge {grid}: its results.json records no test split hash and its test split "
                    f"{path} is gone, so what it was scored on cannot be compared"
                )
            print(f"note: {grid} recorded no test split hash; hashed {path} as it is now", flush=True)
            recorded = split_hash(path)
        hashes.append(recorded)
    for grid, report, digest in zip(grids[1:], reports[1:], hashes[1:], strict=True):
        if digest != hashes[0]:
            raise SystemExit(
                f"cannot merge {grid}: its test split {report['test_split']} (sha256 {digest[:12]}) differs in "
                f"content from {grids[0]}'s {reports[0]['test_split']} (sha256 {hashes[0][:12]}); only runs "
                "scored on the same test items are one comparison"
            )
    return hashes[0]


def _constants_now(report: dict) -> dict | None:
    """The answer-ignoring constants of a grid written before they were recorded, from its splits as
    they are now (the shuffled check needs every export run again: not made here)."""
    trains, test = [Path(t) for t in _train_splits(report)], Path(report["test_split"])
    if not trains or not all(train.exists() for train in trains) or not test.is_file():
        return None
    try:
        return control_scores(report["task"], trains, test)
    except ValueError as e:
        print(f"note: no answer-ignoring controls ({e})", flush=True)
        return None


def _train_splits(report: dict) -> list[str]:
    """The grid's training splits: recorded (older grids: one, ``train_split``), else its
    ``data.train_file=`` override (the oldest grids)."""
    if report.get("train_splits"):
        return list(report["train_splits"])
    named = [o.partition("=")[2] for o in report.get("overrides", []) if o.startswith("data.train_file=")]
    recorded = report.get("train_split") or (named[-1] if named else None)
    return [recorded] if recorded else []


def _no_test_item_trained_on(grids: list[Path], reports: list[dict]) -> None:
    """Refuse a merge whose test split shares an item with any grid's training split (a larger draw with
    the same seed splits the same items differently); a training split not found is said, not checked."""
    test = next((Path(r["test_split"]) for r in reports if Path(r["test_split"]).is_file()), None)
    trains = []
    for grid, report in zip(grids, reports, strict=True):
        recorded = _train_splits(report)
        trains += [Path(train) for train in recorded if Path(train).exists()]
        missing = [train for train in recorded if not Path(train).exists()]
        if missing or not recorded:
            named = ", ".join(missing) or "not recorded"
            print(f"note: {grid}'s training split ({named}) was not found: not checked", flush=True)
    if test and trains:
        refuse_overlap(test, trains)


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
