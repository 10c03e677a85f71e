"""Step time and tokens/s of a training recipe: NTIL vs cross-entropy, packed vs padded, ours vs the HF Trainer.

    python -m benchmarks.train_step                                # tiny CPU recipe, 2 processes, ~5-8 min
    python -m benchmarks.train_step --device cuda --model-size 2b  # one GPU, Qwen2-VL-2B dimensions, < 6 min
    python -m benchmarks.train_step --steps 40 --rounds 2 train.micro_batch_size=8

(from the repository root.) One run of this script trains the same model on the same data with real
DeepSpeed jobs started by torchrun (the recipe's ZeRO stage; the table names the stage and the batch
each variant ran):

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
allocated, peak statistics reset at every step, or CPU resident set) and, on CUDA, MFU = the model
FLOPs run / time / (--peak-tflops x GPUs): 6 x the decoder's matmul parameters per token, plus 6 x the
head's (h x vocab) per position the head ran at (every token for the HF Trainer; the labelled ones only
for ours' labelled head: counting all would inflate ours by up to ~15 %). The frozen ViT's forward and
attention's own FLOPs are not counted: MFU is a lower bound; tokens/s is the fair comparison.

On CUDA the random weights are created on the GPU (ntil_ds.model.load_model with the job's device), not
on the CPU. ``--results FILE`` is rewritten after every job and ``--keep-going`` runs the other jobs
when one fails, so a timeout or a crash keeps what finished; ``--dry-run`` resolves each job's recipe
and overrides (a bad key fails in a second) and prints the stage and batch without building anything.

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
    head_rows: float | None = None  # positions the output head ran at (None: all of them)


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


class JobFailed(RuntimeError):
    pass


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
        raise JobFailed(f"job {script.name} {' '.join(args)} failed (exit {result.returncode}):\n{tail}")


def read_records(path: Path, job: Job) -> dict[str, list[StepRecord]]:
    """A job's per-step records, by variant name of the table."""
    found: dict[str, list[StepRecord]] = {v: [] for v in job.variants()}
    for r in json.loads(path.read_text())["records"]:
        variant = job.name if job.is_hf else f"{job.name} {'CE' if r['variant'] == 'ce' else 'NTIL'}"
        found[variant].append(
            StepRecord(
                r["step"], r["step_time_s"], r["tokens"], r.get("peak_mem_mib", 0.0), r.get("head_rows")
            )
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


def run_setup(recipe: Path, overrides: list[str], hf: bool = False) -> dict:
    """What a job runs, for the table's label: the ZeRO stage and the batch of the merged config. A bad
    override fails here, before any model is built."""
    from ntil_ds.ds_config import resolve_run

    cfg, ds_config, _ = resolve_run(recipe, overrides)
    return {
        "zero_stage": ds_config.get("zero_optimization", {}).get("stage", 0),
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "max_tokens_per_micro_batch": cfg.data.max_tokens_per_micro_batch,
        "logits": "all (the model's own CE)" if hf else cfg.loss.logits,
        "optimizer": cfg.optim.name,
    }


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
    parser.add_argument(
        "--results", type=Path, help="also write results.json here, rewritten after every job (partial)"
    )
    parser.add_argument(
        "--keep-going", action="store_true", help="a job that fails is reported; the others still run"
    )
    parser.add_argument("--dry-run", action="store_true", help="resolve every job's recipe, print, exit")
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
    if cuda and not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")

    started_all = time.perf_counter()
    workdir = args.workdir or (
        Path("bench_train_step_WORKDIR")
        if args.dry_run
        else Path(tempfile.mkdtemp(prefix="bench_train_step_"))
    )
    # (the dry run resolves the recipe with stand-in paths: what the folders will be called)
    model = workdir / ("qwen2vl-2b-dims" if args.model_size == "2b" else "tiny-qwen2vl")
    common = common_overrides(args, model, workdir / "clock" / "train.jsonl")
    jobs = plan_jobs(args.device)
    setups = {j.name: run_setup(args.recipe, [*common, *j.overrides, *args.overrides], j.is_hf) for j in jobs}
    if args.dry_run:
        for job in jobs:
            print(f"would run {job.name}: {args.steps} steps ({args.warmup} warm-up), {setups[job.name]}")
        return

    workdir.mkdir(parents=True, exist_ok=True)
    print(f"building the {args.model_size} model folder and {args.samples} clock samples in {workdir} ...")
    model, data = prepare(workdir, args.samples, args.model_size)
    common = common_overrides(args, model, data)
    matmul = None
    if cuda:
        from benchmarks.model_2b import matmul_params

        matmul = matmul_params(model / "config.json")
    order = list(jobs)  # the table's order (the rounds reverse the jobs)
    samples: dict[str, list[StepRecord]] = {v: [] for job in jobs for v in job.variants()}
    failures: dict[str, str] = {}
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
                script = HF_JOB
            else:  # two optimizer steps per batch
                job_args = ["--config", str(args.recipe), "--out", str(times), "--steps", str(args.steps),
                            *overrides, f"train.max_steps={2 * args.steps}"]  # fmt: skip
                script = PAIR_JOB
            try:
                run_job(args.nproc, script, job_args, out / "job.log", args.device)
                for variant, records in read_records(times, job).items():
                    if len(records) != args.steps:
                        raise JobFailed(f"{variant}: expected {args.steps} step records, got {len(records)}")
                    samples[variant] += [r for r in records if r.step > args.warmup]
            except (JobFailed, subprocess.TimeoutExpired, OSError, ValueError) as error:
                if not args.keep_going:
                    raise SystemExit(str(error)) from None
                failures[f"round {round_index + 1} {job.name}"] = str(error).splitlines()[0][:300]
                print(f"    FAILED: {error}", flush=True)
            print(f"    done in {time.perf_counter() - started:.0f} s (log: {out / 'job.log'})", flush=True)
            write_results(workdir, args, summarize(samples, setups, order, matmul, args), failures)
        jobs.reverse()

    summary = summarize(samples, setups, order, matmul, args)
    write_results(workdir, args, summary, failures)
    print_table(summary, args)
    print(f"results: {workdir / 'results.json'}; total {time.perf_counter() - started_all:.0f} s")
    if failures:
        raise SystemExit(f"{len(failures)} job(s) failed: {failures}")


def common_overrides(args, model: Path, data: Path) -> list[str]:
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
    if args.device == "cuda":  # DeepSpeed's FusedAdam would JIT-compile first (minutes, and nvcc)
        common += ["optim.name=adamw_torch", "train.global_batch_size=64"]
    return common


def step_flops(record: StepRecord, matmul: dict[str, int]) -> float:
    """Model FLOPs of one step as run: 6 x the decoder's matmul parameters per input token, and 6 x the
    head's (h x vocab) per position the head ran at: every token for the HF Trainer and loss.logits=all,
    the labelled ones only for the labelled head (ours' default)."""
    head_rows = record.tokens if record.head_rows is None else record.head_rows
    return 6 * (matmul["decoder"] * record.tokens + matmul["head"] * head_rows)


def summarize(samples, setups, jobs, matmul, args) -> dict[str, dict]:
    summary = {}
    for job in jobs:
        for variant in job.variants():
            records = samples[variant]
            if not records:
                continue
            seconds = sum(r.seconds for r in records)
            summary[variant] = {
                "median_step_s": statistics.median(r.seconds for r in records),
                "tokens_per_s": sum(r.tokens for r in records) / seconds,
                "peak_mem_mib": max(r.peak_mem_mib for r in records),
                "steps_measured": len(records),
                **setups[job.name],
            }
            if matmul:
                flops = sum(step_flops(r, matmul) for r in records)
                summary[variant]["mfu"] = flops / seconds / (args.peak_tflops * 1e12 * args.nproc)
    return summary


def write_results(workdir: Path, args, summary: dict, failures: dict) -> None:
    text = json.dumps({"variants": summary, "failed_jobs": failures}, indent=2) + "\n"
    (workdir / "results.json").write_text(text)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(text)


def print_table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print()
    print(f"recipe {args.recipe.name}, {args.device}, {args.nproc} process(es), {args.steps} steps "
          f"({args.warmup} warm-up left out) x {args.rounds} round(s); overrides: {' '.join(args.overrides) or 'none'}")  # fmt: skip
    for variant, s in summary.items():  # what each ran: the stage and the batch, not the recipe's name
        print(f"  {variant}: ZeRO-{s['zero_stage']}, {s['global_batch_size']} samples a step "
              f"(micro-batch {s['micro_batch_size']}, packed to {s['max_tokens_per_micro_batch'] or 'no'} "
              f"tokens), logits {s['logits']}, {s['optimizer']}")  # fmt: skip
    mfu = any("mfu" in s for s in summary.values())
    if mfu:
        print(
            "  MFU: model FLOPs of the positions each ran the head at (ours: labelled only); tokens/s is the fair figure"
        )
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
