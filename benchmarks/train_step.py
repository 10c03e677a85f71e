"""Step time and tokens/s of a training recipe: NTIL vs cross-entropy, and ours vs the HF Trainer.

    python -m benchmarks.train_step                      # tiny CPU recipe, 2 processes, ~3-5 min
    python -m benchmarks.train_step --steps 40 --rounds 2 train.micro_batch_size=8

(from the repository root.) One run of this script trains the same model on the same data with
real 2-process ZeRO-3 jobs started by torchrun:

- ``ours CE`` and ``ours NTIL``: one job (benchmarks/loss_pair_job.py) that builds the real
  ntil_ds Trainer from the recipe and takes every batch through two optimizer steps, one with the loss
  ``loss.name=ce`` gives (NTIL's parts still computed for the log, without gradient, as in a real CE
  run) and one with ``loss.name=ntil`` (the paper's loss), alternating which goes first. Interleaving
  makes the NTIL/CE ratio immune to the machine's load drifting between jobs;
- ``HF Trainer``: benchmarks/hf_trainer_job.py: transformers' Trainer with the same model, data,
  collation, merged DeepSpeed config and optimizer; the model's own cross-entropy. A separate job, so
  ours/HF ratios carry the load drift between jobs: use ``--rounds 2`` (jobs run again in reverse
  order) on a shared machine.

Step time is one optimizer step (all its micro-batches' forward + backward, the optimizer step),
timed by each trainer from "the step's micro-batches are in hand" to "the optimizer stepped"; data
loading is outside it in both. The first ``--warmup`` steps are left out; the table gives the
median step time and tokens/s (input tokens of all ranks over the measured steps / their time).
The model is the tiny Qwen2-VL built by launch/make_tiny_model.py and the data the synthetic clock
task (launch/make_data.py), both written into ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HF_JOB = REPO_ROOT / "benchmarks" / "hf_trainer_job.py"
PAIR_JOB = REPO_ROOT / "benchmarks" / "loss_pair_job.py"
DEFAULT_RECIPE = REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml"
JOB_TIMEOUT_S = 900
VARIANTS = ("ours CE", "ours NTIL", "HF Trainer")


@dataclass
class StepRecord:
    step: int
    seconds: float
    tokens: float


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_job(nproc: int, script: Path, args: list[str], log_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(script), *args]  # fmt: skip
    with log_path.open("w") as log:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S
        )
    if result.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"job {script.name} {' '.join(args)} failed (exit {result.returncode}):\n{tail}")


def pair_records(path: Path) -> dict[str, list[StepRecord]]:
    """loss_pair_job.py's records, by variant name of the table."""
    by_variant: dict[str, list[StepRecord]] = {"ours CE": [], "ours NTIL": []}
    for r in json.loads(path.read_text())["records"]:
        name = "ours CE" if r["variant"] == "ce" else "ours NTIL"
        by_variant[name].append(StepRecord(r["step"], r["step_time_s"], r["tokens"]))
    return by_variant


def hf_records(path: Path) -> list[StepRecord]:
    return [
        StepRecord(r["step"], r["step_time_s"], r["tokens"]) for r in json.loads(path.read_text())["records"]
    ]


def prepare(workdir: Path, n_samples: int) -> tuple[Path, Path]:
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.model.tiny import build_tiny_model_folder

    model = build_tiny_model_folder("qwen2_vl", workdir / "tiny-qwen2vl")
    data = write_dataset("clock", n_samples, workdir / "clock")["train"]
    return model, data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the statistics")
    parser.add_argument("--rounds", type=int, default=1, help="2: run the three jobs again in reverse order")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--samples", type=int, default=300, help="clock samples to generate")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides for all three jobs")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_train_step_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model, data = prepare(workdir, args.samples)
    common = [
        f"model.name_or_path={model}",
        f"data.train_file={data}",
        "data.eval_file=",
        f"train.max_steps={args.steps}",
        f"train.log_every={args.steps}",
        "train.save_every=0",
        "train.export_at_end=false",
        f"optim.warmup_steps={min(args.warmup, args.steps)}",
        "tracking.enabled=false",
        "resume=none",
        *args.overrides,
    ]

    samples: dict[str, list[StepRecord]] = {v: [] for v in VARIANTS}
    jobs = ["ours", "HF Trainer"]
    for round_index in range(args.rounds):
        for job in jobs:
            out = workdir / f"round{round_index}_{'hf_trainer' if job == 'HF Trainer' else 'ours'}"
            out.mkdir(parents=True, exist_ok=True)
            times = out / "steps.json"
            started = time.perf_counter()
            print(f"[round {round_index + 1}/{args.rounds}] {job}: {args.steps} steps ...", flush=True)
            if job == "HF Trainer":
                run_job(args.nproc, HF_JOB, ["--config", str(args.recipe), "--out", str(times), *common,
                                             f"output_dir={out}"], out / "job.log")  # fmt: skip
                found = {job: hf_records(times)}
            else:
                run_job(args.nproc, PAIR_JOB, ["--config", str(args.recipe), "--out", str(times),
                                               "--steps", str(args.steps), *common, f"output_dir={out}",
                                               f"train.max_steps={2 * args.steps}"],  # two steps per batch
                        out / "job.log")  # fmt: skip
                found = pair_records(times)
            for variant, records in found.items():
                if len(records) != args.steps:
                    raise SystemExit(f"{variant}: expected {args.steps} step records, got {len(records)}")
                samples[variant] += [r for r in records if r.step > args.warmup]
            print(f"    done in {time.perf_counter() - started:.0f} s (log: {out / 'job.log'})", flush=True)
        jobs.reverse()

    summary = {}
    for variant, records in samples.items():
        summary[variant] = {
            "median_step_s": statistics.median(r.seconds for r in records),
            "tokens_per_s": sum(r.tokens for r in records) / sum(r.seconds for r in records),
            "steps_measured": len(records),
        }
    (workdir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary, args)
    print(f"results: {workdir / 'results.json'}")


def print_table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    ce, ntil, hf = (summary[v]["median_step_s"] for v in VARIANTS)
    print()
    print(f"recipe {args.recipe.name}, {args.nproc} processes, {args.steps} steps ({args.warmup} warm-up left out)"
          f" x {args.rounds} round(s); overrides: {' '.join(args.overrides) or 'none'}")  # fmt: skip
    print(f"{'':<12} {'median step (s)':>16} {'tokens/s':>10} {'steps':>6}")
    for variant in VARIANTS:
        s = summary[variant]
        print(
            f"{variant:<12} {s['median_step_s']:>16.4f} {s['tokens_per_s']:>10.0f} {s['steps_measured']:>6}"
        )
    print()
    print(f"NTIL / CE step time (ours):        {ntil / ce:.3f}   (target <= 1.05)")
    print(f"ours CE / HF Trainer step time:    {ce / hf:.3f}   (< 1: ours is faster)")
    print(f"ours NTIL / HF Trainer step time:  {ntil / hf:.3f}")


if __name__ == "__main__":
    main()
