"""The tiny demo, end to end, on 2 CPU processes (what `make demo` runs; a few minutes):

1. write a tiny Qwen2-VL model folder (config + processor, random weights at train time);
2. generate the synthetic clock task (read the time off a rendered clock face);
3. train it with NTIL on DeepSpeed ZeRO-3 with the real `deepspeed` launcher, 2 processes;
4. evaluate the exported Hugging Face folder with greedy generation (launch/evaluate.py).

    python launch/quickstart.py [--out outputs/quickstart] [--samples 640] [key=value ...]

Extra key=value arguments go to the training recipe (configs/train/tiny_qwen2vl_clock.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ntil_ds.config import load_config
from ntil_ds.data.synthetic import write_dataset
from ntil_ds.model.tiny import build_tiny_model_folder
from ntil_ds.tracking import resolve_tracking_uri

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    """CPU DeepSpeed, one thread per rank on a small machine, a kept cache for JIT-compiled ops."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run(command: list[str], what: str) -> None:
    print(f"\n=== {what}\n$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, env=job_env())
    if result.returncode != 0:
        sys.exit(f"quickstart: {what} failed (exit code {result.returncode}); see the output above")
    print(f"=== {what}: done in {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="outputs/quickstart", help="everything goes under this folder")
    parser.add_argument("--samples", type=int, default=640, help="clock samples over train/val/test")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=20")
    args = parser.parse_args()
    started = time.perf_counter()
    out = (REPO_ROOT / args.out).resolve()
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a demo starts fresh (resume=auto would otherwise continue the last one)

    model_dir = build_tiny_model_folder("qwen2_vl", out / "tiny-qwen2vl")
    print(f"tiny Qwen2-VL folder: {model_dir}")
    splits = write_dataset("clock", args.samples, out / "data" / "clock", seed=0)
    print(f"clock data: {', '.join(f'{k}={v}' for k, v in splits.items())}")

    overrides = [
        f"output_dir={run_dir}",
        f"model.name_or_path={model_dir}",
        f"data.train_file={splits['train']}",
        f"data.eval_file={splits['val']}",
        *args.overrides,
    ]
    cfg = load_config(RECIPE, overrides)  # fail here, not in 2 processes, on a bad override
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    run(
        [
            deepspeed,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "launch/train.py",
            "--config",
            str(RECIPE),
            *overrides,
        ],
        "train (deepspeed launcher, 2 CPU processes, ZeRO-3)",
    )
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
    print(f"run folder:        {run_dir}  (config.yaml, deepspeed.json, metrics.jsonl, checkpoints/)")
    print(f"exported model:    {export_dir}")
    print(f"test-set metrics:  {results_file}")
    print(f"MLflow UI:         mlflow ui --backend-store-uri {uri}")


if __name__ == "__main__":
    main()
