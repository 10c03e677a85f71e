"""Fused Triton kernels for stage 1 of the loss (`vocab_stats.position_stats`) on CUDA.

One program per row (position). Forward: a single pass over the row's logits keeps an online max and
sum of exponentials (rescaled whenever the max grows), so the row is read once in its own dtype and
never upcast as a whole; the target logit and the K gathered columns (the digits, the minus sign) are
K + 1 scalar loads from the same row, issued before that pass so that their latency overlaps it. Backward: a second pass recomputes
`softmax * dCE`, subtracts `dCE` at the target and writes the gradient once, in the logits' dtype; then,
after a barrier that orders those stores, the K column entries are rewritten with the column gradients
added (the pattern of Triton's and Liger-Kernel's cross-entropy kernels, which patch the target entry
the same way). Traffic: the logits are read twice and the gradient written once; nothing of size
`[N, V]` besides the gradient is allocated, and nothing is computed in fp64.

Without a process group the forward kernel also finishes the row (log-sum-exp, CE, the NaN rules) so
that stage 1 is one launch forward and one backward. With a process group it writes per-rank partials in
the layout of the SUM all-reduce of `vocab_stats`, which then does the two all-reduces as before.

Used automatically for CUDA logits in fp32/bf16/fp16 where Triton works (see `kernel_wanted`); the
argument kernel="torch"|"triton"|"auto" (default auto) of `NTILLoss` / `position_stats` forces a path.
`triton` on CPU tensors needs Triton's own TRITON_INTERPRET=1 set before this module is imported (the tests
do that in subprocesses).
Written for triton >= 3.2.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

# (largest vocabulary block, warps) per program, by compute capability. From the compile check
# (tests/unit/test_kernel_compile.py; the sweep is in docs/loss.md): on sm_80, sm_90 and sm_100 alike, the
# configuration with the most resident warps per SM (registers per thread x threads, 64K registers an SM)
# and 0 spills, ties going to the larger block (fewer block reductions per row). Forward: 16384 / 32 warps,
# 31-37 registers, 2 programs = 64 warps an SM (32768 / 32 and 16384 / 16 give 32). Backward: 32768 / 32
# warps, 64 registers, 32 warps an SM (16384 / 16, as before: 88-128 registers, 16 warps). Liger's
# cross-entropy uses 32 warps with 32768 blocks. Other GPUs (sm_86/89/120: fewer threads an SM) keep
# 16384 / 16, which fits every architecture.
LAUNCH = {cc: {"forward": (16384, 32), "backward": (32768, 32)} for cc in (80, 90, 100)}
DEFAULT_LAUNCH = {"forward": (16384, 16), "backward": (16384, 16)}
# Tests: a smaller largest block, to cross block edges on small vocabularies in the interpreter.
MAX_BLOCK: int | None = None
# Columns are handled as one padded vector of this many lanes (ten digits + minus sign fit).
_MIN_COLUMN_LANES = 16
# Up to this many lanes the backward adds the gradients of repeated column ids through a [lanes, lanes]
# same-id matrix (any ids); beyond it (a grouped-digit table with 3-digit tokens: 1,110 columns, 2,048
# lanes, whose matrix would be 4M elements, over Triton's 2**20 limit) the ids must be distinct, as every
# loss's are (a number token table has distinct ids, the minus sign is not one of them), and each lane adds
# its own gradient.
SAME_ID_MAX_LANES = 1024
# The most columns the kernels take (widths 1-3 plus the minus sign: 1,111).
MAX_COLUMN_LANES = 2048

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _capability(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def launch_config(device: torch.device, kernel: str) -> tuple[int, int]:
    """(largest block, warps) of the "forward" or "backward" kernel on this device (see LAUNCH)."""
    if device.type != "cuda":  # the interpreter
        block, warps = DEFAULT_LAUNCH[kernel]
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        block, warps = LAUNCH.get(_capability(index), DEFAULT_LAUNCH)[kernel]
    return (MAX_BLOCK or block), warps


def _block(local_vocab: int, largest: int) -> int:
    return min(largest, triton.next_power_of_2(max(local_vocab, 16)))


def _column_lanes(num_columns: int) -> int:
    lanes = max(_MIN_COLUMN_LANES, triton.next_power_of_2(max(num_columns, 1)))
    if lanes > MAX_COLUMN_LANES:
        raise ValueError(f"the vocabulary kernels take at most {MAX_COLUMN_LANES} columns, got {num_columns}")
    return lanes


def _interpreting() -> bool:
    # Under TRITON_INTERPRET=1 at definition time, `triton.jit` returns an interpreted function instead of
    # a JITFunction: asking the kernel itself tells what will run (the variable may have changed since).
    return not isinstance(_forward_kernel, triton.runtime.JITFunction)


@triton.jit
def _forward_kernel(
    logits_ptr,
    logits_stride,
    targets_ptr,
    column_ids_ptr,
    num_columns,
    vocab_start,
    local_vocab,
    max_ptr,  # [N] fp32: the row max (FINALIZE) or this rank's row max
    columns_ptr,  # FINALIZE: [N, K] column logits; else the packed [N, W] all-reduce buffer
    columns_stride,
    ce_ptr,  # FINALIZE only: [N] cross-entropy
    lse_ptr,  # FINALIZE only: [N] log-sum-exp
    FINALIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    LANES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    offsets = tl.arange(0, BLOCK)

    # The target logit and the K column logits first: issued before the streaming loop, their latency
    # overlaps it (after the loop a long row has left L2 and they would be extra DRAM round trips).
    # A row without a label is not read (its loss is 0 and nothing downstream reads its stats): no
    # column loads, an empty vocabulary loop, and the contract's fill values stored (see the end).
    # Target logit: 0 where this rank does not own the label.
    target = tl.load(targets_ptr + row)
    valid = target >= 0
    row_vocab = tl.where(valid, local_vocab, 0)
    owned = valid & (target >= vocab_start) & (target < vocab_start + local_vocab)
    local_target = tl.where(owned, target - vocab_start, 0)
    target_logit = tl.load(row_ptr + local_target, mask=owned, other=0.0).to(tl.float32)
    target_logit = tl.where(owned, target_logit, 0.0)

    # The K gathered columns as one padded vector; columns of other shards read as 0.
    lanes = tl.arange(0, LANES)
    column_ids = tl.load(column_ids_ptr + lanes, mask=lanes < num_columns, other=-1)
    is_local = valid & (column_ids >= vocab_start) & (column_ids < vocab_start + local_vocab)
    local_columns = tl.where(is_local, column_ids - vocab_start, 0)
    column_logits = tl.load(row_ptr + local_columns, mask=is_local, other=0.0).to(tl.float32)
    column_logits = tl.where(is_local, column_logits, 0.0)

    # Online max / sum of exp over the row, block by block; the sum is rescaled when the max grows.
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, row_vocab, BLOCK):
        cols = start + offsets
        x = tl.load(row_ptr + cols, mask=cols < local_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max

    out_row = columns_ptr + row * columns_stride
    if FINALIZE:
        # Unlabelled: row max +inf (no column reaches it: the position never reads as a minus sign),
        # CE 0, columns 0, log-sum-exp -inf (never read: the backward skips the row too).
        tl.store(max_ptr + row, tl.where(valid, running_max, float("inf")))
        log_sum_exp = running_max + tl.log(running_sum)
        ce = tl.where(valid, log_sum_exp - target_logit, 0.0)
        # A valid label outside the vocabulary: NaN instead of an error (an error would need a host sync).
        ce = tl.where(valid & (owned == 0), float("nan"), ce)
        tl.store(ce_ptr + row, ce)
        tl.store(lse_ptr + row, log_sum_exp)
        tl.store(out_row + lanes, column_logits, mask=lanes < num_columns)
    else:
        # Unlabelled: max 0 and every part 0, so the reduction stays finite (vocab_stats fills the rest).
        tl.store(max_ptr + row, tl.where(valid, running_max, 0.0))
        # The SUM all-reduce's layout: sum of exp (relative to this rank's max), target logit, owned
        # flag, then the K columns (see vocab_stats).
        tl.store(out_row, running_sum)
        tl.store(out_row + 1, target_logit)
        tl.store(out_row + 2, owned.to(tl.float32))
        tl.store(out_row + 3 + lanes, column_logits, mask=lanes < num_columns)


@triton.jit
def _backward_kernel(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    targets_ptr,
    lse_ptr,
    grad_ce_ptr,
    grad_ce_stride,
    grad_columns_ptr,
    grad_columns_stride_row,
    grad_columns_stride_col,
    column_ids_ptr,
    num_columns,
    vocab_start,
    local_vocab,
    HAS_CE_GRAD: tl.constexpr,
    HAS_COLUMN_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    LANES: tl.constexpr,
    DISTINCT_IDS: tl.constexpr,  # LANES > SAME_ID_MAX_LANES: no same-id matrix (see there)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    grad_row_ptr = grad_ptr + row * grad_stride
    offsets = tl.arange(0, BLOCK)

    target = tl.load(targets_ptr + row)
    valid = target >= 0
    owned = valid & (target >= vocab_start) & (target < vocab_start + local_vocab)
    local_target = tl.where(owned, target - vocab_start, -1)
    log_sum_exp = tl.load(lse_ptr + row, mask=valid, other=0.0)  # not formed for an unlabelled row
    # Unlabelled rows have a constant CE of 0: whatever flows into them stops here.
    grad_ce = 0.0
    if HAS_CE_GRAD:
        grad_ce = tl.load(grad_ce_ptr + row * grad_ce_stride).to(tl.float32)
    grad_ce = tl.where(valid, grad_ce, 0.0)

    # An unlabelled row gets zeros without a read of its logits.
    for start in range(0, local_vocab, BLOCK):
        cols = start + offsets
        in_row = cols < local_vocab
        x = tl.load(row_ptr + cols, mask=in_row & valid, other=0.0).to(tl.float32)
        grad = tl.where(valid, tl.exp(x - log_sum_exp) * grad_ce, 0.0)
        grad = grad - tl.where(cols == local_target, grad_ce, 0.0)
        tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row)

    if HAS_COLUMN_GRAD:
        # The stores above must land before the column entries are rewritten (other threads of this
        # program may have written them).
        tl.debug_barrier()
        lanes = tl.arange(0, LANES)
        in_lanes = lanes < num_columns
        column_ids = tl.load(column_ids_ptr + lanes, mask=in_lanes, other=-1)
        # Unlabelled rows: the columns are constant 0 there (forward), so no gradient flows in.
        is_local = valid & in_lanes & (column_ids >= vocab_start) & (column_ids < vocab_start + local_vocab)
        local_columns = tl.where(is_local, column_ids - vocab_start, 0)
        grad_columns = tl.load(
            grad_columns_ptr + row * grad_columns_stride_row + lanes * grad_columns_stride_col,
            mask=is_local,
            other=0.0,
        ).to(tl.float32)
        grad_columns = tl.where(is_local, grad_columns, 0.0)
        # Each entry from scratch (no read-modify-write): the same formula as the loop, plus the sum
        # of the column gradients of every lane with this id (ids may repeat in position_stats).
        x = tl.load(row_ptr + local_columns, mask=is_local, other=0.0).to(tl.float32)
        grad = tl.exp(x - log_sum_exp) * grad_ce
        grad = grad - tl.where(local_columns == local_target, grad_ce, 0.0)
        if DISTINCT_IDS:
            grad = grad + grad_columns
        else:
            same_id = column_ids[:, None] == column_ids[None, :]
            grad = grad + tl.sum(tl.where(same_id, grad_columns[None, :], 0.0), axis=1)
        tl.store(grad_row_ptr + local_columns, grad.to(grad_ptr.dtype.element_ty), mask=is_local)


def on_device(tensor: torch.Tensor):
    """Launch on the tensor's own GPU, not the current one."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _check_device(logits: torch.Tensor) -> None:
    if not logits.is_cuda and not _interpreting():
        raise RuntimeError(
            f"the Triton loss kernel got logits on {logits.device}: it runs on CUDA, or on CPU tensors only "
            "under Triton's interpreter (TRITON_INTERPRET=1 set before ntil_ds.loss.vocab_kernel is "
            "imported); pass kernel='auto' or 'torch' (loss.kernel in a recipe) to use the torch path."
        )


def forward_full(
    logits: torch.Tensor, targets: torch.Tensor, column_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full vocabulary: (ce [N], columns [N, K], row_max [N], log_sum_exp [N]), fp32, one launch."""
    _check_device(logits)
    num_rows, vocab = logits.shape
    num_columns = column_ids.numel()
    device = logits.device
    ce = torch.empty(num_rows, dtype=torch.float32, device=device)
    log_sum_exp = torch.empty_like(ce)
    row_max = torch.empty_like(ce)
    columns = torch.empty(num_rows, num_columns, dtype=torch.float32, device=device)
    largest, warps = launch_config(device, "forward")
    if num_rows:
        with on_device(logits):
            _forward_kernel[(num_rows,)](
                logits, logits.stride(0), targets, column_ids, num_columns, 0, vocab,
                row_max, columns, columns.stride(0), ce, log_sum_exp,
                FINALIZE=True, BLOCK=_block(vocab, largest), LANES=_column_lanes(num_columns), num_warps=warps,
            )  # fmt: skip
    return ce, columns, row_max, log_sum_exp


def forward_partials(
    logits: torch.Tensor, targets: torch.Tensor, column_ids: torch.Tensor, vocab_start: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One vocabulary shard: (local_max [N], packed [N, width]) with packed[:, :3 + K] filled as
    `vocab_stats` lays out the SUM all-reduce (sum of exp relative to local_max, target logit, owned
    flag, the columns; the caller fills the payload columns and rescales the sum)."""
    _check_device(logits)
    num_rows, local_vocab = logits.shape
    num_columns = column_ids.numel()
    local_max = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    packed = torch.empty(num_rows, width, dtype=torch.float32, device=logits.device)
    largest, warps = launch_config(logits.device, "forward")
    if num_rows:
        with on_device(logits):
            _forward_kernel[(num_rows,)](
                logits, logits.stride(0), targets, column_ids, num_columns, vocab_start, local_vocab,
                local_max, packed, packed.stride(0), packed, packed, FINALIZE=False,
                BLOCK=_block(local_vocab, largest), LANES=_column_lanes(num_columns), num_warps=warps,
            )  # fmt: skip
    return local_max, packed


def backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    log_sum_exp: torch.Tensor,
    column_ids: torch.Tensor,
    vocab_start: int,
    grad_ce: torch.Tensor | None,
    grad_columns: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient of the logits (their dtype and shape) from the CE and column gradients; one launch."""
    num_rows, local_vocab = logits.shape
    num_columns = column_ids.numel()
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if not num_rows:
        return grad_logits
    # Absent gradients: pass any tensor as the pointer, the constexpr flag skips its loads.
    ce_arg = grad_ce if grad_ce is not None else log_sum_exp
    columns_arg = grad_columns if grad_columns is not None else log_sum_exp[:, None]
    largest, warps = launch_config(logits.device, "backward")
    lanes = _column_lanes(num_columns)
    with on_device(logits):
        _backward_kernel[(num_rows,)](
            logits, logits.stride(0), grad_logits, grad_logits.stride(0), targets, log_sum_exp,
            ce_arg, ce_arg.stride(0), columns_arg, columns_arg.stride(0), columns_arg.stride(1),
            column_ids, num_columns, vocab_start, local_vocab,
            HAS_CE_GRAD=grad_ce is not None, HAS_COLUMN_GRAD=grad_columns is not None,
            BLOCK=_block(local_vocab, largest), LANES=lanes, DISTINCT_IDS=lanes > SAME_ID_MAX_LANES,
            num_warps=warps,
        )  # fmt: skip
    return grad_logits
