"""The comparison's aggregation (ntil_ds.comparison, behind launch/compare.py) on hand-computed cases:
mean +- sample std over seeds, the change against the baseline, failed runs kept in the table, loss specs
with their own overrides."""

import math
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def compare():
    """The comparison's pure parts, under one name as the tests below use them."""
    from ntil_ds.comparison import results
    from ntil_ds.tracking.step_log import metric_key

    return SimpleNamespace(
        **{n: getattr(results, n) for n in dir(results) if not n.startswith("_")}, metric_key=metric_key
    )


def _run(compare, label, seed, status="ok", **metrics):
    return compare.RunResult(
        label=label,
        loss=label.split(":")[0],
        seed=seed,
        output_dir=f"runs/{label}-{seed}",
        status=status,
        train_s=10.0 + seed,
        metrics=metrics,
    )


def test_loss_specs_and_seeds(compare):
    assert compare.parse_loss_specs("ce, ntil:loss.ntil_lambda=0.6") == [
        ("ce", "ce", ["loss.name=ce"]),
        ("ntil:loss.ntil_lambda=0.6", "ntil", ["loss.name=ntil", "loss.ntil_lambda=0.6"]),
    ]
    with pytest.raises(SystemExit, match="distinct"):
        compare.parse_loss_specs("ce,ce")
    assert compare.parse_seeds("0,1,2") == [0, 1, 2]
    with pytest.raises(SystemExit, match="integers"):
        compare.parse_seeds("0,a")


def test_summary_mean_std_change_and_failed_runs(compare):
    runs = [
        _run(compare, "ce", 0, abs_error=10.0, parse_rate=1.0),
        _run(compare, "ce", 1, abs_error=14.0, parse_rate=0.5),
        _run(compare, "ntil", 0, abs_error=6.0, parse_rate=1.0),
        _run(compare, "ntil", 1, abs_error=9.0, parse_rate=None),  # nothing parsed: no value, not a zero
        _run(compare, "ntil", 2, status="failed"),
    ]
    runs[-1].stage, runs[-1].error = "train", "exit code 1; last lines:\nboom"
    metrics = ("abs_error", "parse_rate")
    summary = compare.summarize(runs, metrics)
    assert summary["ce"]["abs_error"] == {"mean": 12.0, "std": pytest.approx(math.sqrt(8)), "n": 2}
    assert summary["ntil"]["abs_error"]["mean"] == 7.5 and summary["ntil"]["abs_error"]["n"] == 2
    assert summary["ntil"]["parse_rate"] == {"mean": 1.0, "std": 0.0, "n": 1}
    assert summary["ntil"]["train_s"]["mean"] == 10.5  # the failed run's time is not averaged in
    assert compare.change_vs(summary, "ntil", "ce", "abs_error") == pytest.approx(7.5 / 12 - 1)
    table = compare.table_markdown(runs, summary, metrics, "ce")
    assert "| ce | 2/2 | 12 ± 2.8 | 0.75 ± 0.35 | 10.5 ± 0.71 |  |" in table
    # the change's delta-method standard error (ntil's values 6, 9: se^2 4.5 / 2; ce's 10, 14: se^2 8 / 2):
    # sqrt(2.25 / 12^2 + 7.5^2 * 4 / 12^4) = sqrt(0.015625 + 0.0108507) = 0.16271
    assert compare.change_error(summary, "ntil", "ce", "abs_error") == pytest.approx(0.1627135, abs=1e-6)
    assert "| ntil | 2/3 | 7.5 ± 2.1 |" in table and "| -37.5% ± 16.3% | 2/2 |" in table
    assert "- ntil: 6 (seed 0), 9 (seed 1)" in table  # per seed, the failed one left out there
    assert compare.seeds_better_than(runs, "ntil", 8.0, "abs_error") == (1, 2)  # 6 beats 8, 9 does not
    assert compare.seeds_better_than(runs, "ce", 0.9, "parse_rate") == (1, 2)  # higher is better there
    # a non-finite score is left out of the count as the summary leaves it out of the mean
    nan_run = _run(compare, "emd", 0, abs_error=float("nan"), parse_rate=1.0)
    assert compare.seeds_better_than([nan_run], "emd", 8.0, "abs_error") == (0, 0)
    assert "- ntil seed 2: train failed: boom (see runs/ntil-2)" in table


def test_metric_keys_are_valid_for_mlflow(compare):
    assert compare.metric_key("test/acc@0.5") == "test/acc_at_0.5"
    assert (
        compare.metric_key("ntil_loss.ntil_lambda=0.6/abs_error_mean")
        == "ntil_loss.ntil_lambda_0.6/abs_error_mean"
    )


def test_score_curves_take_every_seed_of_a_loss_at_the_steps_all_reached(compare, tmp_path):
    """The curves come from each run's own metrics.jsonl ("generate" records, the last of a step wins);
    a failed run adds nothing; a step only some seeds reached is left out (no mean of one seed there)."""
    import json

    from ntil_ds.tracking.plots import plot_comparison_curves

    def run(label, seed, records, status="ok"):
        folder = tmp_path / f"{label}-{seed}"
        folder.mkdir()
        lines = [{"split": "train", "step": 1, "loss": 1.0}, *({"split": "generate", **r} for r in records)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        result = _run(compare, label, seed, status=status)
        result.output_dir = str(folder)
        return result

    runs = [
        run("ce", 0, [{"step": 2, "abs_error": 9.0}, {"step": 4, "abs_error": 7.0}]),
        run(
            "ce",
            1,
            [{"step": 2, "abs_error": 5.0}, {"step": 2, "abs_error": 6.0}, {"step": 4, "abs_error": 3.0}],
        ),
        run("ntil", 0, [{"step": 2, "abs_error": 4.0}, {"step": 4, "abs_error": 2.0}]),
        run("ntil", 1, [{"step": 2, "abs_error": 8.0}]),  # stopped before step 4
        run("ntil", 2, [{"step": 2, "abs_error": 99.0}], status="failed"),
    ]
    curves = compare.score_curves(runs, ("abs_error", "iou"))
    assert curves == {
        "ce": {"abs_error": {2: [9.0, 6.0], 4: [7.0, 3.0]}},
        "ntil": {"abs_error": {2: [4.0, 8.0]}},
    }
    assert (
        plot_comparison_curves(curves, ("abs_error",), tmp_path / "c.png", "t").read_bytes()[:4] == b"\x89PNG"
    )
    assert plot_comparison_curves({"ce": {}}, ("abs_error",), tmp_path / "none.png", "t") is None


def test_the_plan_takes_uri_credentials_and_writes_none(tmp_path, monkeypatch):
    """A comparison given ``tracking.uri=http://user:password@host``: the credentials become this
    process's MLflow variables (its jobs inherit them); the plan (what the jobs are given, results.json
    and the parent run's params are made from) holds them nowhere."""
    import json
    import os
    from dataclasses import asdict

    from ntil_ds.comparison.plan import plan_comparison
    from ntil_ds.jobs import REPO_ROOT

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.setenv(name, "")  # records the original state for teardown
        monkeypatch.delenv(name)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "test.jsonl").write_text(json.dumps({"task": "arithmetic"}) + "\n")
    uri = "http://trainer:secret-pw@mlflow.example:5000"
    plan = plan_comparison(
        REPO_ROOT / "configs" / "train" / "tiny_qwen2_arithmetic.yaml",
        tmp_path / "out",
        [("ce", "ce", ["loss.name=ce"])],
        [0],
        nproc=1,
        overrides=[f"data.train_file={tmp_path / 'train.jsonl'}", f"tracking.uri={uri}"],
        test_split=None,
        task=None,
        command=f"compare.py --config tiny_qwen2_arithmetic.yaml tracking.uri={uri}",
    )
    assert plan.uri == "http://mlflow.example:5000"
    assert f"tracking.uri={plan.uri}" in plan.base_overrides and plan.command.endswith(plan.uri)
    assert "secret" not in json.dumps(asdict(plan), default=str)
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == (
        "trainer",
        "secret-pw",
    )


def test_merge_reads_grids_run_apart_as_one(compare, tmp_path, capsys):
    """Two grids written by the grid's own writer (seeds 0-1 of ce and ntil; seed 2 of both run later)
    merged by ``launch/compare.py --merge``: the same summary, change and curves as one grid of all the
    runs, and an MLflow parent run of its own; a (loss, seed) in both grids, test items of another
    content (whatever the path), or a test split sharing items with a training split, is refused."""
    import json
    import shutil

    from mlflow import MlflowClient

    import launch.compare as cli
    from ntil_ds.comparison.outputs import write_outputs
    from ntil_ds.comparison.splits import split_hash
    from ntil_ds.data.synthetic import write_dataset

    data = write_dataset("arithmetic", 20, tmp_path / "data", seed=0, difficulty="easy")
    copy = tmp_path / "copy" / "test.jsonl"  # the same test items at another path: one comparison
    copy.parent.mkdir()
    shutil.copy(data["test"], copy)

    def grid(name, seeds, values, test_split=data["test"], overrides=("train.max_steps=100",), hashed=True):
        out = tmp_path / name
        runs = []
        for seed in seeds:
            for label in ("ce", "ntil"):
                folder = out / "runs" / f"{label}-seed{seed}"
                folder.mkdir(parents=True)
                record = {"split": "generate", "step": 50, "abs_error": values[label, seed] + 10}
                (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
                run = _run(compare, label, seed, abs_error=values[label, seed], parse_rate=1.0)
                run.output_dir = str(folder)
                runs.append(run)
        header = {"name": name, "command": f"compare.py --seeds {seeds}", "task": "arithmetic"}
        header |= {"test_split": str(test_split), "losses": ["ce", "ntil"], "seeds": seeds, "complete": True}
        header |= {
            "recipe": "r.yaml",
            "nproc": 1,
            "overrides": [f"data.train_file={data['train']}", *overrides],
        }
        if hashed:  # a grid written before the hash was recorded has none: hashed at merge time
            header["test_split_sha256"] = split_hash(test_split)
        write_outputs(out, runs, ("abs_error", "parse_rate"), "ce", header, name)
        return out, runs

    values = {("ce", 0): 10.0, ("ce", 1): 14.0, ("ce", 2): 12.0, ("ntil", 0): 6.0, ("ntil", 1): 9.0}
    values[("ntil", 2)] = 3.0
    first, runs_first = grid("first", [0, 1], values)
    later, runs_later = grid(
        "later", [2], values, copy, overrides=("train.max_steps=100", "optim.lr=1e-3"), hashed=False
    )
    merged = tmp_path / "merged"
    assert cli.main(["--merge", str(first), str(later), "--out", str(merged)]) == 0
    report = json.loads((merged / "results.json").read_text())
    all_runs = runs_first + runs_later
    assert report["summary"] == json.loads(
        json.dumps(compare.summarize(all_runs, ("abs_error", "parse_rate")))
    )
    assert report["summary"]["ntil"]["abs_error"] == {"mean": 6.0, "std": 3.0, "n": 3}
    assert report["change_vs_baseline"]["ntil"] == pytest.approx(6.0 / 12.0 - 1)
    assert report["paired"]["ntil"]["abs_error"]["paired_seeds"] == [0, 1, 2]
    assert report["curves"]["ntil"]["abs_error"] == {"50": [16.0, 19.0, 13.0]}  # every seed's curve
    assert report["seeds"] == [0, 1, 2] and report["losses"] == ["ce", "ntil"]
    assert report["recipe_differences"] == {str(later): "only it has optim.lr=1e-3"}
    assert report["test_split_sha256"] == split_hash(data["test"])
    # grids written before the controls were recorded: the constants are made now from their splits
    assert report["controls"]["train_split"] == str(data["train"])
    assert "| best constant (train median) |" in (merged / "table.md").read_text()
    table = (merged / "table.md").read_text()
    assert "| ntil | 3/3 | 6 ± 3 |" in table and "- ntil: 6 (seed 0), 9 (seed 1), 3 (seed 2)" in table
    assert f"- {first} (compare.py --seeds [0, 1])" in table and "only it has optim.lr=1e-3" in table
    assert (merged / "curves.png").read_bytes()[:4] == b"\x89PNG"
    output = capsys.readouterr().out
    assert "| ntil | 3/3 |" in output and f"{later} recorded no test split hash" in output
    client = MlflowClient(report["mlflow"]["uri"])
    parent = client.get_run(report["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["ntil/abs_error_mean"] == 6.0
    change = report["paired"]["ntil"]["abs_error"]["relative"]["change"]
    assert parent.data.metrics["ntil/paired/abs_error_change"] == pytest.approx(change)
    best = report["controls"]["constants"]["best constant (train median)"]["metrics"]["abs_error"]
    assert parent.data.metrics["controls/best_constant/abs_error"] == pytest.approx(best)

    with pytest.raises(SystemExit, match="ce seed 2 is in both .* distinct"):
        cli.main(["--merge", str(first), str(later), str(later), "--out", str(tmp_path / "twice")])
    redrawn = write_dataset("arithmetic", 20, tmp_path / "redrawn", seed=1, difficulty="easy")
    other, _ = grid("other", [5], {("ce", 5): 1.0, ("ntil", 5): 1.0}, test_split=redrawn["test"])
    with pytest.raises(SystemExit, match="differs in content .* same test items"):
        cli.main(["--merge", str(first), str(other), "--out", str(tmp_path / "mixed")])
    # a larger draw with the same seed: its training split holds the smaller draw's test items
    larger = write_dataset("arithmetic", 40, tmp_path / "larger", seed=0, difficulty="easy")
    leaky, _ = grid("leaky", [6], {("ce", 6): 1.0, ("ntil", 6): 1.0})
    results = json.loads((leaky / "results.json").read_text())
    results["overrides"] = [f"data.train_file={larger['train']}"]
    (leaky / "results.json").write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="2 of the 2 test items .* are in the training split"):
        cli.main(["--merge", str(first), str(leaky), "--out", str(tmp_path / "leak")])
    with pytest.raises(SystemExit, match="holds no results.json"):
        cli.main(["--merge", str(tmp_path / "nowhere"), "--out", str(tmp_path / "none")])
    with pytest.raises(SystemExit):  # argparse's usage error: --merge takes folders and --out only
        cli.main(["--merge", str(first), "--config", "r.yaml", "--out", str(tmp_path / "x")])
    assert "--merge reads finished grids" in capsys.readouterr().err


def test_the_plan_refuses_a_test_split_that_overlaps_the_training_split(tmp_path):
    from ntil_ds.comparison.plan import plan_comparison
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.jobs import REPO_ROOT

    small = write_dataset("arithmetic", 20, tmp_path / "small", seed=0, difficulty="easy")
    larger = write_dataset("arithmetic", 40, tmp_path / "larger", seed=0, difficulty="easy")
    recipe = REPO_ROOT / "configs" / "train" / "tiny_qwen2_arithmetic.yaml"

    def plan_with(*data_overrides):
        return plan_comparison(
            recipe,
            tmp_path / "out",
            [("ce", "ce", ["loss.name=ce"])],
            [0],
            nproc=1,
            overrides=[*data_overrides, f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"],
            test_split=small["test"],
            task=None,
            command="compare.py",
        )

    def plan(train):
        return plan_with(f"data.train_file={train}")

    assert plan(small["train"]).test_split_sha256 == plan(small["train"]).test_split_sha256
    with pytest.raises(SystemExit, match="test items of .* are in the training split"):
        plan(larger["train"])

    # Under data.mixture every source is a training split: the overlap is found in the second one, and
    # the constants come from the answers of all of them.
    other = write_dataset("arithmetic", 20, tmp_path / "other", seed=5)  # larger numbers: another median

    def mixture_plan(*sources):
        mixture = ", ".join(f"{{file: {source}, weight: 1}}" for source in sources)
        return plan_with(f"data.mixture=[{mixture}]", "data.train_file=")

    assert mixture_plan(small["train"], other["train"]).train_splits == [small["train"], other["train"]]
    with pytest.raises(SystemExit, match=f"in the training split {larger['train']}"):
        mixture_plan(small["train"], larger["train"])
    from ntil_ds.comparison.controls import answers, best_constant, control_scores

    both = control_scores("arithmetic", [small["train"], other["train"]], small["test"])
    assert both["train_split"] == f"{small['train']}, {other['train']}"
    pooled = answers(small["train"]) + answers(other["train"])
    constant = both["constants"]["best constant (train median)"]["answer"]
    assert (
        constant
        == best_constant("arithmetic", pooled)
        != best_constant("arithmetic", answers(small["train"]))
    )
