"""Stage 1 of the loss: the only part that touches the vocabulary dimension.

For every position with a label it returns the cross-entropy `lse - z[target]` and the logits of a few
fixed columns (the ten digits, and the minus sign when signed numbers are on); positions without one
get fixed fills (`unlabelled_rows_filled`), and the Triton kernels skip their rows (no read, zeros
written to their gradient), as Liger's cross-entropy does. The same code runs on the
full vocabulary (`process_group=None`) or on one rank's vocabulary shard, in which case the ranks
exchange O(positions) numbers, never logits.

Collectives per call with a process group (N = B*T positions, K = gathered columns, fp32):
  1. all_reduce MAX  [N]                      the row maximum (detached: it only shifts the exp)
  2. all_reduce SUM  [N, 3 + K (+ P)]         per row: sum of exp, target logit, "target owned"
                                              flag, the K column logits, and an optional payload
                                              of P numbers per row from the group's first rank
                                              (the Gumbel noise rides here instead of a broadcast)
Each value in the SUM is non-zero on exactly one rank except the sum of exp, so the gathered
logits and the payload arrive bit-exact. The backward needs no communication: every rank holds the
same upstream gradient and computes the gradient of its own slice.

Memory: nothing of size [N, V_local] is allocated in the forward beyond one tile; the backward
recomputes the softmax tile by tile from the logits themselves (saved by reference, no copy) and
writes straight into the gradient.

Two implementations of the per-row work, same contract: CUDA logits (fp32/bf16/fp16) go to the fused
Triton kernels of `vocab_kernel` when Triton works on the device (one launch forward, one backward;
`kernel_choice` probes that once per process); everything else (CPU, fp64, CUDA without a working
Triton) runs the torch tiles below. The caller's `kernel` argument
("auto", the default, "torch" or "triton"; `NTILLoss(kernel=...)`, `loss.kernel` in a recipe) overrides
the choice; the collectives are the same either way.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.distributed as dist

from ntil_ds.loss import kernel_choice

# CPU: rows are processed in tiles of about this many elements (4 MiB in fp32): large enough that the
# Python loop over tiles costs little, small enough that a tile stays in cache between the max, exp
# and sum passes (measured best of 2**16..2**22 on [4096, 32000] logits).
TILE_ELEMENTS = 1 << 20
# CUDA without Triton: each tile costs ~10 launches, so tiles must be large (measured on an H200 at
# [4, 2048, 151936] bf16: 2**20 elements gave 22,146 launches and 23x CE's time, 2**24 2.0x, 2**28
# 1.74x). The fp32 tile and its temporaries take ~3 copies of it: 1/256 of the device's memory each.
CUDA_TILE_ELEMENTS_RANGE = (1 << 22, 1 << 26)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_CHOICES = ("auto", "torch", "triton")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss computes in fp32, or fp64 when given fp64 (for gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def _cuda_tile_elements(device_index: int) -> int:
    low, high = CUDA_TILE_ELEMENTS_RANGE
    share = torch.cuda.get_device_properties(device_index).total_memory // (256 * 4)
    return max(low, min(high, 1 << max(0, share.bit_length() - 1)))


def tile_elements(device: torch.device) -> int:
    """Elements per row tile of the torch path on this device."""
    if device.type == "cuda":
        return _cuda_tile_elements(device.index if device.index is not None else torch.cuda.current_device())
    return TILE_ELEMENTS


def _row_tiles(num_rows: int, row_width: int, device: torch.device) -> list[tuple[int, int]]:
    rows = max(1, tile_elements(device) // max(1, row_width))
    return [(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


@functools.cache
def kernel_module() -> ModuleType | None:
    """The Triton kernels (ntil_ds.loss.vocab_kernel), or None where triton does not import."""
    try:
        from ntil_ds.loss import vocab_kernel
    except ImportError:  # no Triton (it is an extra): the torch path
        return None
    return vocab_kernel


def check_kernel_choice(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise ValueError(
            f"kernel={kernel!r}: expected one of {', '.join(map(repr, KERNEL_CHOICES))} (auto: the Triton "
            "kernels for CUDA logits where Triton works, else the torch path)."
        )


def kernel_wanted(logits: torch.Tensor, kernel: str = "auto") -> ModuleType | None:
    """The Triton kernel module when it should run on these logits, else None (the torch path).
    `kernel`: "auto" (the kernels for CUDA logits where Triton works, see `kernel_choice`), "torch" (always
    the torch path) or "triton" (the kernels; an error without Triton)."""
    check_kernel_choice(kernel)
    # fp64 (gradcheck) always takes the torch path: the kernels compute in fp32.
    if kernel == "torch" or logits.dtype not in _KERNEL_DTYPES:
        return None
    # auto: only where a trivial kernel has compiled and launched on this device (once per process), so
    # that a machine without a C compiler or Python headers gets the torch path, with one warning, instead
    # of an error at the first step. "triton" skips the probe: its launch raises the original error.
    if kernel == "auto" and not kernel_choice.auto_uses_triton(logits.device, "the vocabulary stage"):
        return None
    module = kernel_module()
    if module is None and kernel == "triton":
        raise RuntimeError(
            "kernel='triton' but triton does not import: pip install 'ntil-ds[kernels]' "
            "(CUDA builds of torch bring it), or choose kernel='auto' or 'torch' (loss.kernel in a recipe)."
        )
    return module


def row_partials(
    logits: torch.Tensor, targets: torch.Tensor, column_ids: torch.Tensor, vocab_start: int, kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of every row: ``(local_max [R], packed [R, 3 + K])``, packed as the SUM
    all-reduce lays it out (sum of exp relative to local_max, target logit, "target owned" flag, the K
    column logits). ``kernel``: the Triton module, or None for the torch tiles."""
    num_columns = column_ids.numel()
    if kernel is not None:
        rows = _rows_contiguous(logits)
        return kernel.forward_partials(rows, targets.contiguous(), column_ids, vocab_start, 3 + num_columns)
    num_rows, local_vocab = logits.shape
    device, dtype = logits.device, compute_dtype(logits.dtype)
    local_max = torch.empty(num_rows, dtype=dtype, device=device)
    local_sum_exp = torch.empty(num_rows, dtype=dtype, device=device)
    for start, stop in _row_tiles(num_rows, local_vocab, device):
        tile = logits[start:stop].to(dtype)
        tile_max = tile.amax(dim=-1)
        local_max[start:stop] = tile_max
        # bf16/fp16 input: `tile` is already a private fp32 copy, shift it in place;
        # fp32/fp64 input: `tile` is a view of the caller's logits, so shift into a temporary.
        is_view = logits.dtype == dtype
        shifted = tile - tile_max[:, None] if is_view else tile.sub_(tile_max[:, None])
        local_sum_exp[start:stop] = shifted.exp_().sum(dim=-1)
    owned, local_target, column_is_local, local_columns = _local_indices(
        targets, column_ids, vocab_start, local_vocab
    )
    target_logit = logits.gather(1, local_target[:, None]).squeeze(1).to(dtype) * owned
    # Every rank gathers all K columns (clamped into its shard) and zeroes those it does not own:
    # on-device index math, so no host-to-device copy (a sync on CUDA) per call.
    columns = torch.where(column_is_local, logits.index_select(1, local_columns).to(dtype), 0.0)
    parts = [local_sum_exp[:, None], target_logit[:, None], owned.to(dtype)[:, None], columns]
    return local_max, torch.cat(parts, dim=1)


def reduce_rows(
    local_max: torch.Tensor,
    packed: torch.Tensor,
    targets: torch.Tensor,
    num_columns: int,
    process_group: dist.ProcessGroup | None,
    payload: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every rank's parts of the rows combined (the module docstring's two all-reduces; none without a
    group): ``(ce, columns, row_max, log_sum_exp, payload)``. ``packed`` is consumed."""
    row_max = local_max
    if process_group is not None:
        row_max = local_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=process_group)
    packed[:, 0] *= torch.exp(local_max - row_max)
    if payload is not None:
        packed = torch.cat([packed, payload.to(packed.dtype).reshape(packed.shape[0], -1)], dim=1)
    if process_group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
    return _finish_rows(packed, row_max, targets >= 0, num_columns, payload)


def full_row_stats(
    logits: torch.Tensor, targets: torch.Tensor, column_ids: torch.Tensor, kernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows over the whole vocabulary (no group): ``(ce, columns, row_max, log_sum_exp)``; one fused
    launch on the kernels."""
    if kernel is not None:
        return kernel.forward_full(_rows_contiguous(logits), targets.contiguous(), column_ids)
    local_max, packed = row_partials(logits, targets, column_ids, 0, None)
    ce, columns, row_max, log_sum_exp, _ = reduce_rows(
        local_max, packed, targets, column_ids.numel(), None, None
    )
    return ce, columns, row_max, log_sum_exp


def logits_gradient(
    logits: torch.Tensor,
    log_sum_exp: torch.Tensor,
    targets: torch.Tensor,
    column_ids: torch.Tensor,
    vocab_start: int,
    grad_ce: torch.Tensor | None,
    grad_columns: torch.Tensor | None,
    kernel,
) -> torch.Tensor:
    """The gradient of this rank's logits (in their dtype) from the gradients of the rows' CE and
    columns: ``softmax * dCE``, less ``dCE`` at the target, plus ``dcolumns`` at the columns; an
    unlabelled row gets 0."""
    if kernel is not None:
        rows = _rows_contiguous(logits)
        return kernel.backward(
            rows, targets.contiguous(), log_sum_exp, column_ids, vocab_start, grad_ce, grad_columns
        )
    num_rows, local_vocab = logits.shape
    owned, local_target, column_is_local, local_columns = _local_indices(
        targets, column_ids, vocab_start, local_vocab
    )
    # Unlabelled rows have a constant CE of 0: whatever flows into them stops here.
    dtype = log_sum_exp.dtype
    valid = targets >= 0
    grad_ce = grad_ce.to(dtype) * valid if grad_ce is not None else torch.zeros_like(log_sum_exp)
    grad_logits = torch.empty_like(logits)
    same_dtype = logits.dtype == dtype
    target_grad = -(grad_ce * owned)
    if grad_columns is not None:  # columns of other shards (and of unlabelled rows: constant) add 0
        grad_columns = torch.where(column_is_local & valid[:, None], grad_columns.to(dtype), 0.0)
    for start, stop in _row_tiles(num_rows, local_vocab, logits.device):
        # softmax * dCE, computed in fp32, straight into the gradient when it is fp32.
        out = grad_logits[start:stop] if same_dtype else None
        tile = torch.sub(logits[start:stop].to(dtype), log_sum_exp[start:stop, None], out=out)
        tile.exp_().mul_(grad_ce[start:stop, None])
        tile.scatter_add_(1, local_target[start:stop, None], target_grad[start:stop, None])
        if grad_columns is not None:
            tile.index_add_(1, local_columns, grad_columns[start:stop])
        if not same_dtype:
            grad_logits[start:stop].copy_(tile)
    return grad_logits


def _local_indices(targets: torch.Tensor, column_ids: torch.Tensor, vocab_start: int, local_vocab: int):
    """(target owned [R], local target [R], column is local [K], local column [K]) in this slice."""
    local_end = vocab_start + local_vocab
    owned = (targets >= 0) & (targets >= vocab_start) & (targets < local_end)
    local_target = torch.where(owned, targets - vocab_start, 0)
    column_is_local = (column_ids >= vocab_start) & (column_ids < local_end)
    local_columns = (column_ids - vocab_start).clamp(0, local_vocab - 1)
    return owned, local_target, column_is_local, local_columns


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    """The kernels walk rows with unit stride."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


class _PositionStats(torch.autograd.Function):
    """(logits [N, V_local]) -> ce [N], column_logits [N, K]; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        column_ids: torch.Tensor,
        vocab_start: int,
        process_group: dist.ProcessGroup | None,
        payload: torch.Tensor | None,
        kernel_choice: str,
    ):
        # Outputs without a gradient (row_max, the payload; the columns when NTIL is off) get None in the
        # backward instead of zero tensors: no fills, and the kernels skip the work (HAS_*_GRAD).
        ctx.set_materialize_grads(False)
        kernel = kernel_wanted(logits, kernel_choice)
        ctx.kernel, ctx.vocab_start = kernel, vocab_start
        if process_group is None:
            ce, columns, row_max, log_sum_exp = full_row_stats(logits, targets, column_ids, kernel)
            payload_out = None if payload is None else payload.to(compute_dtype(logits.dtype), copy=True)
        else:
            local_max, packed = row_partials(logits, targets, column_ids, vocab_start, kernel)
            ce, columns, row_max, log_sum_exp, payload_out = reduce_rows(
                local_max, packed, targets, column_ids.numel(), process_group, payload
            )
        ctx.save_for_backward(logits, log_sum_exp, targets, column_ids)
        ctx.mark_non_differentiable(row_max, *([] if payload_out is None else [payload_out]))
        return ce, columns, row_max, payload_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ce, grad_columns, _grad_row_max, _grad_payload):
        logits, log_sum_exp, targets, column_ids = ctx.saved_tensors
        grad_logits = logits_gradient(
            logits, log_sum_exp, targets, column_ids, ctx.vocab_start, grad_ce, grad_columns, ctx.kernel
        )
        return grad_logits, None, None, None, None, None, None


def _finish_rows(
    packed: torch.Tensor, row_max: torch.Tensor, valid: torch.Tensor, num_columns: int, payload
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ce, columns, row max, log-sum-exp and payload from the reduced SUM buffer (both implementations)."""
    sum_exp, target_logit, owned_anywhere = packed[:, 0], packed[:, 1], packed[:, 2]
    columns = packed[:, 3 : 3 + num_columns].contiguous()
    payload_out = packed[:, 3 + num_columns :].contiguous() if payload is not None else None

    log_sum_exp = row_max + sum_exp.log()
    # A valid label owned by no rank is outside the vocabulary; owned by several, the shards
    # overlap (wrong vocab_start). NaN makes either visible: raising would need a host sync.
    ce = torch.where(valid, log_sum_exp - target_logit, 0.0)
    ce = torch.where(valid & ((owned_anywhere - 1.0).abs() > 0.5), float("nan"), ce)
    columns, row_max = unlabelled_rows_filled(valid, columns, row_max)
    return ce, columns, row_max, log_sum_exp, payload_out


def unlabelled_rows_filled(
    valid: torch.Tensor, columns: torch.Tensor, row_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract at rows without a label, whichever path computed them (the kernels do not read those
    rows, the labelled head never forms them): columns 0, row max +inf (no column reaches it, so the
    position never reads as a minus sign)."""
    columns = torch.where(valid[:, None], columns, 0.0)
    row_max = torch.where(valid, row_max, float("inf"))
    return columns, row_max


def position_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    column_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    process_group: dist.ProcessGroup | None = None,
    payload: torch.Tensor | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-position cross-entropy and column logits over a (possibly sharded) vocabulary.

    Args:
        logits: `[N, V_local]`, any float dtype; this rank's columns
            `[vocab_start, vocab_start + V_local)` of the global vocabulary.
        targets: `[N]` global token ids; negative means "no label" (CE 0, no gradient).
        column_ids: `[K]` int64 global ids of the columns to return (e.g. the ten digits), on the
            logits' device; K <= 2,048 on the Triton kernels, and past 1,024 the ids must be distinct
            (`vocab_kernel.SAME_ID_MAX_LANES`).
        process_group: the vocabulary-parallel group, or None for the full vocabulary.
        payload: optional `[N, P]` numbers that the group's first rank sends to all ranks (only
            that rank's values are used; others may pass anything of the same shape).
        kernel: "auto" (the Triton kernels for CUDA logits in fp32/bf16/fp16 where Triton works, else
            the torch tiles), "torch" or "triton" (see `kernel_wanted`).

    Returns:
        ce `[N]` in `compute_dtype` (0 where unlabelled, NaN where the label is outside the
        vocabulary), column logits `[N, K]` (differentiable; 0 where unlabelled), the global row max `[N]`
        (no gradient; +inf where unlabelled), and the payload as received (or None). An unlabelled row's
        logits get gradient 0; the Triton kernels do not read them at all.
    """
    if payload is not None and process_group is not None and dist.get_rank(process_group) != 0:
        payload = torch.zeros_like(payload)
    return _PositionStats.apply(logits, targets, column_ids, vocab_start, process_group, payload, kernel)
