"""The loss on one CUDA device: `python -m benchmarks.loss_speed --device cuda` (see that module).

Per shape and logits dtype, forward + backward of each method on the same logits and labels:

- time: median of `--repeats` calls (default 10, after 3 warm-ups) timed with CUDA events;
- ratio to PyTorch's cross-entropy as Hugging Face models compute it
  (`F.cross_entropy(logits.float().view(-1, V), labels.view(-1))`), measured in the same run, and to
  Liger's fused cross-entropy (the stronger baseline: one pass over the logits, the gradient written in
  place) when liger-kernel is installed; both baselines run first in each shape;
- the bandwidth floor: the time of copying the logits once (read once + write once, what a loss
  that reads the logits and writes their gradient cannot beat), measured on this device;
- peak extra memory: `torch.cuda.max_memory_allocated()` during the timed calls minus what was allocated
  before (the logits and labels), the peak statistics reset for every row, and its ratio to
  cross-entropy's;
- launches per call: GPU activities (kernels, memsets, copies) of one call under torch.profiler;
- host sync: whether one call of NTILLoss runs under `torch.cuda.set_sync_debug_mode("error")`.

Methods: cross_entropy (the baseline above); ntil (NTILLoss as configured by default: the Triton
vocabulary kernels and the Triton number stage when Triton imports, 4 Triton launches in all);
ntil_eager (the same with number_stage="eager": the number stage as ~230 torch ops);
ntil_compiled (number_stage="compile": the number stage through torch.compile, compiled once during
the warm-up calls, ~tens of seconds); ntil_torch (NTILLoss with kernel="torch": the vocabulary
fallback with device-sized tiles);
liger (LigerCrossEntropyLoss, the fused cross-entropy anchor, if liger-kernel is installed; it writes
the gradient into the logits' own storage during the forward, so it gets a private copy of them);
ntloss (ntloss.NTLoss + cross-entropy, if ntloss is installed). Needs only torch (+ triton) on a CUDA
machine; a method that fails or is missing prints its reason in the table and the run goes on.
`--jsonl FILE` appends each row to FILE as soon as it is measured: a run killed by a timeout keeps the
rows it finished.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.loss_cases import DIGIT_IDS, make_batch_cuda, ntloss_with_cross_entropy
from ntil_ds.loss import NTILLoss

CUDA_SHAPES = [(8, 512, 32000), (4, 2048, 151936), (8, 4096, 151936)]
CUDA_METHODS = ("cross_entropy", "ntil", "ntil_eager", "ntil_compiled", "ntil_torch", "liger", "ntloss")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _hf_cross_entropy(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


# One instance per method for the whole run: the compiled number stage (dynamic shapes) is compiled once.
_NTIL_LOSSES = {
    "ntil": NTILLoss(DIGIT_IDS),  # kernel="auto", number_stage="auto": the Triton kernels on CUDA
    "ntil_eager": NTILLoss(DIGIT_IDS, number_stage="eager"),
    "ntil_torch": NTILLoss(DIGIT_IDS, kernel="torch"),
    "ntil_compiled": NTILLoss(DIGIT_IDS, number_stage="compile"),
}


BASELINES = ("cross_entropy", "liger")  # measured first in each shape: the ratios of the rows after them


def check_plan(methods: list[str], dtypes: list[str]) -> None:
    """Unknown names fail before any GPU work (and in gpu_check.sh's dry run)."""
    unknown = [m for m in methods if m not in CUDA_METHODS] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown {unknown}: methods are {CUDA_METHODS}, dtypes {tuple(DTYPES)}")


def _loss_functions(methods: list[str], vocab: int) -> dict:
    """name -> loss function, or an error string when the method cannot run here."""
    functions = {}
    for method in methods:
        if method == "cross_entropy":
            functions[method] = _hf_cross_entropy
        elif method in _NTIL_LOSSES:
            functions[method] = lambda x, y, _f=_NTIL_LOSSES[method]: _f(x, y).loss
        elif method == "liger":
            try:
                from liger_kernel.transformers import LigerCrossEntropyLoss
            except Exception as error:  # not installed, or an import that fails on this machine
                functions[method] = f"unavailable: {type(error).__name__}: {error}"
                continue
            liger = LigerCrossEntropyLoss()
            functions[method] = lambda x, y, _f=liger: _f(x.view(-1, x.shape[-1]), y.view(-1))
        elif method == "ntloss":
            try:
                ntloss = ntloss_with_cross_entropy(vocab)
            except Exception as error:
                functions[method] = f"unavailable: {type(error).__name__}: {error}"
                continue
            functions[method] = lambda x, y, _f=ntloss: _f(x, y)
        else:
            raise ValueError(f"unknown method {method!r}; choose from {CUDA_METHODS}")
    return functions


def _time_calls(fn, leaf, labels, repeats: int, warmups: int = 3) -> tuple[float, float]:
    """(median ms, peak extra MiB) of forward + backward."""
    for _ in range(warmups):
        fn(leaf, labels).backward()
        leaf.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # per row: the peak is this method's, not the run's so far
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(leaf, labels).backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        leaf.grad = None
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def _launches(fn, leaf, labels) -> int:
    """GPU activities (kernels, memsets, copies) of one forward + backward."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(leaf, labels).backward()
        torch.cuda.synchronize()
    leaf.grad = None
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def _syncs_with_host(fn, leaf, labels) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(leaf, labels).backward()
        synced = False
    except RuntimeError as error:
        synced = "synchroniz" in str(error)
        if not synced:
            raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
        leaf.grad = None
    return synced


def _copy_floor_ms(logits: torch.Tensor, repeats: int) -> float:
    """Reading the logits once and writing a tensor of their size once, on this device."""
    out = torch.empty_like(logits)
    for _ in range(3):
        out.copy_(logits)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.copy_(logits)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del out
    return statistics.median(times)


def _append(path: str | None, row: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def run(shapes, dtypes: list[str], methods: list[str], repeats: int, jsonl: str | None = None) -> None:
    check_plan(methods, dtypes)
    methods = [m for m in BASELINES if m in methods] + [m for m in methods if m not in BASELINES]
    if not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible to torch")
    from ntil_ds.loss import vocab_stats

    started = time.time()
    device = torch.cuda.get_device_name()
    kernel = vocab_stats.kernel_module()
    triton_version = getattr(sys.modules.get("triton"), "__version__", "not installed")
    print(
        f"{device}, torch {torch.__version__}, triton {triton_version} "
        f"(NTILLoss path: {'Triton kernels' if kernel else 'torch tiles'}); forward + backward, "
        f"median of {repeats} (CUDA events); labels ~29 % digits, 30 % ignored; liger from its second "
        "call on reads the gradient it wrote in place (a streaming kernel: the same time)\n"
    )
    print("| shape [B, T, V] | logits | method | time (ms) | time / CE | time / liger | time / floor | "
          "peak extra memory (MiB) | memory / CE | launches per call | host sync |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, length, vocab in shapes:
        functions = _loss_functions(methods, vocab)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            shape = f"[{batch}, {length}, {vocab}]"
            print(f"... {shape} {dtype_name} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
            logits, labels = make_batch_cuda(batch, length, vocab, dtype)
            floor_ms = _copy_floor_ms(logits, repeats)
            print(
                f"| {shape} | {dtype_name} | floor: copy the logits once | {floor_ms:.3f} | | | 1.00 | | | | |"
            )
            row = {"shape": [batch, length, vocab], "dtype": dtype_name, "device": device}
            _append(jsonl, {**row, "method": "floor", "time_ms": floor_ms})
            baseline = liger_ms = None
            for method, fn in functions.items():
                if isinstance(fn, str):
                    print(f"| {shape} | {dtype_name} | {method} | {fn} | | | | | | | |")
                    _append(jsonl, {**row, "method": method, "error": fn})
                    continue
                # Liger overwrites its input with the gradient: a private copy (outside the timing).
                source = logits.clone() if method == "liger" else logits
                leaf = source.detach().requires_grad_()
                try:
                    ms, mib = _time_calls(fn, leaf, labels, repeats)
                    launches = _launches(fn, leaf, labels)
                    sync = _syncs_with_host(fn, leaf, labels) if method.startswith("ntil") else None
                except Exception as error:  # a failure is a finding: report it and go on
                    message = f"{type(error).__name__}: {error}".splitlines()[0][:200]
                    print(
                        f"| {shape} | {dtype_name} | {method} | failed: {message} | | | | | | | |", flush=True
                    )
                    _append(jsonl, {**row, "method": method, "error": message})
                    del leaf, source
                    torch.cuda.empty_cache()
                    continue
                if method == "cross_entropy":
                    baseline = (ms, mib)
                if method == "liger":
                    liger_ms = ms
                time_ratio = f"{ms / baseline[0]:.2f}" if baseline else "-"
                liger_ratio = f"{ms / liger_ms:.2f}" if liger_ms else "-"
                memory_ratio = f"{mib / baseline[1]:.2f}" if baseline and baseline[1] > 0 else "-"
                sync_text = "-" if sync is None else ("yes" if sync else "no")
                print(
                    f"| {shape} | {dtype_name} | {method} | {ms:.3f} | {time_ratio} | {liger_ratio} | "
                    f"{ms / floor_ms:.1f} | {mib:,.0f} | {memory_ratio} | {launches} | {sync_text} |",
                    flush=True,
                )
                _append(jsonl, {**row, "method": method, "time_ms": ms, "time_over_ce": time_ratio,
                                "time_over_liger": liger_ratio, "time_over_floor": ms / floor_ms,
                                "peak_extra_mib": mib, "launches": launches, "host_sync": sync})  # fmt: skip
                del leaf, source
                torch.cuda.empty_cache()
            del logits, labels
            torch.cuda.empty_cache()
    print(f"\n({time.time() - started:.0f} s)")
