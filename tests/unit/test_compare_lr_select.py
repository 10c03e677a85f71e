"""The lr chosen per loss on validation (ntil_ds.comparison.lr_select, launch/compare.py --lr-grid): the
parsing, the pick, the plan's refusals, and the grid's order of work: selection runs scored on the
validation split, the paired seeds at each loss's pick, the choice in results.json. Training and scoring
are stood in for by a table of scores (`_ScoredGrid.launch` writes each job's record): the real jobs are what
tests/distributed/test_compare_harness.py runs; here only the choice and its bookkeeping are checked."""

import json
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import pytest

from ntil_ds.comparison.grid import Comparison
from ntil_ds.comparison.lr_select import check_selection, parse_lr_grid, pick_lr
from ntil_ds.comparison.plan import plan_comparison
from ntil_ds.comparison.records import atomic_write_json
from ntil_ds.comparison.results import RunResult
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.jobs import REPO_ROOT

RECIPE = REPO_ROOT / "configs" / "train" / "tiny_qwen2_arithmetic.yaml"


def test_grid_parsing_seed_rules_and_the_pick():
    assert parse_lr_grid("6e-4, 1.5e-4,3e-4") == [1.5e-4, 3e-4, 6e-4] and parse_lr_grid(None) == []
    for bad in ("3e-4,3e-4", "0,1e-3", "a"):
        with pytest.raises(SystemExit, match="--lr-grid"):
            parse_lr_grid(bad)
    with pytest.raises(SystemExit, match="one of --seeds"):
        check_selection([1e-3], 2, [0, 1, 2])
    with pytest.raises(SystemExit, match="go together"):
        check_selection([1e-3], None, [0])
    # lower is better for an error, higher for a rate; a failed run (None) or NaN is no candidate;
    # a tie goes to the smaller lr
    assert pick_lr({1e-4: 5.0, 3e-4: 4.0, 6e-4: None}, "abs_error") == 3e-4
    assert pick_lr({1e-4: 0.5, 3e-4: 0.7, 6e-4: float("nan")}, "exact_match") == 3e-4
    assert pick_lr({6e-4: 4.0, 3e-4: 4.0}, "abs_error") == 3e-4
    assert pick_lr({1e-4: None}, "abs_error") is None


def _data(tmp_path):
    return write_dataset("arithmetic", 40, tmp_path / "data", seed=0, difficulty="easy")


def _plan(tmp_path, splits, *extra, seeds=(0, 1), select_seed=100, specs=None):
    return plan_comparison(
        RECIPE,
        tmp_path / "out",
        specs or [("ce", "ce", ["loss.name=ce"]), ("ntil", "ntil", ["loss.name=ntil"])],
        list(seeds),
        nproc=1,
        overrides=[
            f"data.train_file={splits['train']}",
            f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
            *extra,
        ],
        test_split=splits["test"],
        task=None,
        command="compare.py --lr-grid 1e-4,3e-4",
        lr_grid=[1e-4, 3e-4],
        select_seed=select_seed,
    )


def test_the_plan_chooses_on_validation_and_refuses_the_test_split(tmp_path):
    splits = _data(tmp_path)
    with pytest.raises(SystemExit, match="data.eval_file, which is not set"):
        _plan(tmp_path, splits, "data.eval_file=")
    with pytest.raises(SystemExit, match="holds the test split's items"):
        _plan(tmp_path, splits, f"data.eval_file={splits['test']}")
    with pytest.raises(SystemExit, match="one of --seeds"):
        _plan(tmp_path, splits, f"data.eval_file={splits['val']}", select_seed=1)
    plan = _plan(tmp_path, splits, f"data.eval_file={splits['val']}")
    assert plan.val_split == Path(splits["val"]) and len(plan.val_split_sha256) == 64


class _ScoredGrid(Comparison):
    """The grid with each job's training and scoring replaced by a score table: (label, lr, split) ->
    abs_error. What it records per call is what the grid asked for."""

    table: ClassVar[dict] = {
        ("ce", 1e-4, "val"): 9.0, ("ce", 3e-4, "val"): 7.0,  # ce: 3e-4 on validation
        ("ntil", 1e-4, "val"): 6.0, ("ntil", 3e-4, "val"): None,  # ntil: 1e-4 (3e-4 failed)
        ("ce", 1e-4, "test"): 1.0, ("ce", 3e-4, "test"): 5.0,  # test would pick 1e-4: never read
        ("ntil", 1e-4, "test"): 4.0, ("ntil", 3e-4, "test"): 2.0,
    }  # fmt: skip

    def launch(self, run_dir):
        """What the worker would leave (comparison.worker): the job's record, here from the table."""
        job = json.loads((run_dir / "job.json").read_text())
        lr = float(next(o for o in job["overrides"] if o.startswith("optim.lr=")).partition("=")[2])
        split = "val" if job["score_split"] == str(self.plan.val_split) else "test"
        self.calls = [*getattr(self, "calls", []), (job["label"], job["seed"], lr, split)]
        value = self.table[job["label"].partition("@")[0], lr, split]
        run = RunResult(job["label"], job["loss"], job["seed"], str(run_dir))
        run.status, run.metrics = ("ok", {"abs_error": value, "parse_rate": 1.0}) if value else ("failed", {})
        atomic_write_json(
            Path(job["record"]), {"key": job["key"], "result": asdict(run), "curve": [], "samples": []}
        )
        return _Exited()


class _Exited:
    """A worker process that has exited."""

    pid, returncode = 0, 0

    def poll(self):
        return 0


def test_the_grid_selects_on_validation_then_runs_the_paired_seeds_at_the_pick(tmp_path):
    splits = _data(tmp_path)
    grid = _ScoredGrid(_plan(tmp_path, splits, f"data.eval_file={splits['val']}", "eval.task=arithmetic"))
    grid.run()
    selection = [c for c in grid.calls if c[1] == 100]
    assert {c[3] for c in selection} == {"val"} and len(selection) == 4  # 2 losses x 2 lrs, on validation
    assert all(c[3] == "test" for c in grid.calls[4:])  # then the paired seeds, on test
    paired = {(label, seed): lr for label, seed, lr, _ in grid.calls[4:]}
    assert paired == {("ce", 0): 3e-4, ("ntil", 0): 1e-4, ("ce", 1): 3e-4, ("ntil", 1): 1e-4}
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    chosen = report["lr_selection"]
    assert chosen["seed"] == 100 and chosen["metric"] == "abs_error" and chosen["split"] == str(splits["val"])
    assert chosen["losses"]["ce"]["picked"] == 3e-4 and chosen["losses"]["ntil"]["picked"] == 1e-4
    assert chosen["losses"]["ntil"]["validation"] == [
        {"lr": 1e-4, "abs_error": 6.0},
        {"lr": 3e-4, "abs_error": None},
    ]
    assert [r["status"] for r in chosen["losses"]["ntil"]["runs"]] == ["ok", "failed"]
    assert {r["label"] for r in report["runs"]} == {"ce", "ntil"}  # selection runs stay out of the stats
