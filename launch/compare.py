"""Does NTIL help on this task? Train one recipe under several losses and seeds, score every run on the
test split, and compare.

    python launch/compare.py --config configs/train/tiny_qwen2_arithmetic.yaml \\
        --losses ce,emd,ntil,ntl --seeds 0,1,2 [--out outputs/compare/arith] [key=value ...]

Each (loss, seed) is a real training job through the `deepspeed` launcher (`--nproc` CPU processes, as
launch/quickstart.py runs it) with `loss.name` and `train.seed` set, then its exported model is scored
with launch/evaluate.py on the test split (greedy answers, the task's metrics). A loss may carry its own
overrides: `ntil:loss.ntil_lambda=0.6` is a fourth entry next to `ntil`.

Writes under `--out`: `results.json` (every run: status, metrics, wall times, error if it failed;
and mean/std per loss), `table.md` (each metric as mean +- std over seeds, per loss), `comparison.png`
(the same with error bars), `runs/<loss>-seed<seed>/` (each job's folder and log), and one MLflow parent
run (the comparison) with a child run per training job (`--out`/mlflow.db unless tracking.uri or
MLFLOW_TRACKING_URI says otherwise). A run that fails is reported in all of them, never dropped; the
exit code is 1 when any run failed.

`--tiny-model KIND[:SIZE]` and `--data TASK:N[:DIFFICULTY]` first write a tiny model folder and a
synthetic dataset under `--out` and point the recipe at them (what the small recipes need on a fresh
clone). The default test split is `test.jsonl` next to `data.train_file`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

from ntil_ds.config import ConfigError, load_config, redact_uri  # noqa: E402
from ntil_ds.tracking import resolve_tracking_uri, take_uri_credentials  # noqa: E402

# Metrics shown per task, the first one the numeric error the comparison is about (lower is better
# unless listed in HIGHER_IS_BETTER).
TASK_METRICS = {
    "clock": ("clock_dev_minutes", "clock_acc", "parse_rate"),
    "boxes": ("coord_mae", "acc@0.5", "iou", "parse_rate"),
    "chart": ("abs_error", "rel_error", "exact_match", "parse_rate"),
    "arithmetic": ("abs_error", "rel_error", "exact_match", "parse_rate"),
}
HIGHER_IS_BETTER = {"clock_acc", "acc@0.5", "iou", "exact_match", "parse_rate", "digit_acc"}
EXTRA_COLUMNS = ("train_s",)  # per-run wall time of the training job (launcher start to exit)


@dataclass
class RunResult:
    label: str  # the loss spec as given: "ntil" or "ntil:loss.ntil_lambda=0.6"
    loss: str
    seed: int
    output_dir: str
    status: str = "pending"  # ok | failed
    stage: str = ""  # where a failed run failed: config, train, evaluate
    error: str = ""
    exit_code: int | None = None
    train_s: float | None = None
    eval_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None


# ----------------------------------------------------------------------------------------------------
# arguments


def parse_loss_specs(text: str) -> list[tuple[str, str, list[str]]]:
    """Each loss spec as (label, loss name, its overrides): "ce,ntil:loss.ntil_lambda=0.6" ->
    [("ce", "ce", ["loss.name=ce"]), ("ntil:...", "ntil", ["loss.name=ntil", "loss.ntil_lambda=0.6"])]."""
    specs = []
    for label in (part.strip() for part in text.split(",")):
        if not label:
            continue
        name, *extra = label.split(":")
        specs.append((label, name, [f"loss.name={name}", *extra]))
    labels = [label for label, _, _ in specs]
    if not specs or len(set(labels)) != len(labels):
        raise SystemExit(f"--losses must name distinct losses, e.g. ce,emd,ntil,ntl; got {text!r}")
    return specs


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds must be integers separated by commas, e.g. 0,1,2; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must be distinct integers, e.g. 0,1,2; got {text!r}")
    return seeds


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


# ----------------------------------------------------------------------------------------------------
# jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    """CPU DeepSpeed, one thread per rank, a kept cache for JIT-compiled ops, nothing downloaded."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def train(recipe: Path, overrides: list[str], nproc: int, log_path: Path) -> int:
    """One training job through the real `deepspeed` launcher; its output goes to `log_path`."""
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    command = [
        deepspeed,
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        "launch/train.py",
        "--config",
        str(recipe),
        *overrides,
    ]
    with log_path.open("w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        return subprocess.run(
            command, cwd=REPO_ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT
        ).returncode


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    # tqdm redraws with carriage returns: keep the last state of each line
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text[-lines:])


def _evaluate_module():
    spec = importlib.util.spec_from_file_location("ntil_ds_evaluate", REPO_ROOT / "launch" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------
# aggregation and output


def summarize(runs: list[RunResult], metrics: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    """{label: {metric: {"mean", "std", "n"}}} over the runs that finished; std is the sample standard
    deviation over seeds (0 with one run)."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for label in dict.fromkeys(r.label for r in runs):
        ok = [r for r in runs if r.label == label and r.status == "ok"]
        summary[label] = {}
        for name in (*metrics, *EXTRA_COLUMNS):
            values = [v for r in ok if isinstance(v := _value(r, name), (int, float)) and math.isfinite(v)]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                summary[label][name] = {"mean": statistics.fmean(values), "std": std, "n": len(values)}
    return summary


def _value(run: RunResult, name: str):
    return getattr(run, name) if name in EXTRA_COLUMNS else run.metrics.get(name)


def change_vs(summary: dict, label: str, baseline: str, metric: str) -> float | None:
    """Relative change of `metric`'s mean against the baseline's (-0.25: 25 % lower)."""
    base, this = summary.get(baseline, {}).get(metric), summary.get(label, {}).get(metric)
    if not base or not this or base["mean"] == 0:
        return None
    return this["mean"] / base["mean"] - 1


def table_markdown(runs: list[RunResult], summary: dict, metrics: tuple[str, ...], baseline: str) -> str:
    primary = metrics[0]
    columns = [*metrics, *EXTRA_COLUMNS]
    header = [
        "loss",
        "runs ok",
        *(
            f"{m} ({'higher' if m in HIGHER_IS_BETTER else 'lower'} is better)" if m in metrics else m
            for m in columns
        ),
        f"{primary} vs {baseline}",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, stats in summary.items():
        total = sum(r.label == label for r in runs)
        ok = sum(r.label == label and r.status == "ok" for r in runs)
        cells = [label, f"{ok}/{total}"]
        for m in columns:
            s = stats.get(m)
            cells.append("n/a" if s is None else f"{s['mean']:.4g} ± {s['std']:.2g}")
        change = change_vs(summary, label, baseline, primary)
        cells.append("" if label == baseline else "n/a" if change is None else f"{change:+.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in runs if r.status != "ok"]
    if failed:
        lines += ["", f"Failed runs ({len(failed)}):"]
        lines += [
            f"- {r.label} seed {r.seed}: {r.stage} failed: {r.error.splitlines()[-1] if r.error else '?'}"
            f" (see {r.output_dir})"
            for r in failed
        ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, metrics: tuple[str, ...], path: Path, title: str) -> Path:
    """One panel per metric: the mean per loss as a bar, the std over seeds as an error bar."""
    from matplotlib.figure import Figure

    labels = list(summary)
    fig = Figure(figsize=(3.2 * len(metrics) + 1, 3.6), layout="constrained")
    for ax, metric in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics, strict=True):
        means = [summary[label].get(metric, {}).get("mean", math.nan) for label in labels]
        stds = [summary[label].get(metric, {}).get("std", 0.0) for label in labels]
        ax.bar(range(len(labels)), means, yerr=stds, capsize=4, color=[f"C{i}" for i in range(len(labels))])
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.set_title(
            f"{metric} ({'higher' if metric in HIGHER_IS_BETTER else 'lower'} is better)", fontsize=9
        )
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------------------------------
# MLflow: one parent run for the comparison, the training jobs' runs as its children


class ComparisonRuns:
    def __init__(self, uri: str, experiment: str, name: str, params: dict[str, str]) -> None:
        from mlflow import MlflowClient

        from ntil_ds.tracking.mlflow_client import experiment_id, local_artifact_location

        self.client = MlflowClient(uri)
        # As the jobs' trackers do: tagged as model training, artifacts of a sqlite store next to it.
        self.experiment_id = experiment_id(self.client, experiment, local_artifact_location(uri))
        self.parent = self.client.create_run(
            self.experiment_id, run_name=name, tags={"ntil_ds.comparison": "parent"}
        ).info.run_id
        for key, value in params.items():
            self.client.log_param(self.parent, key, value[:6000])

    def adopt(self, run: RunResult, run_name: str) -> None:
        """Make the training job's run a child of the comparison (or record one for a job that never
        created its run), and log its test metrics into it."""
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"attributes.run_name = '{run_name}'", max_results=1
        )
        if found:
            run.mlflow_run_id = found[0].info.run_id
        else:  # failed before its tracker started (a bad config, a crash at start): still a child
            run.mlflow_run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
            self.client.set_terminated(run.mlflow_run_id, "FAILED")
        child = run.mlflow_run_id
        self.client.set_tag(child, "mlflow.parentRunId", self.parent)
        self.client.set_tag(child, "ntil_ds.comparison.loss", run.label)
        self.client.set_tag(child, "ntil_ds.comparison.seed", str(run.seed))
        self.client.set_tag(child, "ntil_ds.comparison.status", run.status)
        if run.error:
            self.client.set_tag(child, "ntil_ds.comparison.error", run.error[-4000:])
        for name, value in run.metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.client.log_metric(child, metric_key(f"test/{name}"), float(value))

    def finish(self, summary: dict, artifacts: list[Path], any_failed: bool) -> None:
        for label, stats in summary.items():
            for name, s in stats.items():
                for what in ("mean", "std"):
                    self.client.log_metric(self.parent, metric_key(f"{slug(label)}/{name}_{what}"), s[what])
        for path in artifacts:
            self.client.log_artifact(self.parent, str(path))
        self.client.set_tag(self.parent, "ntil_ds.comparison.failed_runs", str(any_failed))
        self.client.set_terminated(self.parent, "FINISHED")


def metric_key(name: str) -> str:
    """MLflow keys allow letters, digits, _ - . / and spaces: "acc@0.5" -> "acc_at_0.5"."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name.replace("@", "_at_"))


# ----------------------------------------------------------------------------------------------------
# the comparison


def prepare_inputs(args, out: Path) -> list[str]:
    """Tiny model folder and synthetic data under `out`, when asked: the overrides pointing at them."""
    overrides = []
    if args.tiny_model:
        from ntil_ds.model.tiny import build_tiny_model_folder

        kind, _, size = args.tiny_model.partition(":")
        folder = build_tiny_model_folder(kind, out / "model", **({"size": size} if size else {}))
        overrides += [f"model.name_or_path={folder}", "model.init=random"]
    if args.data:
        from ntil_ds.data.synthetic import write_dataset

        task, n, *difficulty = args.data.split(":")
        splits = write_dataset(
            task, int(n), out / "data", seed=0, difficulty=difficulty[0] if difficulty else "standard"
        )
        overrides += [f"data.train_file={splits['train']}", f"data.eval_file={splits['val']}"]
    return overrides


def run_comparison(args) -> dict:
    started = time.perf_counter()
    recipe = Path(args.config).resolve()
    out = Path(args.out).resolve()
    specs = parse_loss_specs(args.losses)
    seeds = parse_seeds(args.seeds)
    out.mkdir(parents=True, exist_ok=True)
    base_overrides = [*prepare_inputs(args, out), *args.overrides]
    cfg = load_config(recipe, base_overrides)  # a bad recipe or override fails here, once
    test_split = Path(args.test or Path(cfg.data.train_file).with_name("test.jsonl"))
    if not test_split.is_file():
        raise SystemExit(f"test split {test_split} does not exist; give --test FILE (a JSONL of the task)")
    evaluate = _evaluate_module()
    task = args.task or evaluate.task_of(test_split)
    metrics = TASK_METRICS.get(task, TASK_METRICS["arithmetic"])
    # Credentials in the URI go into this process's environment, which the jobs inherit; the URI
    # without them is what the jobs are given and what is printed and written.
    uri = take_uri_credentials(
        resolve_tracking_uri(cfg.tracking.uri, out, os.environ.get("MLFLOW_TRACKING_URI"))
    )
    base_overrides = [redact_uri(override) for override in base_overrides]
    name = f"compare-{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    mlflow_runs = ComparisonRuns(
        uri,
        cfg.tracking.experiment,
        name,
        {
            "recipe": str(recipe),
            "losses": args.losses,
            "seeds": args.seeds,
            "nproc": str(args.nproc),
            "overrides": " ".join(base_overrides),
            "test_split": str(test_split),
            "task": task,
        },
    )
    print(f"comparison {name}: {len(specs)} losses x {len(seeds)} seeds on {task}; MLflow {uri}", flush=True)

    runs: list[RunResult] = []
    for seed in seeds:  # seed-major: a grid cut short still has every loss for the first seeds
        for label, loss, loss_overrides in specs:
            run_dir = out / "runs" / f"{slug(label)}-seed{seed}"
            run = RunResult(label=label, loss=loss, seed=seed, output_dir=str(run_dir))
            runs.append(run)
            run_name = f"{name}/{slug(label)}-seed{seed}"
            overrides = [
                *base_overrides,
                *loss_overrides,
                f"train.seed={seed}",
                f"output_dir={run_dir}",
                "resume=none",
                "tracking.enabled=true",
                f"tracking.uri={uri}",
                f"tracking.run_name={run_name}",
                "train.export_at_end=true",
            ]
            print(
                f"\n=== [{len(runs)}/{len(specs) * len(seeds)}] {label} seed {seed} -> {run_dir}", flush=True
            )
            _train_and_score(run, recipe, overrides, run_dir, test_split, task, evaluate, args)
            mlflow_runs.adopt(run, run_name)
            shown = ", ".join(
                f"{m} {run.metrics[m]:.4g}" for m in metrics if isinstance(run.metrics.get(m), float)
            )
            print(
                f"=== {label} seed {seed}: {run.status} {run.stage} {shown} (train {run.train_s or 0:.0f} s)",
                flush=True,
            )
            # after every run: a long grid can be read (and survives being stopped) while it goes on
            report, table = write_outputs(
                args,
                recipe,
                out,
                specs,
                seeds,
                task,
                test_split,
                metrics,
                runs,
                base_overrides,
                mlflow_runs,
                uri,
                cfg,
                name,
                started,
            )

    mlflow_runs.finish(
        report["summary"],
        [out / "results.json", out / "table.md", out / "comparison.png"],
        any_failed=bool(report["failed"]),
    )
    print(
        f"\n{table}\nresults: {out / 'results.json'}\nplot:    {out / 'comparison.png'}\n"
        f"MLflow:  parent run {mlflow_runs.parent} in {uri}\nwall time {report['wall_s']:.0f} s"
    )
    return report


def write_outputs(
    args,
    recipe,
    out,
    specs,
    seeds,
    task,
    test_split,
    metrics,
    runs,
    base_overrides,
    mlflow_runs,
    uri,
    cfg,
    name,
    started,
) -> tuple[dict, str]:
    """results.json, table.md and comparison.png from the runs so far."""
    summary = summarize(runs, metrics)
    baseline = next((label for label, loss, _ in specs if loss == "ce"), specs[0][0])
    table = table_markdown(runs, summary, metrics, baseline)
    report = {
        "name": name,
        "recipe": str(recipe),
        "command": redact_uri(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]])),
        "task": task,
        "test_split": str(test_split),
        "losses": [label for label, _, _ in specs],
        "seeds": seeds,
        "nproc": args.nproc,
        "overrides": base_overrides,
        "metrics": list(metrics),
        "baseline": baseline,
        "summary": summary,
        "change_vs_baseline": {label: change_vs(summary, label, baseline, metrics[0]) for label in summary},
        "complete": len(runs) == len(specs) * len(seeds),
        "runs": [asdict(r) for r in runs],
        "failed": [f"{r.label} seed {r.seed}" for r in runs if r.status != "ok"],
        "mlflow": {"uri": uri, "experiment": cfg.tracking.experiment, "parent_run_id": mlflow_runs.parent},
        "wall_s": time.perf_counter() - started,
    }
    (out / "results.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    (out / "table.md").write_text(table)
    plot(summary, metrics, out / "comparison.png", f"{recipe.stem}: {task}, seeds {args.seeds}")
    return report, table


def _train_and_score(
    run: RunResult, recipe, overrides, run_dir: Path, test_split, task, evaluate, args
) -> None:
    try:
        load_config(recipe, overrides)  # a loss spec's bad override: this run fails, the others go on
    except ConfigError as e:
        run.status, run.stage, run.error = "failed", "config", str(e)
        return
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run (never resume an earlier comparison's job)
    run_dir.mkdir(parents=True)
    started = time.perf_counter()
    run.exit_code = train(recipe, overrides, args.nproc, run_dir / "train.log")
    run.train_s = time.perf_counter() - started
    if run.exit_code != 0:
        run.status, run.stage = "failed", "train"
        log = run_dir / "train.log"
        run.error = f"exit code {run.exit_code}; last lines of {log}:\n{log_tail(log)}"
        return
    started = time.perf_counter()
    try:
        report = evaluate.main(
            [
                "--model",
                str(run_dir / "export"),
                "--split",
                str(test_split),
                "--task",
                task,
                "--out",
                str(run_dir / "eval_test.json"),
                "--batch-size",
                "32",
            ]
        )
    except (Exception, SystemExit) as e:  # one bad run must not end the comparison
        run.status, run.stage = "failed", "evaluate"
        run.error = "".join(traceback.format_exception_only(type(e), e)).strip()
        return
    run.eval_s = time.perf_counter() - started
    run.metrics = report["metrics"]
    run.status = "ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="training recipe (configs/train/*.yaml)")
    parser.add_argument("--losses", default="ce,emd,ntil,ntl", help="comma-separated loss.name values")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--out", help="output folder (default: outputs/compare/<recipe name>)")
    parser.add_argument("--nproc", type=int, default=2, help="training processes per job (CPU ranks)")
    parser.add_argument("--test", help="test split JSONL (default: test.jsonl next to data.train_file)")
    parser.add_argument("--task", help="metrics to use (default: the test lines' task key)")
    parser.add_argument("--tiny-model", help="first write a tiny model folder: KIND[:SIZE], e.g. qwen2:small")
    parser.add_argument(
        "--data", help="first write synthetic data: TASK:N[:DIFFICULTY], e.g. arithmetic:4000:easy"
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides for every run, e.g. train.max_steps=50"
    )
    args = parser.parse_args(argv)
    args.out = args.out or str(REPO_ROOT / "outputs" / "compare" / Path(args.config).stem)
    try:
        report = run_comparison(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
