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

import json
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field
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
from ntil_ds.config import ConfigError, load_config, redact_uri
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.evaluation.generate import score_exported_model, task_of, write_report
from ntil_ds.jobs import log_tail, run_training_job
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

    @property
    def baseline(self) -> str:
        return next((label for label, loss, _ in self.specs if loss == "ce"), self.specs[0][0])

    def run_name(self, label: str, seed: int) -> str:
        return f"{self.name}/{slug(label)}-seed{seed}"

    def run_dir(self, label: str, seed: int) -> Path:
        return self.out / "runs" / f"{slug(label)}-seed{seed}"

    def select_dir(self, name: str) -> Path:
        return self.out / "runs" / "select" / f"{slug(name)}-seed{self.select_seed}"


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
) -> ComparisonPlan:
    """Check the recipe once (a bad recipe or override fails here, not in every job) and fix the plan."""
    cfg = load_config(recipe, overrides)
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
    )


@dataclass
class Comparison:
    plan: ComparisonPlan
    runs: list[RunResult] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    controls: dict | None = None
    selection_runs: list[RunResult] = field(default_factory=list)
    lr_selection: dict | None = None  # results.json's record of the choice (select_lrs)

    def prepare_controls(self) -> dict | None:
        """The constants scored on the test split, and the shuffled split with its chance level (written
        once, before the first job: every export is scored on the same one)."""
        plan = self.plan
        try:
            controls = control_scores(plan.task, plan.train_splits, plan.test_split)
        except (ValueError, OSError) as e:  # user data the constants cannot be made from: said, not fatal
            print(f"note: no answer-ignoring controls ({e})", flush=True)
            return None
        shuffled = plan.shuffled_n > 0 and write_shuffled_split(
            plan.test_split, plan.out / SHUFFLED_FILE, plan.shuffled_n
        )
        if shuffled:
            controls["shuffled"] = shuffled | {
                "chance": shuffled_chance(plan.task, plan.test_split, shuffled)
            }
        return controls

    def run(self) -> dict:
        """Every (loss, seed), seed-major (a grid cut short still has every loss for the first seeds);
        returns the final report."""
        plan = self.plan
        mlflow_runs = ComparisonRuns(
            plan.uri,
            plan.experiment,
            plan.name,
            {
                "recipe": str(plan.recipe),
                "losses": ",".join(label for label, _, _ in plan.specs),
                "seeds": ",".join(map(str, plan.seeds)),
                "nproc": str(plan.nproc),
                "overrides": " ".join(plan.base_overrides),
                "test_split": str(plan.test_split),
                "task": plan.task,
            },
        )
        total = len(plan.specs) * len(plan.seeds)
        grid = f"{len(plan.specs)} losses x {len(plan.seeds)} seeds on {plan.task}"
        print(f"comparison {plan.name}: {grid}; MLflow {plan.uri}", flush=True)
        self.controls = self.prepare_controls()
        picked = self.select_lrs(mlflow_runs) if plan.lr_grid else {}
        report = {}
        for seed in plan.seeds:
            for label, loss, loss_overrides in plan.specs:
                run = RunResult(label=label, loss=loss, seed=seed, output_dir=str(plan.run_dir(label, seed)))
                self.runs.append(run)
                print(f"\n=== [{len(self.runs)}/{total}] {label} seed {seed} -> {run.output_dir}", flush=True)
                if plan.lr_grid and picked[label] is None:
                    run.status, run.stage = "failed", "lr_selection"
                    run.error = f"no lr of {plan.lr_grid} gave a validation score on seed {plan.select_seed}"
                else:
                    lr = [f"optim.lr={picked[label]!r}"] if plan.lr_grid else []
                    self.run_one(run, [*loss_overrides, *lr])
                mlflow_runs.adopt(run, plan.run_name(label, seed))
                shown = ", ".join(
                    f"{m} {run.metrics[m]:.4g}" for m in plan.metrics if isinstance(run.metrics.get(m), float)
                )
                took = f"train {run.train_s or 0:.0f} s"
                print(f"=== {label} seed {seed}: {run.status} {run.stage} {shown} ({took})", flush=True)
                report = self.write(mlflow_runs.parent)
        finish_parent_run(mlflow_runs, plan.out, report)
        print(
            f"\n{(plan.out / 'table.md').read_text()}\nresults: {plan.out / 'results.json'}\n"
            f"plot:    {plan.out / 'comparison.png'}\nMLflow:  parent run {mlflow_runs.parent} in {plan.uri}\n"
            f"wall time {report['wall_s']:.0f} s"
        )
        return report

    def select_lrs(self, mlflow_runs) -> dict[str, float | None]:
        """Each loss at every lr of the grid on the selection seed, scored on the validation split; the
        pick per loss (None: no lr gave a score). Recorded in ``self.lr_selection`` for results.json."""
        plan, metric = self.plan, self.plan.metrics[0]
        record = {
            "lr_grid": plan.lr_grid,
            "seed": plan.select_seed,
            "metric": metric,
            "split": str(plan.val_split),
            "split_sha256": plan.val_split_sha256,
            "losses": {},
        }
        picked = {}
        for label, loss, loss_overrides in plan.specs:
            scores = {}
            for lr in plan.lr_grid:
                name = selection_label(label, lr)
                run = RunResult(
                    label=name, loss=loss, seed=plan.select_seed, output_dir=str(plan.select_dir(name))
                )
                self.selection_runs.append(run)
                print(f"\n=== lr selection: {name} seed {plan.select_seed} -> {run.output_dir}", flush=True)
                self.run_one(run, [*loss_overrides, f"optim.lr={lr!r}"], score_split=plan.val_split)
                mlflow_runs.adopt(run, plan.run_name(name, plan.select_seed), split="val")
                scores[lr] = run.metrics.get(metric) if run.status == "ok" else None
            picked[label] = pick_lr(scores, metric)
            record["losses"][label] = {
                "picked": picked[label],
                "validation": [{"lr": lr, metric: scores[lr]} for lr in plan.lr_grid],
                "runs": [asdict(r) for r in self.selection_runs if r.label.startswith(f"{label}@")],
            }
            print(f"=== lr selection: {label} -> lr {picked[label]} (validation {metric})", flush=True)
            self.lr_selection = record
        return picked

    def run_one(self, run: RunResult, loss_overrides: list[str], score_split: Path | None = None) -> None:
        """Train one job and score its export on the test split (``score_split``: the validation split of
        an lr selection run, without the shuffled check); a failure is recorded in ``run``."""
        plan = self.plan
        run_dir = Path(run.output_dir)
        overrides = [
            *plan.base_overrides,
            *loss_overrides,
            f"train.seed={run.seed}",
            f"output_dir={run_dir}",
            "resume=none",
            "tracking.enabled=true",
            f"tracking.uri={plan.uri}",
            f"tracking.run_name={plan.run_name(run.label, run.seed)}",
            "train.export_at_end=true",
        ]
        try:
            load_config(
                plan.recipe, overrides
            )  # a loss spec's bad override: this run fails, the others go on
        except ConfigError as e:
            run.status, run.stage, run.error = "failed", "config", str(e)
            return
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run (never resume an earlier comparison's job)
        run_dir.mkdir(parents=True)
        started = time.perf_counter()
        log = run_dir / "train.log"
        run.exit_code = run_training_job(plan.recipe, overrides, nproc=plan.nproc, log_path=log).returncode
        run.train_s = time.perf_counter() - started
        if run.exit_code != 0:
            run.status, run.stage = "failed", "train"
            run.error = f"exit code {run.exit_code}; last lines of {log}:\n{log_tail(log)}"
            return
        started = time.perf_counter()
        try:
            split = score_split or plan.test_split
            report = score_exported_model(run_dir / "export", split, plan.task, batch_size=32)
            write_report(report, run_dir / ("eval_val.json" if score_split else EVAL_FILE))
        except Exception as e:  # one bad run must not end the comparison
            run.status, run.stage = "failed", "evaluate"
            run.error = "".join(traceback.format_exception_only(type(e), e)).strip()
            return
        run.metrics = report["metrics"]
        run.status = "ok"
        shuffled = None if score_split else (self.controls or {}).get("shuffled")
        if shuffled:  # the same export on the shuffled split: does it read its images?
            try:
                report = score_exported_model(
                    run_dir / "export", Path(shuffled["path"]), plan.task, batch_size=32
                )
                write_report(report, run_dir / "eval_shuffled.json")  # NaN scores become None there
                run.shuffled = report["metrics"]
            except Exception as e:  # the check is a control: its failure is recorded, the run stands
                run.shuffled = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()}
        run.eval_s = time.perf_counter() - started

    def write(self, parent_run_id: str) -> dict:
        """results.json, table.md and the plots from the runs so far; returns the report."""
        plan = self.plan
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
            "overrides": plan.base_overrides,
            "lr_selection": self.lr_selection,  # None: every loss at the recipe's lr
            "complete": len(self.runs) == len(plan.specs) * len(plan.seeds),
            "mlflow": {"uri": plan.uri, "experiment": plan.experiment, "parent_run_id": parent_run_id},
            "wall_s": time.perf_counter() - self.started,
        }
        title = f"{plan.recipe.stem}: {plan.task}, seeds {','.join(map(str, plan.seeds))}"
        return write_outputs(plan.out, self.runs, plan.metrics, plan.baseline, header, title)


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
        "runs": [asdict(r) for r in runs],
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
