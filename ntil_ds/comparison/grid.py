"""The comparison grid: every (loss, seed) a real training job through the ``deepspeed`` launcher, then
its exported model scored on the test split; the outputs rewritten after every run, so a long grid can
be read (and survives being stopped) while it goes on.

Writes under ``plan.out``: ``results.json`` (every run: status, metrics, wall times, the error of a
failed run; mean/std per loss; the scores logged while training, per seed), ``table.md``,
``comparison.png``, ``curves.png`` (each score against the step: a line per loss, the seeds' spread as a
band; when the runs evaluate while training, eval.generate_every > 0), ``runs/<loss>-seed<seed>/`` (each
job's folder and ``train.log``), and one MLflow parent run with a child per training job. A run that
fails is reported in all of them, never dropped.
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
    controls_markdown,
    controls_metrics,
    shuffled_chance,
    write_shuffled_split,
)
from ntil_ds.comparison.lr_select import check_selection, pick_lr, selection_label
from ntil_ds.comparison.paired import EVAL_FILE, paired_markdown, paired_metrics, paired_report
from ntil_ds.comparison.records import (
    check_grid,
    content_digest,
    identity_key,
    read_record,
    record_path,
    record_result,
    resolved_recipe,
)
from ntil_ds.comparison.results import (
    RunResult,
    change_error,
    change_vs,
    score_curves,
    slug,
    summarize,
    table_markdown,
)
from ntil_ds.comparison.splits import refuse_overlap, split_hash
from ntil_ds.comparison.worker import TRAINED_FILE
from ntil_ds.config import ConfigError, load_config, redact_uri, to_dict
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.evaluation.generate import task_of
from ntil_ds.jobs import REPO_ROOT, job_env, log_tail
from ntil_ds.scoring import HIGHER_IS_BETTER, metrics_shown
from ntil_ds.tiny import build_tiny_model_folder
from ntil_ds.tracking import resolve_tracking_uri, take_uri_credentials
from ntil_ds.tracking.mlflow_comparison import ComparisonRuns
from ntil_ds.tracking.plots import plot_comparison, plot_comparison_curves


def prepare_inputs(out: Path, tiny_model: str | None, data: str | None) -> list[str]:
    """A tiny model folder (``KIND[:SIZE]``) and synthetic data (``TASK:N[:DIFFICULTY]``) under ``out``,
    when asked: the overrides pointing the recipe at them."""
    overrides = []
    if tiny_model:
        kind, _, size = tiny_model.partition(":")
        folder = build_tiny_model_folder(kind, out / "model", **({"size": size} if size else {}))
        overrides += [f"model.name_or_path={folder}", "model.init=random"]
    if data:
        task, n, *difficulty = data.split(":")
        splits = write_dataset(
            task, int(n), out / "data", seed=0, difficulty=difficulty[0] if difficulty else "standard"
        )
        overrides += [f"data.train_file={splits['train']}", f"data.eval_file={splits['val']}"]
    return overrides


@dataclass(frozen=True)
class ComparisonPlan:
    """What the grid trains and scores, fixed before the first job starts."""

    recipe: Path
    out: Path
    specs: list[tuple[str, str, list[str]]]  # (label, loss name, overrides): comparison.results
    seeds: list[int]
    nproc: int
    base_overrides: list[str]  # for every run, after the recipe
    test_split: Path
    test_split_sha256: str  # of its bytes and its images' (comparison.splits): what a merge compares
    # data.train_file, or every data.mixture source: the answer-ignoring constants come from them, and a
    # test item in any of them is refused
    train_splits: list[Path]
    shuffled_n: int  # items of the shuffled-input check (image tasks); 0: none
    task: str
    metrics: tuple[str, ...]  # shown; the first is the numeric error the comparison is about
    uri: str  # MLflow
    experiment: str
    name: str
    command: str  # as the user typed it, for results.json
    # The lr chosen per loss on validation first (comparison.lr_select): the grid, the selection seed and
    # the validation split (data.eval_file) with its content hash; empty grid: every loss at the recipe's lr.
    lr_grid: list[float] = field(default_factory=list)
    select_seed: int | None = None
    val_split: Path | None = None
    val_split_sha256: str = ""
    # Where the big things go (each job's folder: export, logs, checkpoints), and the small records a
    # started-again grid and --merge read (comparison.records); default out/runs and out/records.
    runs_dir: Path | None = None
    records: Path | None = None
    jobs: int = 1  # training jobs at once
    threads: int = 1  # per rank, every job the same
    retry_failed: bool = False  # train again the jobs whose record says they failed
    digests: dict[str, str] = field(default_factory=dict)  # data and model paths -> content sha256

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs_dir", self.runs_dir or self.out / "runs")
        object.__setattr__(self, "records", self.records or self.out / "records")

    def grid_identity(self) -> dict:
        """What the whole grid is: a grid started again on the same records must be this one
        (comparison.records.check_grid). Seeds may be added (a grid extended); not so the rest."""
        cfg = load_config(self.recipe, self.base_overrides)
        return {
            "name": self.name,
            "recipe": resolved_recipe(to_dict(cfg), self.digests),
            "task": self.task,
            "losses": [[label, overrides] for label, _, overrides in self.specs],
            "lr_grid": self.lr_grid,
            "select_seed": self.select_seed,
            "test_split_sha256": self.test_split_sha256,
            "val_split_sha256": self.val_split_sha256,
            "train_splits_sha256": [self.digests.get(str(train)) for train in self.train_splits],
            "shuffled_n": self.shuffled_n,
            "nproc": self.nproc,
            "threads": self.threads,
        }

    def job_identity(self, job, cfg_dict: dict) -> dict:
        """What decides one job's result (comparison.records): its resolved recipe, data by content, the
        split it is scored on, processes and threads."""
        select = job.kind == "select"
        return {
            "kind": job.kind,
            "label": job.label,
            "seed": job.seed,
            "lr": job.lr,
            "recipe": resolved_recipe(cfg_dict, self.digests),
            "score_split_sha256": self.val_split_sha256 if select else self.test_split_sha256,
            "shuffled_n": 0 if select else self.shuffled_n,
            "nproc": self.nproc,
            "threads": self.threads,
        }

    @property
    def baseline(self) -> str:
        return next((label for label, loss, _ in self.specs if loss == "ce"), self.specs[0][0])

    def run_name(self, label: str, seed: int) -> str:
        return f"{self.name}/{slug(label)}-seed{seed}"

    def run_dir(self, label: str, seed: int) -> Path:
        return self.runs_dir / f"{slug(label)}-seed{seed}"

    def select_dir(self, name: str) -> Path:
        return self.runs_dir / "select" / f"{slug(name)}-seed{self.select_seed}"


def plan_comparison(
    recipe: Path,
    out: Path,
    specs: list[tuple[str, str, list[str]]],
    seeds: list[int],
    *,
    nproc: int,
    overrides: list[str],
    test_split: Path | None,
    task: str | None,
    command: str,
    shuffled_n: int = 200,
    lr_grid: list[float] | None = None,
    select_seed: int | None = None,
    jobs: int = 1,
    threads: int | None = None,
    runs_dir: Path | None = None,
    records: Path | None = None,
    retry_failed: bool = False,
) -> ComparisonPlan:
    """Check the recipe once (a bad recipe or override fails here, not in every job) and fix the plan.
    ``threads`` per rank: default the machine's cores shared by ``jobs`` jobs of ``nproc`` ranks."""
    cfg = load_config(recipe, overrides)
    if jobs < 1 or (threads is not None and threads < 1):
        raise SystemExit(f"--jobs and --threads must be at least 1; got --jobs {jobs} --threads {threads}")
    threads = threads or max(1, len(os.sched_getaffinity(0)) // (jobs * nproc))
    lr_grid = lr_grid or []
    check_selection(lr_grid, select_seed, seeds)
    trains = [Path(cfg.data.train_file)] if cfg.data.train_file else [Path(s.file) for s in cfg.data.mixture]
    test = Path(test_split or trains[0].with_name("test.jsonl"))
    if not test.exists():
        raise SystemExit(
            f"test split {test} does not exist; give --test PATH (a JSONL, .parquet, shard folder or "
            "save_to_disk folder of the task)"
        )
    task = task or task_of(test)
    present = [train for train in trains if train.exists()]  # a missing one fails in the first job
    if present:
        refuse_overlap(test, present)
    val, val_hash = None, ""
    if lr_grid:  # chosen on validation, never on test: a validation split that is the test split is refused
        val = Path(cfg.data.eval_file) if cfg.data.eval_file else None
        if val is None or not val.exists():
            raise SystemExit(
                f"--lr-grid chooses each loss's lr on the validation split, data.eval_file, which is "
                f"{'not set' if val is None else f'{val}: not found'}; set data.eval_file=VAL.jsonl"
            )
        val_hash = split_hash(val)
        if val_hash == split_hash(test):
            raise SystemExit(
                f"data.eval_file {val} holds the test split's items: the lr would be chosen on test"
            )
    return ComparisonPlan(
        recipe=recipe,
        out=out,
        specs=specs,
        seeds=seeds,
        nproc=nproc,
        # Written to results.json and the parent run's params: without credentials (the jobs get the
        # URI below, clean, and inherit the credentials through the environment).
        base_overrides=[redact_uri(override) for override in overrides],
        test_split=test,
        test_split_sha256=split_hash(test),
        train_splits=trains,
        shuffled_n=shuffled_n,
        task=task,
        metrics=metrics_shown(task),
        # Credentials in the URI go into this process's environment, which every job inherits.
        uri=take_uri_credentials(
            resolve_tracking_uri(cfg.tracking.uri, out, os.environ.get("MLFLOW_TRACKING_URI"))
        ),
        experiment=cfg.tracking.experiment,
        name=f"compare-{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}",
        command=redact_uri(command),
        lr_grid=lr_grid,
        select_seed=select_seed,
        val_split=val,
        val_split_sha256=val_hash,
        runs_dir=runs_dir,
        records=records,
        jobs=jobs,
        threads=threads,
        retry_failed=retry_failed,
        digests=_content_digests(cfg, [*trains, test]),
    )


def _content_digests(cfg, splits: list[Path]) -> dict[str, str]:
    """path -> sha256 of the data and model a job's identity names by content (comparison.records)."""
    paths = [str(split) for split in splits]
    paths += [p for p in (cfg.data.eval_file, cfg.model.name_or_path) if p]
    paths += [source.file for source in cfg.data.mixture]
    return {p: content_digest(Path(p)) for p in dict.fromkeys(paths) if Path(p).exists()}


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
