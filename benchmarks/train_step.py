"""Step time and tokens/s of a training recipe: NTIL vs cross-entropy, packed vs padded, ours vs the HF Trainer.

    python -m benchmarks.train_step                                # tiny CPU recipe, 2 processes, ~5-8 min
    python -m benchmarks.train_step --device cuda --model-size 2b  # one GPU, Qwen2-VL-2B dimensions, < 6 min
    python -m benchmarks.train_step --steps 40 --rounds 2 train.micro_batch_size=8

(from the repository root.) One run of this script trains the same model on the same data with real
ZeRO-3 jobs started by torchrun:

- ``ours ... CE`` and ``ours ... NTIL``: one job (benchmarks/loss_pair_job.py) that builds the real
  ntil_ds Trainer from the recipe and takes every step's batches through two optimizer steps, one with
  the loss ``loss.name=ce`` gives (NTIL's parts still computed for the log, without gradient, as in a
  real CE run) and one with ``loss.name=ntil`` (the paper's loss), alternating which goes first.
  Interleaving makes the NTIL/CE ratio immune to the machine's load drifting between jobs. ``ours
  packed`` packs each step's samples into rows (data.max_tokens_per_micro_batch); ``ours padded`` (CPU
  mode) pads micro_batch_size samples per forward, as without packing;
- ``HF Trainer``: benchmarks/hf_trainer_job.py: transformers' Trainer with the same model, data,
  padded collation, merged DeepSpeed config and optimizer; the model's own cross-entropy; no packing,
  no fused kernels (what a user of the HF Trainer gets by default). A separate job, so ours/HF ratios
  carry the load drift between jobs: use ``--rounds 2`` (jobs run again in reverse order) on a shared
  machine.

Step time is one optimizer step (all its micro-batches' forward + backward, the optimizer step), timed
by each trainer from "the step's micro-batches are in hand" to "the optimizer stepped"; data loading is
outside it in both. The first ``--warmup`` steps are left out; the table gives the median step time,
tokens/s (input tokens of all ranks over the measured steps / their time), peak memory (rank 0: CUDA
allocated, or CPU resident set) and, on CUDA, MFU = 6 x (language-model matmul parameters) x tokens/s /
(--peak-tflops x GPUs). The frozen ViT's forward and attention's own FLOPs are not counted: MFU is a
lower bound.

CPU (``--device cpu``, default): the tiny Qwen2-VL (launch/make_tiny_model.py) on the synthetic clock
task, configs/train/tiny_qwen2vl_clock.yaml. CUDA (``--device cuda --model-size 2b``): a model of
Qwen2-VL-2B's dimensions (benchmarks/model_2b.py: random init, built offline), the shipped one-GPU
recipe configs/train/qwen2vl_2b_141gb_clock.yaml (ZeRO-2 zero2.json, no gradient checkpointing, 16k-token
micro-batches, frozen ViT, packing, Liger kernels when liger-kernel is installed; for an 80 GB GPU pass
--recipe configs/train/qwen2vl_2b_80gb_clock.yaml) with optim.name=adamw_torch, 64 sequences per step;
the HF Trainer with micro-batches of 8 on the same DeepSpeed JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HF_JOB = REPO_ROOT / "benchmarks" / "hf_trainer_job.py"
PAIR_JOB = REPO_ROOT / "benchmarks" / "loss_pair_job.py"
CPU_RECIPE = REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml"
GPU_RECIPE = REPO_ROOT / "configs" / "train" / "qwen2vl_2b_141gb_clock.yaml"  # one H100/H200: see above
JOB_TIMEOUT_S = 900


@dataclass
class StepRecord:
    step: int
    seconds: float
    tokens: float
    peak_mem_mib: float = 0.0


@dataclass
class Job:
    name: str  # "ours packed" (a CE/NTIL pair job) or "HF Trainer"
    overrides: list[str] = field(default_factory=list)

    @property
    def is_hf(self) -> bool:
        return self.name == "HF Trainer"

    def variants(self) -> list[str]:
        return [self.name] if self.is_hf else [f"{self.name} CE", f"{self.name} NTIL"]


def job_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", device)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_job(nproc: int, script: Path, args: list[str], log_path: Path, device: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(script), *args]  # fmt: skip
    with log_path.open("w") as log:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=job_env(device), stdout=log, stderr=subprocess.STDOUT,
            timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
    if result.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"job {script.name} {' '.join(args)} failed (exit {result.returncode}):\n{tail}")


def read_records(path: Path, job: Job) -> dict[str, list[StepRecord]]:
    """A job's per-step records, by variant name of the table."""
    found: dict[str, list[StepRecord]] = {v: [] for v in job.variants()}
    for r in json.loads(path.read_text())["records"]:
        variant = job.name if job.is_hf else f"{job.name} {'CE' if r['variant'] == 'ce' else 'NTIL'}"
        found[variant].append(
            StepRecord(r["step"], r["step_time_s"], r["tokens"], r.get("peak_mem_mib", 0.0))
        )
    return found


def prepare(workdir: Path, n_samples: int, model_size: str) -> tuple[Path, Path]:
    from ntil_ds.data.synthetic import write_dataset

    if model_size == "2b":
        from benchmarks.model_2b import build_2b_folder

        model = build_2b_folder(workdir / "qwen2vl-2b-dims")
    else:
        from ntil_ds.tiny import build_tiny_model_folder

        model = build_tiny_model_folder("qwen2_vl", workdir / "tiny-qwen2vl")
    data = write_dataset("clock", n_samples, workdir / "clock")["train"]
    return model, data


def plan_jobs(device: str) -> list[Job]:
    """Which jobs, with which job-specific overrides (the shared ones come after, from the command line)."""
    if device == "cpu":
        # packed rows hold up to micro_batch_size x max_seq_len tokens: the padded batch's memory bound
        return [
            Job("ours padded", ["data.max_tokens_per_micro_batch=0"]),
            Job("ours packed", ["data.max_tokens_per_micro_batch=1024"]),
            Job("HF Trainer", ["data.max_tokens_per_micro_batch=0", "model.kernels=none"]),
        ]
    kernels = "liger" if importlib.util.find_spec("liger_kernel") else "none"
    if kernels == "none":
        print(
            "note: liger-kernel is not installed: ours runs without fused kernels (pip install liger-kernel)"
        )
    return [
        Job(
            "ours packed",
            ["data.max_tokens_per_micro_batch=16384", "data.num_workers=4", f"model.kernels={kernels}"],
        ),
        Job(
            "HF Trainer",
            [
                "data.max_tokens_per_micro_batch=0",
                "model.kernels=none",
                "train.micro_batch_size=8",
                "data.num_workers=4",
            ],
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-size", choices=("tiny", "2b"), default=None,
                        help="default: tiny on cpu, 2b on cuda")  # fmt: skip
    parser.add_argument("--recipe", type=Path, default=None, help="default: by device (see above)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per job (cpu 30, cuda 7)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out (cpu 5, cuda 2)")
    parser.add_argument("--rounds", type=int, default=1, help="2: run the jobs again in reverse order")
    parser.add_argument("--nproc", type=int, default=None, help="processes (cpu 2, cuda: 1 GPU)")
    parser.add_argument(
        "--samples", type=int, default=None, help="clock samples to generate (cpu 300, cuda 640)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100/H200)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides for every job")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.model_size = args.model_size or ("2b" if cuda else "tiny")
    args.recipe = args.recipe or (GPU_RECIPE if cuda else CPU_RECIPE)
    args.steps = args.steps or (7 if cuda else 30)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 5)
    args.nproc = args.nproc or (1 if cuda else 2)
    args.samples = args.samples or (640 if cuda else 300)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")

    started_all = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_train_step_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"building the {args.model_size} model folder and {args.samples} clock samples in {workdir} ...")
    model, data = prepare(workdir, args.samples, args.model_size)
    common = [
        f"model.name_or_path={model}",
        "model.init=random",
        f"data.train_file={data}",
        "data.eval_file=",
        "train.eval_every=0",
        f"train.max_steps={args.steps}",
        f"train.log_every={args.steps}",
        "train.save_every=0",
        "train.export_at_end=false",
        f"optim.warmup_steps={min(args.warmup, args.steps)}",
        "tracking.enabled=false",
        "resume=none",
    ]
    if cuda:  # DeepSpeed's fused Adam would JIT-compile first (minutes, and nvcc); torch's AdamW is fused too
        common += ["optim.name=adamw_torch", "train.global_batch_size=64"]

    jobs = plan_jobs(args.device)
    samples: dict[str, list[StepRecord]] = {v: [] for job in jobs for v in job.variants()}
    for round_index in range(args.rounds):
        for job in jobs:
            slug = job.name.replace(" ", "_").lower()
            out = workdir / f"round{round_index}_{slug}"
            out.mkdir(parents=True, exist_ok=True)
            times = out / "steps.json"
            overrides = [*common, *job.overrides, *args.overrides, f"output_dir={out}"]
            print(f"[round {round_index + 1}/{args.rounds}] {job.name}: {args.steps} steps ...", flush=True)
            started = time.perf_counter()
            if job.is_hf:
                job_args = ["--config", str(args.recipe), "--out", str(times), *overrides]
                run_job(args.nproc, HF_JOB, job_args, out / "job.log", args.device)
            else:  # two optimizer steps per batch
                job_args = ["--config", str(args.recipe), "--out", str(times), "--steps", str(args.steps),
                            *overrides, f"train.max_steps={2 * args.steps}"]  # fmt: skip
                run_job(args.nproc, PAIR_JOB, job_args, out / "job.log", args.device)
            for variant, records in read_records(times, job).items():
                if len(records) != args.steps:
                    raise SystemExit(f"{variant}: expected {args.steps} step records, got {len(records)}")
                samples[variant] += [r for r in records if r.step > args.warmup]
            print(f"    done in {time.perf_counter() - started:.0f} s (log: {out / 'job.log'})", flush=True)
        jobs.reverse()

    matmul_params = None
    if cuda:
        from benchmarks.model_2b import language_model_matmul_params

        matmul_params = language_model_matmul_params(model / "config.json")
    summary = {}
    for variant, records in samples.items():
        tokens_per_s = sum(r.tokens for r in records) / sum(r.seconds for r in records)
        summary[variant] = {
            "median_step_s": statistics.median(r.seconds for r in records),
            "tokens_per_s": tokens_per_s,
            "peak_mem_mib": max(r.peak_mem_mib for r in records),
            "steps_measured": len(records),
        }
        if matmul_params:
            summary[variant]["mfu"] = (
                6 * matmul_params * tokens_per_s / (args.peak_tflops * 1e12 * args.nproc)
            )
    (workdir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary, args)
    print(f"results: {workdir / 'results.json'}; total {time.perf_counter() - started_all:.0f} s")


def print_table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print()
    print(f"recipe {args.recipe.name}, {args.device}, {args.nproc} process(es), {args.steps} steps "
          f"({args.warmup} warm-up left out) x {args.rounds} round(s); overrides: {' '.join(args.overrides) or 'none'}")  # fmt: skip
    mfu = any("mfu" in s for s in summary.values())
    print(f"{'':<18} {'median step (s)':>16} {'tokens/s':>10} {'peak MiB':>10}" + (f" {'MFU':>7}" if mfu else "")
          + f" {'steps':>6}")  # fmt: skip
    for variant, s in summary.items():
        line = (
            f"{variant:<18} {s['median_step_s']:>16.4f} {s['tokens_per_s']:>10.0f} {s['peak_mem_mib']:>10.0f}"
        )
        if mfu:
            line += f" {100 * s['mfu']:>6.1f}%"
        print(line + f" {s['steps_measured']:>6}")
    print()

    def ratio(label: str, a: str, b: str, key: str, note: str) -> None:
        if a in summary and b in summary:
            print(f"{label:<36} {summary[a][key] / summary[b][key]:.3f}   ({note})")

    ratio(
        "NTIL / CE step time (ours packed):",
        "ours packed NTIL",
        "ours packed CE",
        "median_step_s",
        "target <= 1.03",
    )
    ratio("NTIL / CE step time (ours padded):", "ours padded NTIL", "ours padded CE", "median_step_s", "")
    ratio(
        "ours packed CE / HF tokens/s:", "ours packed CE", "HF Trainer", "tokens_per_s", "> 1: ours is faster"
    )
    ratio(
        "ours packed NTIL / HF tokens/s:", "ours packed NTIL", "HF Trainer", "tokens_per_s", "GPU target >= 2"
    )
    ratio("ours padded CE / HF tokens/s:", "ours padded CE", "HF Trainer", "tokens_per_s", "")
    ratio("packed / padded tokens/s (NTIL):", "ours packed NTIL", "ours padded NTIL", "tokens_per_s", "")


if __name__ == "__main__":
    main()
