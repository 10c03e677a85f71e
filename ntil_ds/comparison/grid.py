"""The comparison grid: every (loss, seed) a real training job through the ``deepspeed`` launcher, then
its exported model scored on the test split; the outputs rewritten after every run, so a long grid can
be read (and survives being stopped) while it goes on.

Writes under ``plan.out``: ``results.json`` (every run: status, metrics, wall times, the error of a
failed run; mean/std per loss; the scores logged while training, per seed), ``table.md``,
``comparison.png``, ``curves.png`` (each score against the step: a line per loss, the seeds' spread as a
band; when the runs evaluate while training, eval.generate_every > 0), ``runs/<loss>-seed<seed>/`` (each
job's folder and ``train.log``), and one MLflow parent run with a child per training job. A run that
fails is reported in all of them, never dropped.

Each job runs in a worker process of its own (comparison.worker), up to ``plan.jobs`` at once, and leaves
a record (comparison.records); a grid started again on the same records runs only the jobs without one.
The plan is fixed first (comparison.plan); the outputs are written by comparison.outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ntil_ds.comparison.controls import (
    SHUFFLED_FILE,
    control_scores,
    shuffled_chance,
    write_shuffled_split,
)
from ntil_ds.comparison.lr_select import pick_lr, selection_label
from ntil_ds.comparison.outputs import finish_parent_run, write_outputs
from ntil_ds.comparison.paired import EVAL_FILE
from ntil_ds.comparison.plan import ComparisonPlan
from ntil_ds.comparison.records import (
    check_grid,
    identity_key,
    read_record,
    record_path,
    record_result,
)
from ntil_ds.comparison.results import (
    RunResult,
)
from ntil_ds.comparison.worker import TRAINED_FILE
from ntil_ds.config import ConfigError, load_config, to_dict
from ntil_ds.jobs import REPO_ROOT, job_env, log_tail
from ntil_ds.tracking.mlflow_comparison import ComparisonRuns


@dataclass
class GridJob:
    """One training job of the grid and where its record goes; ``lr`` None: the recipe's, or the pick."""

    kind: str  # "paired" (scored on test) or "select" (an lr selection run, scored on validation)
    label: str  # the loss spec, as given
    loss: str
    loss_overrides: list[str]
    seed: int
    lr: float | None = None

    @property
    def name(self) -> str:  # the run's label in the outputs: "ntil" or "ntil@lr=0.0003"
        return selection_label(self.label, self.lr) if self.kind == "select" else self.label


class GridStopped(Exception):
    """SIGTERM or SIGINT reached compare.py: the jobs in flight are stopped, every finished record stays."""


@dataclass
class Comparison:
    plan: ComparisonPlan
    runs: list[RunResult] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    controls: dict | None = None
    selection_runs: list[RunResult] = field(default_factory=list)
    lr_selection: dict | None = None  # results.json's record of the choice
    picked: dict[str, float | None] = field(default_factory=dict)  # the lr chosen per loss
    resumed: int = 0  # jobs whose record an earlier invocation left

    def prepare_controls(self) -> dict | None:
        """The constants scored on the test split, and the shuffled split with its chance level (written
        once, before the first job: every export is scored on the same one)."""
        plan = self.plan
        try:
            controls = control_scores(plan.task, plan.train_splits, plan.test_split)
        except (ValueError, OSError) as e:  # user data the constants cannot be made from: said, not fatal
            print(f"note: no answer-ignoring controls ({e})", flush=True)
            return None
        plan.runs_dir.mkdir(parents=True, exist_ok=True)
        shuffled = plan.shuffled_n > 0 and write_shuffled_split(
            plan.test_split, plan.runs_dir / SHUFFLED_FILE, plan.shuffled_n
        )
        if shuffled:
            controls["shuffled"] = shuffled | {
                "chance": shuffled_chance(plan.task, plan.test_split, shuffled)
            }
        return controls

    def jobs(self) -> list[GridJob]:
        """Every job in the order they start: the lr selection runs, then the paired runs seed-major (a
        grid cut short still has every loss for the first seeds)."""
        plan = self.plan
        select = [
            GridJob("select", label, loss, overrides, plan.select_seed, lr)
            for label, loss, overrides in plan.specs
            for lr in plan.lr_grid
        ]
        paired = [
            GridJob("paired", label, loss, overrides, seed)
            for seed in plan.seeds
            for label, loss, overrides in plan.specs
        ]
        return [*select, *paired]

    def run(self) -> dict:
        """Every job not finished by an earlier invocation on the same records, up to ``plan.jobs`` at
        once; the outputs rewritten after each. Returns the final report."""
        plan = self.plan
        earlier = check_grid(plan.records, plan.grid_identity())
        self.plan = plan = replace(plan, name=earlier["name"])
        mlflow_runs = ComparisonRuns(
            plan.uri,
            plan.experiment,
            plan.name,
            {
                "recipe": str(plan.recipe),
                "losses": ",".join(label for label, _, _ in plan.specs),
                "seeds": ",".join(map(str, plan.seeds)),
                "nproc": str(plan.nproc),
                "threads": str(plan.threads),
                "overrides": " ".join(plan.base_overrides),
                "test_split": str(plan.test_split),
                "task": plan.task,
            },
            parent_run_id=_earlier_parent(plan),
        )
        plan.runs_dir.mkdir(parents=True, exist_ok=True)
        (plan.runs_dir / PARENT_FILE).write_text(json.dumps({"uri": plan.uri, "run_id": mlflow_runs.parent}))
        pending = self.jobs()
        print(
            f"comparison {plan.name}: {len(plan.specs)} losses x {len(plan.seeds)} seeds on {plan.task}"
            f"{f', {len(plan.specs) * len(plan.lr_grid)} lr selection runs' if plan.lr_grid else ''}; "
            f"{plan.jobs} job(s) at once, {plan.threads} thread(s) a rank; records {plan.records}; "
            f"MLflow {plan.uri}",
            flush=True,
        )
        self.controls = self.prepare_controls()
        running: dict[subprocess.Popen, tuple[GridJob, Path]] = {}
        stop: list[str] = []  # the signal that asked to stop; acted on between two polls, not mid-write

        def request_stop(signum, frame) -> None:
            stop.append(signal.Signals(signum).name)

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while pending or running:
                if stop:
                    raise GridStopped(stop[0])
                for job in [j for j in pending if self.ready(j)]:
                    if len(running) >= plan.jobs:
                        break
                    pending.remove(job)
                    started = self.start(job, mlflow_runs)
                    if started:
                        running[started[0]] = (job, started[1])
                done = [process for process in running if process.poll() is not None]
                for process in done:
                    job, record_file = running.pop(process)
                    self.finish(job, self.collect(job, record_file, process.returncode), mlflow_runs)
                if not done:
                    time.sleep(0.5)
        except GridStopped:
            _stop_jobs(running)
            mlflow_runs.client.set_terminated(mlflow_runs.parent, "KILLED")
            print(f"\nstopped: every finished job's record is in {plan.records}; start the same command "
                  "again to run the rest", flush=True)  # fmt: skip
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        report = self.write(mlflow_runs.parent)
        finish_parent_run(mlflow_runs, plan.out, report)
        print(
            f"\n{(plan.out / 'table.md').read_text()}\nresults: {plan.out / 'results.json'}\n"
            f"plot:    {plan.out / 'comparison.png'}\nMLflow:  parent run {mlflow_runs.parent} in {plan.uri}\n"
            f"wall time {report['wall_s']:.0f} s ({self.resumed} job(s) from earlier records)"
        )
        return report

    def ready(self, job: GridJob) -> bool:
        """A paired run starts once its loss's lr is chosen (all its selection runs finished)."""
        return job.kind == "select" or not self.plan.lr_grid or job.label in self.picked

    def overrides(self, job: GridJob) -> list[str]:
        """The job's recipe overrides, less where it writes and tracks (what its identity sees)."""
        lr = job.lr if job.kind == "select" else self.picked.get(job.label)
        return [
            *self.plan.base_overrides,
            *job.loss_overrides,
            *([f"optim.lr={lr!r}"] if lr is not None else []),
            f"train.seed={job.seed}",
            "train.export_at_end=true",
        ]

    def run_dir(self, job: GridJob) -> Path:
        plan = self.plan
        return plan.select_dir(job.name) if job.kind == "select" else plan.run_dir(job.label, job.seed)

    def start(self, job: GridJob, mlflow_runs) -> tuple[subprocess.Popen, Path] | None:
        """The job's worker process, or None when there is nothing to run: its record is there from an
        earlier invocation, or its recipe is refused, or no lr of its loss gave a validation score."""
        plan = self.plan
        run_dir = self.run_dir(job)
        run = RunResult(label=job.name, loss=job.loss, seed=job.seed, output_dir=str(run_dir))
        if job.kind == "paired" and plan.lr_grid and self.picked[job.label] is None:
            run.status, run.stage = "failed", "lr_selection"
            run.error = f"no lr of {plan.lr_grid} gave a validation score on seed {plan.select_seed}"
            self.finish(job, run, mlflow_runs)
            return None
        overrides = self.overrides(job)
        try:  # a loss spec's bad override: this run fails, the others go on
            cfg = load_config(plan.recipe, overrides)
        except ConfigError as e:
            run.status, run.stage, run.error = "failed", "config", str(e)
            self.finish(job, run, mlflow_runs)
            return None
        identity = plan.job_identity(job, to_dict(cfg))
        key = identity_key(identity)
        record_file = record_path(plan.records, job.kind, job.name, job.seed)
        record = read_record(record_file, key)
        if record and not (plan.retry_failed and record["result"]["status"] != "ok"):
            self.resumed += 1
            self.finish(job, record_result(record, record_file), mlflow_runs, earlier=True)
            return None
        trained = run_dir / TRAINED_FILE
        trained_earlier = trained.is_file() and json.loads(trained.read_text()).get("key") == key
        if run_dir.exists() and not trained_earlier:
            shutil.rmtree(run_dir)  # a job stopped in flight trains again from zero
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "key": key,
            "identity": identity,
            "kind": job.kind,
            "label": job.name,
            "loss": job.loss,
            "seed": job.seed,
            "recipe": str(plan.recipe),
            "overrides": [
                *overrides,
                f"output_dir={run_dir}",
                "resume=none",
                "tracking.enabled=true",
                f"tracking.uri={plan.uri}",
                f"tracking.run_name={plan.run_name(job.name, job.seed)}",
            ],
            "nproc": plan.nproc,
            "threads": plan.threads,
            "run_dir": str(run_dir),
            "task": plan.task,
            "score_split": str(plan.val_split if job.kind == "select" else plan.test_split),
            "eval_file": "eval_val.json" if job.kind == "select" else EVAL_FILE,
            "shuffled": job.kind == "paired" and (self.controls or {}).get("shuffled", {}).get("path"),
            "record": str(record_file),
        }
        (run_dir / "job.json").write_text(json.dumps(spec, indent=1))
        print(f"\n=== start {job.name} seed {job.seed} -> {run_dir}", flush=True)
        return self.launch(run_dir), record_file

    def launch(self, run_dir: Path) -> subprocess.Popen:
        """The worker (comparison.worker) in a session of its own, so a stop reaches its launcher and ranks."""
        with (run_dir / "worker.log").open("w") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "ntil_ds.comparison.worker", str(run_dir / "job.json")],
                cwd=REPO_ROOT,
                env=job_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def collect(self, job: GridJob, record_file: Path, returncode: int) -> RunResult:
        """The finished worker's result: its record, or a failed run when it left none (a crash)."""
        key = json.loads((self.run_dir(job) / "job.json").read_text())["key"]
        record = read_record(record_file, key) if returncode == 0 else None
        if record:
            return record_result(record, record_file)
        log = self.run_dir(job) / "worker.log"
        return RunResult(
            label=job.name,
            loss=job.loss,
            seed=job.seed,
            output_dir=str(self.run_dir(job)),
            status="failed",
            stage="worker",
            error=f"the job's worker exited {returncode} without a record; last lines of {log}:\n{log_tail(log)}",
        )

    def finish(self, job: GridJob, run: RunResult, mlflow_runs, earlier: bool = False) -> None:
        """A finished job: into the runs, MLflow and the outputs; the lr pick once a loss's selection runs
        are all in."""
        plan = self.plan
        mlflow_runs.adopt(
            run, plan.run_name(job.name, job.seed), split="val" if job.kind == "select" else "test"
        )
        shown = ", ".join(
            f"{m} {run.metrics[m]:.4g}" for m in plan.metrics if isinstance(run.metrics.get(m), float)
        )
        how = "from its record" if earlier else f"train {run.train_s or 0:.0f} s"
        print(f"=== {job.name} seed {job.seed}: {run.status} {run.stage} {shown} ({how})", flush=True)
        if job.kind == "select":
            self.selection_runs.append(run)
            mine = [r for r in self.selection_runs if r.label.startswith(f"{job.label}@")]
            if len(mine) == len(plan.lr_grid):
                self.pick(job.label, mine)
        else:
            self.runs.append(run)
        self.write(mlflow_runs.parent)

    def pick(self, label: str, runs: list[RunResult]) -> None:
        """The loss's lr, from its selection runs' validation scores (comparison.lr_select)."""
        plan, metric = self.plan, self.plan.metrics[0]
        by_lr = {r.label: r for r in runs}
        scores = {}
        for lr in plan.lr_grid:
            run = by_lr[selection_label(label, lr)]
            scores[lr] = run.metrics.get(metric) if run.status == "ok" else None
        self.picked[label] = pick_lr(scores, metric)
        self.lr_selection = self.lr_selection or {
            "lr_grid": plan.lr_grid,
            "seed": plan.select_seed,
            "metric": metric,
            "split": str(plan.val_split),
            "split_sha256": plan.val_split_sha256,
            "losses": {},
        }
        self.lr_selection["losses"][label] = {
            "picked": self.picked[label],
            "validation": [{"lr": lr, metric: scores[lr]} for lr in plan.lr_grid],
            "runs": [asdict(by_lr[selection_label(label, lr)]) for lr in plan.lr_grid],
        }
        print(f"=== lr selection: {label} -> lr {self.picked[label]} (validation {metric})", flush=True)

    def write(self, parent_run_id: str) -> dict:
        """results.json, table.md and the plots from the runs so far (in the plan's order); returns the
        report."""
        plan = self.plan
        order = {(label, seed): i for i, (seed, (label, _, _)) in enumerate(
            (seed, spec) for seed in plan.seeds for spec in plan.specs)}  # fmt: skip
        runs = sorted(self.runs, key=lambda r: order.get((r.label, r.seed), len(order)))
        if self.lr_selection:  # in the plan's order of losses
            losses = self.lr_selection["losses"]
            self.lr_selection["losses"] = {
                label: losses[label] for label, _, _ in plan.specs if label in losses
            }
        header = {
            "name": plan.name,
            "recipe": str(plan.recipe),
            "command": plan.command,
            "task": plan.task,
            "test_split": str(plan.test_split),
            "test_split_sha256": plan.test_split_sha256,
            "train_splits": [str(train) for train in plan.train_splits],
            "controls": self.controls,
            "losses": [label for label, _, _ in plan.specs],
            "seeds": plan.seeds,
            "nproc": plan.nproc,
            "threads": plan.threads,  # per rank; every job of the grid the same (float sums depend on it)
            "jobs": plan.jobs,
            "records": str(plan.records),
            "overrides": plan.base_overrides,
            "lr_selection": self.lr_selection,  # None: every loss at the recipe's lr
            "complete": len(runs) == len(plan.specs) * len(plan.seeds),
            "mlflow": {"uri": plan.uri, "experiment": plan.experiment, "parent_run_id": parent_run_id},
            "wall_s": time.perf_counter() - self.started,
        }
        title = f"{plan.recipe.stem}: {plan.task}, seeds {','.join(map(str, plan.seeds))}"
        return write_outputs(plan.out, runs, plan.metrics, plan.baseline, header, title)


# In the runs folder (the machine's, like the store): the grid's MLflow parent run, reused when the grid is
# started again against the same store.
PARENT_FILE = "mlflow_parent.json"


def _earlier_parent(plan: ComparisonPlan) -> str | None:
    path = plan.runs_dir / PARENT_FILE
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    return earlier["run_id"] if earlier.get("uri") == plan.uri else None


def _stop_jobs(running: dict) -> None:
    """SIGTERM to each worker's session (its launcher and ranks), SIGKILL to what is left after 30 s."""
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for process in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):  # a rank the launcher left behind
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
