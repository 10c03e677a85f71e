"""Speed and memory of NTILLoss against plain cross-entropy, a naive loop, ntloss, and vocab-parallel.

    python -m benchmarks.loss_speed            # quick (< 2 min): [2, 256, 32000], tp = 2 and 4
    python -m benchmarks.loss_speed --full     # the issue's shapes: [8, 512, 32000], [4, 2048, 151936]
    python -m benchmarks.loss_speed --device cuda   # one GPU, bf16 and fp32 (< 3 min on an H200):
                                                    # see benchmarks/loss_speed_cuda.py

The rest of this docstring describes the CPU mode.

(from the repository root; `python benchmarks/loss_speed.py` works too once the package is installed)

Memory: each method runs one forward + backward on float32 logits in a fresh subprocess, and
"peak extra memory" is that process's peak resident set size (`getrusage` ru_maxrss, the kernel's
high-water mark) minus its resident size just before the loss call, i.e. what the loss and its
backward add on top of the logits. Time: one more subprocess runs the methods interleaved (one
warm-up each, then `--repeats` rounds of every method in turn) and reports medians, so that the
load of a shared machine hits all methods alike; one thread per process. Ratios are to
F.cross_entropy measured in the same run. Labels: runs of 1-6 digits making up ~21 % of the
positions (~29 % of the labelled ones), 30 % ignored (-100), the rest random tokens.

Methods: (a) F.cross_entropy; (b) NTILLoss (CE + NTIL, paper defaults); (c) the authors'
formulation as a per-sequence / per-run Python loop (ntil_ds.loss.reference; timed by its one
memory call, skipped above 2e8 logits: 18 min per call at [8, 512, 32000]); (d) ntloss.NTLoss
(Wasserstein NTL, digit level) + F.cross_entropy, the closest package on PyPI.
Vocab-parallel: tp processes on this machine (gloo) each hold [B, T, V/tp] and run the sharded
NTILLoss; compared with NTILLoss on the full logits in one process, and the bytes moved per call
(counted by wrapping torch.distributed.all_reduce) with the size of an all-gather of the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks.loss_cases import DIGIT_IDS, make_batch, ntloss_with_cross_entropy
from ntil_ds.loss import GroupedNTILLoss, NTILLoss
from ntil_ds.loss.reference import reference_ntil_loss

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK_SHAPES = [(2, 256, 32000)]
FULL_SHAPES = [(8, 512, 32000), (4, 2048, 151936)]
NAIVE_LOOP_MAX_ELEMENTS = 200_000_000
METHODS = ("cross_entropy", "ntil", "naive_loop", "ntloss")
# ntil_grouped: GroupedNTILLoss (groups of 1-3 digits, LLaMA-3 style: 1,110 number tokens) on the same batch
# with every digit label replaced by a random number token of width 1-3 (its cost does not depend on the
# widths: every width's columns are computed at every position). Run it with --methods, e.g. at Llama's
# vocabulary: --shapes 8x512x128256 --methods cross_entropy,ntil,ntil_grouped
GROUPED_TABLE = {1: DIGIT_IDS, 2: list(range(1000, 1100)), 3: list(range(2000, 3000))}


def _loss_function(method: str, vocab: int):
    if method == "cross_entropy":
        return lambda logits, labels: F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    if method == "ntil":
        loss_fn = NTILLoss(DIGIT_IDS)
        return lambda logits, labels: loss_fn(logits, labels).loss
    if method == "ntil_grouped":
        grouped_fn = GroupedNTILLoss(GROUPED_TABLE)
        return lambda logits, labels: grouped_fn(logits, labels).loss
    if method == "naive_loop":
        return lambda logits, labels: reference_ntil_loss(logits, labels, DIGIT_IDS)["loss"]
    if method == "ntloss":
        return ntloss_with_cross_entropy(vocab)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _labels_for(method: str, labels: torch.Tensor) -> torch.Tensor:
    """The grouped method's labels: each digit label a random number token of width 1-3 (made before timing)."""
    if method != "ntil_grouped":
        return labels
    generator = torch.Generator().manual_seed(1)
    number_ids = torch.tensor([i for ids in GROUPED_TABLE.values() for i in ids])
    is_digit = torch.isin(labels, torch.tensor(DIGIT_IDS))
    drawn = number_ids[torch.randint(0, len(number_ids), labels.shape, generator=generator)]
    return torch.where(is_digit, drawn, labels)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(method: str, batch: int, length: int, vocab: int) -> dict:
    """In a fresh process: peak extra memory (and time) of one forward + backward."""
    torch.set_num_threads(1)
    logits, labels = make_batch(batch, length, vocab)
    loss_fn = _loss_function(method, vocab)
    labels = _labels_for(method, labels)
    rss_before = _rss_bytes()
    leaf = logits.detach().requires_grad_()
    start = time.perf_counter()
    loss_fn(leaf, labels).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_extra_bytes": peak - rss_before}


def measure_times(methods: list[str], batch: int, length: int, vocab: int, repeats: int) -> dict:
    """Median forward + backward time per method, the methods interleaved round by round.

    Interleaving makes the load of a shared machine hit every method alike, so the ratios hold
    better than the absolute times. One warm-up call per method first.
    """
    torch.set_num_threads(1)
    logits, labels = make_batch(batch, length, vocab)
    loss_fns = {method: _loss_function(method, vocab) for method in methods}
    method_labels = {method: _labels_for(method, labels) for method in methods}
    times: dict[str, list[float]] = {method: [] for method in methods}
    for round_index in range(repeats + 1):
        for method, loss_fn in loss_fns.items():
            leaf = logits.detach().requires_grad_()
            start = time.perf_counter()
            loss_fn(leaf, method_labels[method]).backward()
            if round_index:
                times[method].append(time.perf_counter() - start)
            del leaf
    return {method: statistics.median(values) for method, values in times.items()}


class _AllReduceBytes:
    """Counts the bytes passed to torch.distributed.all_reduce (the only collective the loss uses)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def __enter__(self):
        self._original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def _vocab_parallel_rank(rank, tp, shape, repeats, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    batch, length, vocab = shape
    logits, labels = make_batch(batch, length, vocab)
    loss_fn = NTILLoss(DIGIT_IDS)
    unsharded_seconds = None
    if rank == 0:  # the baseline, alone on the machine while the others wait
        times = []
        for repeat in range(repeats + 1):
            leaf = logits.detach().requires_grad_()
            start = time.perf_counter()
            loss_fn(leaf, labels).loss.backward()
            if repeat:
                times.append(time.perf_counter() - start)
        unsharded_seconds = statistics.median(times)
    sizes = [vocab // tp + (1 if r < vocab % tp else 0) for r in range(tp)]
    vocab_start = sum(sizes[:rank])
    shard = logits[:, :, vocab_start : vocab_start + sizes[rank]].clone()
    del logits
    times = []
    for repeat in range(repeats + 1):
        leaf = shard.detach().requires_grad_()
        dist.barrier()
        with _AllReduceBytes() as traffic:
            start = time.perf_counter()
            loss_fn(leaf, labels, process_group=dist.group.WORLD, vocab_start=vocab_start).loss.backward()
            elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        if repeat:
            times.append(elapsed.item())
    if rank == 0:
        result = {
            "unsharded_seconds": unsharded_seconds,
            "sharded_seconds": statistics.median(times),
            "bytes_per_rank": traffic.bytes,
            "all_reduce_calls": traffic.calls,
            "all_gather_bytes_per_rank": batch * length * vocab * 4,
        }
        Path(result_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure_vocab_parallel(tp: int, shape: tuple[int, int, int], repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        mp.spawn(_vocab_parallel_rank, args=(tp, shape, repeats, f"{tmp}/rdv", str(result_file)), nprocs=tp)
        return json.loads(result_file.read_text())


def _in_subprocess(args: list[str], timeout: float) -> dict:
    command = [sys.executable, "-m", "benchmarks.loss_speed", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=REPO_ROOT
    )
    if done.returncode != 0:
        return {
            "error": done.stderr.strip().splitlines()[-1]
            if done.stderr.strip()
            else f"exit {done.returncode}"
        }
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="the issue's shapes (needs ~20 GB and several minutes)"
    )
    parser.add_argument("--shapes", default="", help="override the shapes, e.g. 8x512x32000,4x2048x151936")
    parser.add_argument(
        "--repeats", type=int, default=None, help="calls per median (default: 3 CPU, 10 CUDA)"
    )
    parser.add_argument(
        "--methods", default=None, help=f"comma-separated subset of {METHODS} (CPU) or of the CUDA methods"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtypes", default="bf16,fp32", help="--device cuda: logits dtypes (bf16, fp32, fp16)"
    )
    parser.add_argument(
        "--tp", default="2,4", help="tensor-parallel sizes for the vocab-parallel rows ('' = none)"
    )
    parser.add_argument("--jsonl", help="--device cuda: append each row to this file as it is measured")
    parser.add_argument(
        "--dry-run", action="store_true", help="--device cuda: check the arguments, print the plan, exit"
    )
    parser.add_argument("--memory-worker", nargs=4, metavar=("METHOD", "B", "T", "V"), help=argparse.SUPPRESS)
    parser.add_argument("--time-worker", nargs=4, metavar=("METHODS", "B", "T", "V"), help=argparse.SUPPRESS)
    parser.add_argument("--vp-worker", nargs=4, metavar=("TP", "B", "T", "V"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        from benchmarks.loss_speed_cuda import CUDA_METHODS, CUDA_SHAPES, check_plan, run

        shapes = CUDA_SHAPES
        if args.shapes:
            shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
        methods = [m for m in (args.methods or ",".join(CUDA_METHODS)).split(",") if m]
        dtypes = [d for d in args.dtypes.split(",") if d]
        check_plan(methods, dtypes)  # a typo fails here, before any GPU work
        if args.dry_run:
            print(f"would run: shapes {shapes}, dtypes {dtypes}, methods {methods}, jsonl {args.jsonl}")
            return
        run(shapes, dtypes, methods, args.repeats or 10, jsonl=args.jsonl)
        return
    args.repeats = args.repeats or 3
    args.methods = args.methods or ",".join(METHODS)

    if args.memory_worker:
        method, *dims = args.memory_worker
        print(json.dumps(measure_memory(method, *map(int, dims))))
        return
    if args.time_worker:
        methods, *dims = args.time_worker
        print(json.dumps(measure_times(methods.split(","), *map(int, dims), repeats=args.repeats)))
        return
    if args.vp_worker:
        tp, *dims = map(int, args.vp_worker)
        print(json.dumps(measure_vocab_parallel(tp, tuple(dims), args.repeats)))
        return

    shapes = FULL_SHAPES if args.full else QUICK_SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    print(f"torch {torch.__version__}, 1 thread per process, float32 logits, median of {args.repeats}\n")
    print("| shape [B, T, V] | method | time (s) | time / CE | peak extra memory (MiB) | memory / CE |")
    print("|---|---|---|---|---|---|")
    for batch, length, vocab in shapes:
        results = {}
        dims = [str(batch), str(length), str(vocab)]
        for method in methods:
            if method == "naive_loop" and batch * length * vocab > NAIVE_LOOP_MAX_ELEMENTS:
                # Each run's backward materialises a zero [T, V] gradient: hours at this size.
                results[method] = {"error": "skipped: one [T, V] gradient per digit run, would take hours"}
                continue
            print(f"... memory of {method} [{batch}, {length}, {vocab}]", file=sys.stderr, flush=True)
            results[method] = _in_subprocess(["--memory-worker", method, *dims], timeout=7200)
        # The naive loop is timed by its single memory run (minutes per call); the others together.
        timed = [m for m in methods if m != "naive_loop" and "error" not in results[m]]
        if timed:
            print(f"... times of {timed} [{batch}, {length}, {vocab}]", file=sys.stderr, flush=True)
            times = _in_subprocess(
                ["--time-worker", ",".join(timed), *dims, "--repeats", str(args.repeats)], timeout=7200
            )
            for method in timed:
                results[method] = {**results[method], "seconds": times[method]} if method in times else times
        base = results.get("cross_entropy", {})
        for method, result in results.items():
            if "error" in result:
                print(f"| [{batch}, {length}, {vocab}] | {method} | failed: {result['error']} | | | |")
                continue
            time_ratio = f"{result['seconds'] / base['seconds']:.2f}" if "seconds" in base else "-"
            memory_ratio = (
                f"{result['peak_extra_bytes'] / base['peak_extra_bytes']:.2f}"
                if "peak_extra_bytes" in base
                else "-"
            )
            print(
                f"| [{batch}, {length}, {vocab}] | {method} | {result['seconds']:.3f} | {time_ratio} | "
                f"{_mib(result['peak_extra_bytes'])} | {memory_ratio} |"
            )

    tp_sizes = [int(tp) for tp in args.tp.split(",") if tp]
    if tp_sizes:
        batch, length, vocab = shapes[0]
        print(f"\nVocab-parallel NTILLoss, [{batch}, {length}, {vocab}], gloo processes on this machine")
        print("| tp | unsharded (s) | sharded (s) | sharded / unsharded | bytes per rank per call "
              "| all-gather of logits (bytes per rank) | ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for tp in tp_sizes:
            print(f"... vocab-parallel tp={tp}", file=sys.stderr, flush=True)
            worker_args = [
                "--vp-worker",
                str(tp),
                str(batch),
                str(length),
                str(vocab),
                "--repeats",
                str(args.repeats),
            ]
            result = _in_subprocess(worker_args, timeout=3600)
            if "error" in result:
                print(f"| {tp} | failed: {result['error']} | | | | | |")
                continue
            print(
                f"| {tp} | {result['unsharded_seconds']:.3f} | {result['sharded_seconds']:.3f} | "
                f"{result['sharded_seconds'] / result['unsharded_seconds']:.2f} | {result['bytes_per_rank']:,} "
                f"({result['all_reduce_calls']} all_reduce) | {result['all_gather_bytes_per_rank']:,} | "
                f"1/{result['all_gather_bytes_per_rank'] / result['bytes_per_rank']:,.0f} |"
            )


if __name__ == "__main__":
    main()
