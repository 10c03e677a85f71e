"""The comparison's plan, fixed before its first job: the recipe checked once, the splits (test, validation,
training) and the base model hashed by content, the losses, seeds, lr grid, processes and threads; and
what makes the grid and each of its jobs what they are (their identities, comparison.records)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ntil_ds.comparison.lr_select import check_selection
from ntil_ds.comparison.records import (
    content_digest,
    resolved_recipe,
)
from ntil_ds.comparison.results import (
    slug,
)
from ntil_ds.comparison.splits import refuse_overlap, split_hash
from ntil_ds.config import load_config, redact_uri, to_dict
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.evaluation.generate import task_of
from ntil_ds.scoring import metrics_shown
from ntil_ds.tiny import build_tiny_model_folder
from ntil_ds.tracking import resolve_tracking_uri, take_uri_credentials


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
