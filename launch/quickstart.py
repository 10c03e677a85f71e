"""The tiny demo, end to end, on 2 CPU processes (what `make demo` runs; a few minutes):

1. write a tiny model folder (config + tokenizer/processor, random weights at train time);
2. generate an easy synthetic task: `arithmetic` (a + b, a and b in 0..99; the default: a tiny Qwen2
   learns it in a few hundred steps) or `clock` (a small Qwen2-VL with its random vision tower frozen
   learns to read quarter hours off plain dials in 600 steps; see docs/results.md);
3. train it with NTIL on DeepSpeed ZeRO-3 with the real `deepspeed` launcher, 2 processes;
4. evaluate the exported Hugging Face folder with greedy generation (launch/evaluate.py) and show
   some answers and the mean error against chance.

    python launch/quickstart.py [--task arithmetic|clock] [--out outputs/quickstart] [key=value ...]
    python launch/quickstart.py --entrypoint "bash docker/entrypoint.sh" ...   # train via a container's entry point

Extra key=value arguments go to the training recipe (configs/train/tiny_qwen2_arithmetic.yaml or
configs/train/tiny_qwen2vl_clock.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ntil_ds.config import load_config
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.dist import free_port
from ntil_ds.jobs import REPO_ROOT, TRAIN_SCRIPT, job_env, launcher_command, train_args
from ntil_ds.tiny import build_tiny_model_folder
from ntil_ds.tracking import resolve_tracking_uri


@dataclass(frozen=True)
class Demo:
    recipe: Path
    model_kind: str
    model_size: str
    samples: int
    overrides: tuple[str, ...]  # on top of the recipe
    error_metric: str  # the numeric error to set against chance
    chance: float  # that error for the best answer that ignores the question
    chance_note: str


DEMOS = {
    # The best constant answer to a + b (a, b uniform in 0..99) is 99: mean absolute error 33.
    "arithmetic": Demo(
        REPO_ROOT / "configs" / "train" / "tiny_qwen2_arithmetic.yaml",
        "qwen2",
        "tiny",
        3000,
        (),
        "abs_error",
        33.0,
        "always answering 99",
    ),
    # Any answer that ignores the dial is off by 180 minutes on average on a 12-hour dial. The recipe's
    # step count is shared with the tests: the demo trains longer. A vision tower trained from random
    # weights at this learning rate collapses to a constant output (docs/results.md); frozen, its random
    # features still tell the dials apart and the rest of the model learns to read them.
    "clock": Demo(
        REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml",
        "qwen2_vl",
        "small",
        2000,
        (
            "train.max_steps=600",
            "train.micro_batch_size=8",
            "train.global_batch_size=16",
            "train.save_every=0",
            "train.log_every=50",
            "optim.warmup_steps=20",
            "model.freeze_vision_tower=true",
        ),
        "clock_dev_minutes",
        180.0,
        "any answer that ignores the dial",
    ),
}


def run(command: list[str], what: str, extra_env: dict[str, str] | None = None) -> None:
    print(f"\n=== {what}\n$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    env = {**job_env(), **(extra_env or {})}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env)  # the output goes to the console
    if result.returncode != 0:
        sys.exit(f"quickstart: {what} failed (exit code {result.returncode}); see the output above")
    print(f"=== {what}: done in {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="outputs/quickstart", help="everything goes under this folder")
    parser.add_argument("--task", choices=sorted(DEMOS), default="arithmetic", help="the easy task to learn")
    parser.add_argument("--samples", type=int, help="samples over train/val/test (default: the task's)")
    parser.add_argument(
        "--entrypoint",
        help="train through this container entry point (`ENTRYPOINT train --config ...`, NPROC_PER_NODE=2) "
        "instead of calling deepspeed; make container-test passes the image's",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=20")
    args = parser.parse_args()
    started = time.perf_counter()
    out = (REPO_ROOT / args.out).resolve()
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a demo starts fresh (resume=auto would otherwise continue the last one)

    demo = DEMOS[args.task]
    model_dir = build_tiny_model_folder(demo.model_kind, out / f"model-{args.task}", size=demo.model_size)
    print(f"{demo.model_size} {demo.model_kind} model folder: {model_dir}")
    samples = args.samples or demo.samples
    splits = write_dataset(args.task, samples, out / "data" / args.task, difficulty="easy")
    print(f"{args.task} data (easy): {', '.join(f'{k}={v}' for k, v in splits.items())}")

    overrides = [
        f"output_dir={run_dir}",
        f"model.name_or_path={model_dir}",
        f"data.train_file={splits['train']}",
        f"data.eval_file={splits['val']}",
        *demo.overrides,
        *args.overrides,
    ]
    cfg = load_config(demo.recipe, overrides)  # fail here, not in 2 processes, on a bad override
    if args.entrypoint:
        # The entry point's `train` runs deepspeed --master_port MASTER_PORT --num_gpus NPROC_PER_NODE.
        command = [*shlex.split(args.entrypoint), "train", *train_args(demo.recipe, overrides)]
        launcher_env = {"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
        what = f"train through the entry point `{args.entrypoint} train` (deepspeed, 2 CPU processes, ZeRO-3)"
    else:
        command = launcher_command("deepspeed", 2, TRAIN_SCRIPT, train_args(demo.recipe, overrides))
        launcher_env = {}
        what = "train (deepspeed launcher, 2 CPU processes, ZeRO-3)"
    run(command, what, launcher_env)
    export_dir = run_dir / "export"
    results_file = run_dir / "eval_test.json"
    run(
        [
            sys.executable,
            "launch/evaluate.py",
            "--model",
            str(export_dir),
            "--split",
            str(splits["test"]),
            "--out",
            str(results_file),
        ],
        "evaluate the exported model on the test split",
    )

    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["loss"]) for r in train if r["split"] == "train"]
    uri = resolve_tracking_uri(cfg.tracking.uri, run_dir, os.environ.get("MLFLOW_TRACKING_URI"))
    print("\n=== quickstart finished in", f"{time.perf_counter() - started:.0f} s")
    print(
        "loss curve (step: loss):", ", ".join(f"{s}: {v:.3f}" for s, v in curve[:: max(1, len(curve) // 12)])
    )
    print(f"  first {curve[0][1]:.3f} -> last {curve[-1][1]:.3f}")
    report = json.loads(results_file.read_text())
    metrics = report["metrics"]
    print("some test answers (reference -> model):",
          ", ".join(f"{r['reference']} -> {r['prediction']!r}" for r in report["samples"][:8]))  # fmt: skip
    error = metrics[demo.error_metric]
    print(f"answers that parse: {metrics['parsed']}/{metrics['n']}; exact: {metrics['exact_match']:.1%}; "
          f"{demo.error_metric}: {'n/a' if error is None else f'{error:.1f}'} "
          f"(chance: {demo.chance:.0f}, {demo.chance_note})")  # fmt: skip
    print(f"run folder:        {run_dir}  (config.yaml, deepspeed.json, metrics.jsonl, checkpoints/)")
    print(f"exported model:    {export_dir}")
    print(f"test-set metrics:  {results_file}")
    print(f"MLflow UI:         mlflow ui --backend-store-uri {uri}")


if __name__ == "__main__":
    main()
