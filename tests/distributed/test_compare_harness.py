"""launch/compare.py end to end, small: 2 losses x 1 seed of real training jobs (deepspeed launcher,
a tiny Qwen2, 2 steps) plus a third entry whose job fails, each scored on the test split, two jobs at
once (--jobs 2, one thread each). Checks every output: results.json, the table, the plot, and the MLflow
parent run with one child per job, the failed job reported (not dropped) in all of them.

Then the resume (docs/comparison.md, "Resume"), run beside that grid: the same two losses on the same
model and data one job at a time (--jobs 1, one thread), stopped with SIGTERM once its first job's record
is written and started again: it trains only the missing job, and both give the per-run scores of the
--jobs 2 grid; a changed recipe on those records is refused, naming the field; a job trained but not
scored is scored, not trained again."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ntil_ds.comparison.plan import prepare_inputs
from tests.conftest import REPO_ROOT
from tests.distributed.training_runs import launch_env, train_metrics

# ~1-2 min on 2 free cores; the limit is for a machine shared with other jobs (3 launcher starts)
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1800)]

# global_batch_size 3 cannot be split into micro-batches of 2 on 1 rank: the job exits with a config error
FAILING = "ntil:train.global_batch_size=3"


def _harness_command(out):
    """The harness grid: it writes its tiny model and data itself, then trains two jobs at a time."""
    return [
        sys.executable,
        "launch/compare.py",
        "--config",
        "configs/train/tiny_qwen2_arithmetic.yaml",
        "--tiny-model",
        "qwen2",
        "--data",
        "arithmetic:40:easy",
        "--losses",
        f"ce,ntl,{FAILING}",
        "--seeds",
        "0",
        "--nproc",
        "1",
        "--jobs",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "optim.warmup_steps=0",
        "train.log_every=1",
        "eval.generate_every=1",  # scores while training: the curves
        "eval.generate_samples=4",
        "eval.max_new_tokens=4",
    ]


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    """The module's two grids, run side by side (each leaves a core idle part of its time): the harness
    grid to its end, and beside it the resume grid (below) stopped after its first record and started
    again to its end."""
    out = tmp_path_factory.mktemp("compare")
    with open(out / "compare.stdout", "w") as stdout, open(out / "compare.stderr", "w") as stderr:
        command = _harness_command(out)
        harness = subprocess.Popen(command, cwd=REPO_ROOT, env=launch_env(), stdout=stdout, stderr=stderr)
        try:
            resumed = _stopped_and_resumed(tmp_path_factory)
        finally:
            returncode = harness.wait(timeout=1700)
    result = subprocess.CompletedProcess(
        command, returncode, (out / "compare.stdout").read_text(), (out / "compare.stderr").read_text()
    )
    return (out, result), resumed


@pytest.fixture(scope="module")
def comparison(grids):
    return grids[0]


def test_results_json_holds_every_run_and_the_summary(comparison):
    out, result = comparison
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # one run failed
    report = json.loads((out / "results.json").read_text())
    assert report["task"] == "arithmetic" and report["baseline"] == "ce"
    runs = {r["label"]: r for r in report["runs"]}
    assert set(runs) == {"ce", "ntl", FAILING}
    for label in ("ce", "ntl"):
        run = runs[label]
        assert run["status"] == "ok", run
        assert run["metrics"]["n"] == 4 and 0 <= run["metrics"]["parse_rate"] <= 1
        assert run["train_s"] > 0 and (out / "runs" / f"{label}-seed0" / "export" / "config.json").is_file()
        summary = report["summary"][label]["parse_rate"]
        assert summary["n"] == 1 and summary["std"] == 0 and summary["mean"] == run["metrics"]["parse_rate"]
    failed = runs[FAILING]
    assert failed["status"] == "failed" and failed["stage"] == "train" and failed["exit_code"] == 2
    assert "global_batch_size=3" in failed["error"]  # the job's own message, from its log
    assert report["failed"] == [f"{FAILING} seed 0"]
    assert FAILING not in report["summary"] or not report["summary"][FAILING]
    # the ntl run really trained with ntloss: its resolved config says so, and its objective is CE plus
    # a number term (the ce run's objective is its CE exactly)
    assert "name: ntl" in (out / "runs" / "ntl-seed0" / "config.yaml").read_text()
    for label, differs in (("ce", False), ("ntl", True)):
        last = train_metrics(out / "runs" / f"{label}-seed0")[2]
        assert (last["loss"] > last["ce"] * (1 + 1e-6)) is differs, (label, last)
    # paired against ce seed by seed (parse_rate: always a value, abs_error needs a parsed answer); the
    # failed run is unpaired; the controls (a text task: constants, no shuffled check); the test hash
    assert report["paired"]["ntl"]["parse_rate"]["paired_seeds"] == [0]
    assert report["paired"][FAILING]["parse_rate"]["unpaired"] == [{"seed": 0, "other": "failed or no value"}]
    assert set(report["controls"]["constants"]) == {
        "best constant (train median)",
        "most common train answer",
    }
    assert "shuffled" not in report["controls"] and len(report["test_split_sha256"]) == 64
    # each run was scored on its own export
    for label in ("ce", "ntl"):
        scored = json.loads((out / "runs" / f"{label}-seed0" / "eval_test.json").read_text())
        assert scored["model"] == str(out / "runs" / f"{label}-seed0" / "export")


def test_table_and_plot(comparison):
    out, _ = comparison
    table = (out / "table.md").read_text()
    assert "| ce | 1/1 |" in table and "| ntl | 1/1 |" in table and f"| {FAILING} | 0/1 |" in table
    assert "abs_error (lower is better)" in table and "abs_error vs ce" in table
    assert "Failed runs (1):" in table and "global_batch_size=3" in table
    assert (
        "Paired against ce" in table
        and f"unpaired, left out of the paired statistics: {FAILING} vs ce" in table
    )
    assert "| best constant (train median) |" in table
    png = (out / "comparison.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    # the scores each run logged while training, per step and seed, and their plot
    report = json.loads((out / "results.json").read_text())
    for label in ("ce", "ntl"):
        assert sorted(report["curves"][label]["parse_rate"]) == ["1", "2"]  # JSON keys
        assert all(len(values) == 1 for values in report["curves"][label]["parse_rate"].values())
    assert not report["curves"][FAILING]
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_mlflow_parent_with_a_child_per_job(comparison):
    from mlflow import MlflowClient

    out, _ = comparison
    report = json.loads((out / "results.json").read_text())
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    parent = client.get_run(report["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["ntil_ds.comparison"] == "parent"
    assert "ce/parse_rate_mean" in parent.data.metrics and "ntl/abs_error_std" in parent.data.metrics
    assert parent.data.metrics["ntl/paired/parse_rate_n"] == 1
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"results.json", "table.md", "comparison.png", "curves.png"} <= artifacts
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_loss = {c.data.tags["ntil_ds.comparison.loss"]: c for c in children}
    assert set(by_loss) == {"ce", "ntl", FAILING}
    for label in ("ce", "ntl"):
        child = by_loss[label]
        assert child.info.status == "FINISHED"
        assert child.data.params["loss.name"] == label  # the training job's own run, its config as params
        assert "train/loss" in child.data.metrics and "test/parse_rate" in child.data.metrics
    assert by_loss[FAILING].info.status == "FAILED"
    assert by_loss[FAILING].data.tags["ntil_ds.comparison.status"] == "failed"


# ---- resume -------------------------------------------------------------------------------------------


def _resume_command(inputs, out, *extra):
    """The harness grid's ce and ntl jobs on the same model and data (``inputs``), one job at a time, one
    thread."""
    return [
        sys.executable,
        "launch/compare.py",
        "--config",
        "configs/train/tiny_qwen2_arithmetic.yaml",
        "--losses",
        "ce,ntl",
        "--seeds",
        "0",
        "--nproc",
        "1",
        "--jobs",
        "1",
        "--threads",
        "1",
        "--out",
        str(out),
        "--test",
        str(inputs / "data" / "test.jsonl"),
        f"model.name_or_path={inputs / 'model'}",
        "model.init=random",
        f"data.train_file={inputs / 'data' / 'train.jsonl'}",
        f"data.eval_file={inputs / 'data' / 'val.jsonl'}",
        "train.max_steps=2",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "optim.warmup_steps=0",
        "train.log_every=1",
        "eval.generate_every=1",
        "eval.generate_samples=4",
        "eval.max_new_tokens=4",
        *extra,
    ]


def _compare(command, timeout=900):
    """compare.py run to its end, its output captured."""
    return subprocess.run(
        command, cwd=REPO_ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout
    )


def _stopped_and_resumed(tmp_path_factory):
    """The resume grid on its own copy of the harness grid's model and data (the same function writes
    them, with the same seed: the jobs' identities, content digests, must come out the same), stopped
    after its first record, then started again to its end."""
    inputs = tmp_path_factory.mktemp("resume-inputs")
    prepare_inputs(inputs, "qwen2", "arithmetic:40:easy")
    out = tmp_path_factory.mktemp("resume")
    records = out / "records" / "paired"
    first = subprocess.Popen(
        _resume_command(inputs, out), cwd=REPO_ROOT, env=launch_env(), stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 600
    while not (records.is_dir() and any(records.glob("*.json"))) and first.poll() is None:
        assert time.monotonic() < deadline, "no record after 600 s"
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)  # the second job has just started: it needs more than 10 s
    stopped_out, _ = first.communicate(timeout=120)
    kept = {p.name: p.read_bytes() for p in records.glob("*.json")}
    again = _compare(_resume_command(inputs, out))
    return {
        "inputs": inputs,
        "out": out,
        "stopped": first.returncode,
        "stopped_out": stopped_out,
        "kept": kept,
        "again": again,
    }


@pytest.fixture(scope="module")
def resumed(grids):
    return grids[1]


def test_a_stopped_grid_trains_only_the_missing_job_and_equals_the_grid_never_stopped(comparison, resumed):
    grid, _ = comparison
    assert resumed["stopped"] == 143, resumed["stopped_out"][-3000:]
    assert "stopped: every finished job's record is in" in resumed["stopped_out"]
    assert list(resumed["kept"]) == ["ce-seed0.json"], list(resumed["kept"])
    again = resumed["again"]
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # ce came from its record (the file untouched), only ntl was trained
    assert "=== ce seed 0: ok" in again.stdout and "(from its record)" in again.stdout
    assert "=== start ce seed 0" not in again.stdout and "=== start ntl seed 0" in again.stdout
    records = resumed["out"] / "records" / "paired"
    assert (records / "ce-seed0.json").read_bytes() == resumed["kept"]["ce-seed0.json"]
    # the same jobs as the --jobs 2 grid's (same identity), with the same scores per run and per item
    runs = {r["label"]: r for r in json.loads((resumed["out"] / "results.json").read_text())["runs"]}
    harness = {r["label"]: r for r in json.loads((grid / "results.json").read_text())["runs"]}
    for label in ("ce", "ntl"):
        mine = json.loads((records / f"{label}-seed0.json").read_text())
        theirs = json.loads((grid / "records" / "paired" / f"{label}-seed0.json").read_text())
        assert mine["key"] == theirs["key"], (mine["identity"], theirs["identity"])
        assert runs[label]["metrics"] == harness[label]["metrics"], label
        assert mine["samples"] == theirs["samples"] and len(mine["samples"]) == runs[label]["metrics"]["n"]
        assert [c["step"] for c in mine["curve"]] == [1, 2]
        assert len((records / f"{label}-seed0.json").read_bytes()) < 300_000
    report = json.loads((resumed["out"] / "results.json").read_text())
    assert report["complete"] and report["threads"] == 1 and report["jobs"] == 1


def test_a_changed_recipe_on_the_same_records_is_refused_naming_the_field(resumed):
    changed = _compare(_resume_command(resumed["inputs"], resumed["out"], "train.max_steps=3"), timeout=300)
    assert changed.returncode != 0
    assert "holds the records of another grid" in changed.stderr, changed.stderr[-2000:]
    assert "recipe.train.max_steps: was 2, now 3" in changed.stderr
    more_threads = _compare(
        [*_resume_command(resumed["inputs"], resumed["out"]), "--threads", "2"], timeout=300
    )
    assert more_threads.returncode != 0 and "threads: was 1, now 2" in more_threads.stderr


def test_a_trained_but_unscored_job_is_scored_not_trained_again(resumed):
    out = resumed["out"]
    record = out / "records" / "paired" / "ntl-seed0.json"
    scored = json.loads(record.read_text())
    record.unlink()  # as if stopped between its training and its scoring
    log = out / "runs" / "ntl-seed0" / "train.log"
    trained_at = os.stat(log).st_mtime_ns
    again = _compare(_resume_command(resumed["inputs"], out), timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trained earlier" in (out / "runs" / "ntl-seed0" / "worker.log").read_text()
    assert os.stat(log).st_mtime_ns == trained_at  # the training job did not run again
    rescored = json.loads(record.read_text())
    assert rescored["key"] == scored["key"] and rescored["samples"] == scored["samples"]
    assert rescored["result"]["metrics"] == scored["result"]["metrics"]
