"""The output head and the loss, forward + backward: the whole logits (``loss.logits=all``) against the
labelled head (``loss.logits=labelled``: the head only at the rows with a target, in chunks).

    python -m benchmarks.head_speed                 # CPU shapes (a few minutes on 2 cores)
    python -m benchmarks.head_speed --device cuda   # the issue's shapes: H 1536 / 3584, V 151936,
                                                    # T 4096 / 16384, bf16 and fp32

Per case (hidden size H, vocabulary V, T positions, the labelled share, dtype, CE or NTIL): the time of
one forward + backward of head + loss (median of ``--repeats``, the two paths interleaved so the load of
a shared machine hits both alike) and the peak extra memory: the most bytes of tensors alive at once
during that forward + backward, above the inputs (hidden states, head weight). On CUDA that is
``torch.cuda.max_memory_allocated`` over the allocated bytes before the call; on the CPU a dispatch mode
counts every tensor the operations make and when its storage is freed (deterministic, unlike the
process's resident size). Ratios are labelled / all, in the same run.

Labels: answers as runs of 1-6 digits (with a few other tokens between them) placed at random, making up
the labelled share of the positions; everything else ignored, as in fine-tuning data.
"""

from __future__ import annotations

import argparse
import itertools
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


def run_once(path: str, hidden, weight, labels, loss_fn, chunk_rows) -> None:
    hidden.grad = weight.grad = None
    generator = torch.Generator(device=hidden.device).manual_seed(0)
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


def measure(case: dict, device: torch.device, repeats: int, chunk_rows: int | None) -> dict:
    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(case["positions"], case["hidden"], generator=generator)).to(device, dtype)
    weight = (torch.randn(case["vocab"], case["hidden"], generator=generator) * 0.02).to(device, dtype)
    hidden.requires_grad_(), weight.requires_grad_()
    labels = make_labels(case["positions"], case["share"], case["vocab"], seed=1).to(device)
    loss_fn = NTILLoss(DIGIT_IDS, ntil_lambda=0.0 if case["loss"] == "ce" else 0.3)
    inputs = (hidden, weight, labels, loss_fn, chunk_rows)
    times = {"all": [], "labelled": []}
    for path in times:  # warm-up (kernel compilation, allocator)
        run_once(path, *inputs)
    for _ in range(repeats):
        for path in times:
            times[path].append(seconds(path, *inputs))
    memory = {path: peak_extra_bytes(path, *inputs) for path in times}
    time_all, time_labelled = (statistics.median(times[p]) for p in ("all", "labelled"))
    return {
        **case,
        "time_all_s": time_all,
        "time_labelled_s": time_labelled,
        "time_ratio": time_labelled / time_all,
        "memory_all_mib": memory["all"] / 2**20,
        "memory_labelled_mib": memory["labelled"] / 2**20,
        "memory_ratio": memory["labelled"] / memory["all"],
    }


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
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    grid = CUDA_CASES if device.type == "cuda" else CPU_CASES
    chunk_rows = args.chunk_rows or (None if device.type == "cuda" else 256)
    rows = []
    header = f"{'H':>5} {'V':>7} {'T':>6} {'share':>6} {'dtype':>9} {'loss':>5} | {'all s':>8} {'lab s':>8} {'time x':>7} | {'all MiB':>9} {'lab MiB':>9} {'mem x':>6}"
    print(header)
    for h, v, t, dtype, share, loss in itertools.product(
        grid["hidden"], grid["vocab"], grid["positions"], grid["dtypes"], SHARES, ("ce", "ntil")
    ):
        case = {"hidden": h, "vocab": v, "positions": t, "share": share, "dtype": dtype, "loss": loss}
        r = measure(case, device, args.repeats, chunk_rows)
        rows.append(r)
        print(
            f"{h:>5} {v:>7} {t:>6} {share:>6.0%} {dtype:>9} {loss:>5} | {r['time_all_s']:>8.3f} "
            f"{r['time_labelled_s']:>8.3f} {r['time_ratio']:>7.3f} | {r['memory_all_mib']:>9.1f} "
            f"{r['memory_labelled_mib']:>9.1f} {r['memory_ratio']:>6.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
