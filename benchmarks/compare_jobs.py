"""A comparison grid's throughput: ``--jobs 1`` (each job all the cores' threads) against ``--jobs 2`` (two
jobs at once, half the threads each), on the same jobs, in one run.

    python benchmarks/compare_jobs.py --out /tmp/compare_jobs [--steps 150] [compare.py overrides ...]

Default: the ablation's own recipe (docs/results.md: tiny Qwen2-VL from the pretrained base on standard
clocks, micro-batch 16, vision tower frozen) cut to ``--steps`` steps, 2 losses (ce, ntil) x 2 seeds = 4
jobs, each scored on ``--test-n`` test clocks. Each setting is a fresh grid (its own --out), run one after
the other on an otherwise idle machine; printed as a Markdown table with the wall time, jobs an hour and
the ratio to ``--jobs 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--test-n", type=int, default=200, help="test clocks each job is scored on")
    parser.add_argument("--base", default="outputs/tiny_qwen2vl_pretrain/export", help="the pretrained base")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not Path(args.base, "config.json").is_file():
        raise SystemExit(
            f"{args.base}: no model there; build the base first (docs/results.md, 'A base that sees')"
        )
    cores = len(os.sched_getaffinity(0))
    data = args.out / "data"
    subprocess.run(
        [sys.executable, "launch/make_data.py", "clock", "--n", str(2000 + 2 * args.test_n), "--difficulty",
         "standard", "--seed", "23", "--out", str(data)],
        cwd=REPO, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    test = data / "test.jsonl"
    lines = test.read_text().splitlines()[: args.test_n]
    test.write_text("\n".join(lines) + "\n")
    settings = [(1, cores), (2, max(1, cores // 2))]
    rows = []
    for jobs, threads in settings:
        out = args.out / f"jobs{jobs}"
        command = [
            sys.executable, "launch/compare.py", "--config", "configs/train/tiny_qwen2vl_clock.yaml",
            "--losses", "ce,ntil", "--seeds", "0,1", "--nproc", "1", "--jobs", str(jobs),
            "--threads", str(threads), "--out", str(out), "--test", str(test), "--shuffled-n", "0",
            "model.init=pretrained", f"model.name_or_path={args.base}", f"data.train_file={data / 'train.jsonl'}",
            f"data.eval_file={data / 'val.jsonl'}", f"train.max_steps={args.steps}", "train.micro_batch_size=16",
            "train.global_batch_size=16", "train.save_every=0", "train.log_every=50", "optim.warmup_steps=20",
            "model.freeze_vision_tower=true", "eval.generate_every=0", *args.overrides,
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"--jobs {jobs}: compare.py exited {done.returncode}")
        report = json.loads((out / "results.json").read_text())
        train_s = sum(r["train_s"] for r in report["runs"]) / len(report["runs"])
        eval_s = sum(r["eval_s"] for r in report["runs"]) / len(report["runs"])
        rows.append((jobs, threads, len(report["runs"]), wall, train_s, eval_s))
    base = rows[0][3]
    print(f"\n{cores} cores; {args.steps} steps a job, scored on {args.test_n} test clocks\n")
    print(
        "| --jobs | threads a job | jobs | wall s | train s a job | score s a job | jobs / hour | throughput vs --jobs 1 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for jobs, threads, n, wall, train_s, eval_s in rows:
        print(f"| {jobs} | {threads} | {n} | {wall:.0f} | {train_s:.0f} | {eval_s:.0f} | {3600 * n / wall:.1f} | "
              f"{base / wall:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
