"""The output head and the loss, forward + backward: the whole logits (``loss.logits=all``) against the
labelled head (``loss.logits=labelled``: the head only at the rows with a target, in chunks).

    python -m benchmarks.head_speed                 # CPU shapes (a few minutes on 2 cores)
    python -m benchmarks.head_speed --device cuda   # the issue's shapes: H 1536 / 3584, V 151936,
                                                    # T 4096 / 16384, bf16 and fp32
    python -m benchmarks.head_speed --device cuda --dtypes bfloat16 --jsonl rows.jsonl  # gpu_check.sh

Per case (hidden size H, vocabulary V, T positions, the labelled share, dtype, CE or NTIL): the time of
one forward + backward of head + loss (median of ``--repeats``, the two paths interleaved so the load of
a shared machine hits both alike) and the peak extra memory: the most bytes of tensors alive at once
during that forward + backward, above the inputs (hidden states, head weight). On CUDA that is
``torch.cuda.max_memory_allocated`` over the allocated bytes before the call; on the CPU a dispatch mode
counts every tensor the operations make and when its storage is freed (deterministic, unlike the
process's resident size); on CUDA the peak statistics are reset for every path of every row. Ratios
are labelled / all, in the same run. The hidden states and the head weight are drawn once per (H, T,
dtype), on the device (a CUDA generator: no CPU draw, no host copy), and shared by that shape's rows.

Baseline on CE rows: Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropyLoss: the head and
the CE in chunks, the full logits never stored) when liger-kernel is installed. Throughput: the head's
matrix FLOPs actually run over the time: 6 x rows x H x V for forward + backward, rows = T for the whole
logits and Liger, the labelled rows only for the labelled head, which also recomputes its logits in the
backward (8 x rows x H x V; tests/unit/test_benchmark_flops.py counts them); MFU counts the model's
6 x rows x H x V only, against --peak-tflops.
Each row is printed, and appended to --jsonl, as soon as it is measured; a case that fails prints its
error and the run goes on.

Labels: answers as runs of 1-6 digits (with a few other tokens between them) placed at random, making up
the labelled share of the positions; everything else ignored, as in fine-tuning data.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.labelled_forward import loss_from_rows, row_inputs, row_stats
from ntil_ds.loss import NTILLoss
from ntil_ds.loss.labelled_head import OutputHead

DIGIT_IDS = list(range(100, 110))
CPU_CASES = {"hidden": (256,), "vocab": (32000,), "positions": (1024, 4096, 16384), "dtypes": ("float32",)}
CUDA_CASES = {
    "hidden": (1536, 3584),
    "vocab": (151936,),
    "positions": (4096, 16384),
    "dtypes": ("bfloat16", "float32"),
}
SHARES = (0.02, 0.2, 1.0)
LIGER: dict = {}  # "fn": the Liger loss, set by main() when a CE row can use it


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside the mode (CPU: no allocator statistics there)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor._is_view():
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def make_labels(positions: int, share: float, vocab: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    labels = torch.full((positions,), IGNORE_INDEX, dtype=torch.long)
    wanted = max(1, round(share * positions))
    if wanted >= positions:
        starts = [0]
        lengths = [positions]
    else:
        lengths, starts, total = [], [], 0
        while total < wanted:
            lengths.append(min(rng.randint(3, 8), wanted - total))
            total += lengths[-1]
        slots = sorted(rng.sample(range(positions // 8), len(lengths)))
        starts = [slot * 8 for slot in slots]
    for start, length in zip(starts, lengths, strict=True):
        for t in range(start, min(start + length, positions)):
            digit_run = (t - start) % 7 < 6  # digits with an occasional other token between numbers
            labels[t] = rng.choice(DIGIT_IDS) if digit_run else rng.randrange(200, vocab)
    return labels[None]


def liger_fused_linear_ce():
    """Liger's fused linear cross-entropy, or the reason it is unavailable (a string)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # not installed, or an import that fails on this machine
        return f"unavailable: {type(error).__name__}: {error}".splitlines()[0][:200]
    return LigerFusedLinearCrossEntropyLoss()


def run_once(path: str, hidden, weight, labels, loss_fn, chunk_rows) -> None:
    hidden.grad = weight.grad = None
    generator = torch.Generator(device=hidden.device).manual_seed(0)
    if path == "liger":
        LIGER["fn"](weight, hidden, labels.flatten()).backward()
        return
    if path == "all":
        out = loss_fn((hidden @ weight.t())[None], labels, generator=generator)
    else:
        rows = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
        targets, noise, payload = row_inputs(loss_fn, labels, rows, hidden.dtype, generator, False)
        column_ids = loss_fn.column_ids_on(hidden.device)
        head = OutputHead(weight)
        stats = row_stats(hidden, head, rows, targets, column_ids, None, payload, loss_fn.kernel, chunk_rows)
        out = loss_from_rows(loss_fn, labels, rows, stats, noise, None)
    out.loss_sum.backward()


def peak_extra_bytes(path: str, *inputs) -> int:
    device = inputs[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_once(path, *inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveTensorBytes() as counter:
        run_once(path, *inputs)
    return counter.peak


def seconds(path: str, *inputs) -> float:
    sync = torch.cuda.synchronize if inputs[0].is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    run_once(path, *inputs)
    sync()
    return time.perf_counter() - started


def draw_inputs(hidden_size: int, vocab: int, positions: int, dtype_name: str, device: torch.device):
    """Hidden states and head weight, drawn on ``device`` once per shape (no CPU draw, no host copy)."""
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=generator, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator, device=device) * 0.02).to(dtype)
    return hidden.requires_grad_(), weight.requires_grad_()


def head_flops(rows: int, hidden_size: int, vocab: int, recompute: bool = False) -> int:
    """The head's matrix FLOPs of forward + backward: logits 2RHV, their input and weight gradients 4RHV,
    and with ``recompute`` the logits again in the backward (2RHV: the labelled head keeps no logits)."""
    return (8 if recompute else 6) * rows * hidden_size * vocab


def measure(case: dict, hidden, weight, repeats: int, chunk_rows: int | None, peak_tflops: float) -> dict:
    labels = make_labels(case["positions"], case["share"], case["vocab"], seed=1).to(hidden.device)
    loss_fn = NTILLoss(DIGIT_IDS, ntil_lambda=0.0 if case["loss"] == "ce" else 0.3)
    inputs = (hidden, weight, labels, loss_fn, chunk_rows)
    paths = ["all", "labelled"] + (["liger"] if case["loss"] == "ce" and "fn" in LIGER else [])
    times = {path: [] for path in paths}
    for path in times:  # warm-up (kernel compilation, allocator)
        run_once(path, *inputs)
    for _ in range(repeats):
        for path in times:
            times[path].append(seconds(path, *inputs))
    memory = {path: peak_extra_bytes(path, *inputs) for path in times}
    median = {path: statistics.median(times[path]) for path in times}
    labelled_rows = int((labels != IGNORE_INDEX).sum())
    rows = {"all": case["positions"], "labelled": labelled_rows, "liger": case["positions"]}
    row = {**case, "labelled_rows": labelled_rows}
    for path in times:
        # tflops: what the GPU ran (the labelled head's recompute too); MFU: the model's 6RHV only
        run = head_flops(rows[path], case["hidden"], case["vocab"], recompute=path == "labelled")
        model = head_flops(rows[path], case["hidden"], case["vocab"])
        row |= {f"time_{path}_s": median[path], f"memory_{path}_mib": memory[path] / 2**20,
                f"tflops_{path}": run / median[path] / 1e12,
                f"mfu_{path}": model / median[path] / 1e12 / peak_tflops}  # fmt: skip
    row["time_ratio"] = median["labelled"] / median["all"]
    row["memory_ratio"] = memory["labelled"] / memory["all"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chunk-rows",
        type=int,
        help="rows per chunk of the labelled head (default: CUDA as in training, 2**27 logits; CPU 256, "
        "so that T=4096 runs in 16 chunks, as T=16384 does at V=151936)",
    )
    parser.add_argument("--json", help="also write all the rows to this file at the end")
    parser.add_argument("--hidden", help="comma-separated hidden sizes (default: by device)")
    parser.add_argument("--positions", help="comma-separated T (default: by device)")
    parser.add_argument("--dtypes", help="comma-separated dtypes, e.g. bfloat16 (default: by device)")
    parser.add_argument("--jsonl", help="append each row to this file as soon as it is measured")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200)")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the grid, exit")
    args = parser.parse_args()
    device = torch.device(args.device)
    grid = dict(CUDA_CASES if device.type == "cuda" else CPU_CASES)
    for key, cast in (("hidden", int), ("positions", int), ("dtypes", str)):
        if getattr(args, key):
            grid[key] = tuple(cast(x) for x in getattr(args, key).split(",") if x)
    bad = [d for d in grid["dtypes"] if not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        parser.error(f"--dtypes: not torch dtypes: {bad}")
    shapes = [(h, v, t, d) for h in grid["hidden"] for v in grid["vocab"] for t in grid["positions"]
              for d in grid["dtypes"]]  # fmt: skip
    if args.dry_run:
        print(f"would run {len(shapes) * len(SHARES) * 2} rows: (H, V, T, dtype) {shapes} x shares "
              f"{SHARES} x (ce, ntil) on {device}; jsonl {args.jsonl}")  # fmt: skip
        return
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    chunk_rows = args.chunk_rows or (None if device.type == "cuda" else 256)
    liger = liger_fused_linear_ce() if device.type == "cuda" else "unavailable: CUDA only"
    if isinstance(liger, str):
        print(f"liger: {liger}")
    else:
        LIGER["fn"] = liger
    rows = []
    header = f"{'H':>5} {'V':>7} {'T':>6} {'share':>6} {'dtype':>9} {'loss':>5} | {'all s':>8} {'lab s':>8} {'time x':>7} | {'all MiB':>9} {'lab MiB':>9} {'mem x':>6} | {'TF/s all':>8} {'TF/s lab':>8} | {'liger s':>8} {'liger MiB':>9}"
    print(header)
    for h, v, t, dtype in shapes:
        try:
            hidden, weight = draw_inputs(h, v, t, dtype, device)
        except Exception as error:  # e.g. out of memory: the next shape may fit
            print(f"{h:>5} {v:>7} {t:>6} {dtype:>9}: inputs failed: {type(error).__name__}: {error}"[:300])
            continue
        for share in SHARES:
            for loss in ("ce", "ntil"):
                case = {"hidden": h, "vocab": v, "positions": t, "share": share, "dtype": dtype, "loss": loss}
                try:
                    r = measure(case, hidden, weight, args.repeats, chunk_rows, args.peak_tflops)
                except Exception as error:  # a failure is a finding: report it and go on
                    r = {**case, "error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
                    print(f"{h:>5} {v:>7} {t:>6} {share:>6.0%} {dtype:>9} {loss:>5} | failed: {r['error']}")
                else:
                    liger_text = (
                        f"{r['time_liger_s']:>8.3f} {r['memory_liger_mib']:>9.1f}"
                        if "time_liger_s" in r
                        else ""
                    )
                    print(
                        f"{h:>5} {v:>7} {t:>6} {share:>6.0%} {dtype:>9} {loss:>5} | {r['time_all_s']:>8.3f} "
                        f"{r['time_labelled_s']:>8.3f} {r['time_ratio']:>7.3f} | {r['memory_all_mib']:>9.1f} "
                        f"{r['memory_labelled_mib']:>9.1f} {r['memory_ratio']:>6.3f} | {r['tflops_all']:>8.1f} "
                        f"{r['tflops_labelled']:>8.1f} | {liger_text}",
                        flush=True,
                    )
                rows.append(r)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(r) + "\n")
        del hidden, weight
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
