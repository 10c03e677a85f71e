"""NTIL for tokenizers that write 1-3 digits per token (LLaMA-3 / 4, GLM-4.xV, ...): `GroupedNTILLoss`.

The loss of docs/design/ntil_spec.md "Grouped digits" on the same two stages as `NTILLoss`: stage 1
(`vocab_stats.position_stats`: full or vocabulary-parallel logits, the torch tiles or the Triton vocabulary
kernels, the labelled head) gathers the number token table's columns (up to 1,110) instead of ten, and
stage 2 is `grouped_terms.grouped_number_terms` (torch). With the table {1: digit ids} it is `NTILLoss`.
"""

from __future__ import annotations

import functools

import torch

from ntil_ds.loss.grouped_terms import NumberTokenTable, grouped_number_terms
from ntil_ds.loss.ntil import NTILLoss
from ntil_ds.loss.number_terms import resolve_number_stage


class GroupedNTILLoss(NTILLoss):
    """`NTILLoss` reading numbers through a number token table (`NumberTokenTable` or a dict width -> the
    10**width ids of the values of that width, zero-padded spellings); every other argument is NTILLoss's.

    `number_stage`: NTILLoss's choice; "triton" (and "auto" on CUDA where Triton works) runs the grouped
    Triton number kernels (`grouped_kernel`), "eager"/"compile" the torch stage (`grouped_terms`). The
    vocabulary stage (`kernel`) is NTILLoss's: its Triton kernels gather up to 2,048 columns (widths 1-3 and
    the minus sign: 1,111), the table's ids being distinct (`vocab_kernel.SAME_ID_MAX_LANES`).
    """

    def __init__(self, number_token_table, **kwargs) -> None:
        table = NumberTokenTable.of(number_token_table)
        super().__init__(list(table.ids[1]), **kwargs)
        numbers = set(table.column_ids)
        for name in ("decimal_point_id", "minus_sign_id"):
            if getattr(self, name) is not None and getattr(self, name) in numbers:
                raise ValueError(f"{name}={getattr(self, name)} is a number token of the table.")
        self.number_token_table = table
        # Columns gathered per position: the table's, width by width, then the minus sign in signed mode.
        self._column_ids = table.column_ids + ([self.minus_sign_id] if self.minus_sign_id is not None else [])
        self._number_ids: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Grouped{super().__repr__()[:-1]}, widths={self.number_token_table.widths})"

    @property
    def noise_width(self) -> int:
        """`2 * 10**max_width` (REL's sample, then MAG's); 20, drawn identically, when the table has width 1
        only."""
        return 2 * self.number_token_table.noise_half

    def number_stage_for(self, columns: torch.Tensor) -> str:
        stage = resolve_number_stage(self.number_stage, columns.dtype, columns.device)
        return stage if stage != "triton" or grouped_kernel_module() is not None else "eager"

    def _column_map(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's ids sorted, and each one's column: labels -> columns by one searchsorted."""
        if device not in self._number_ids:
            ids = torch.tensor(self.number_token_table.column_ids, dtype=torch.long, device=device)
            self._number_ids[device] = ids.sort()
        return self._number_ids[device]

    def _number_terms(self, labels, columns, row_max, noise, unpack_index):
        _, column_ids, place_values, tables = self._device_constants(columns.device)
        number_ids = column_ids[: len(self.number_token_table.column_ids)]
        if self.number_stage_for(columns) == "triton":
            sorted_ids, order = self._column_map(columns.device)
            flat = labels.reshape(-1)
            index = torch.searchsorted(sorted_ids, flat).clamp_(max=sorted_ids.numel() - 1)
            column_map = torch.where(sorted_ids[index] == flat, order[index], -1).to(torch.int32)
            return kernel_grouped_terms(
                self._params, labels, columns, row_max, noise, unpack_index, column_map, tables,
                self.number_token_table.noise_half,
            )  # fmt: skip
        run = functools.partial(grouped_number_terms, self._params, self.number_token_table)
        if self.number_stage == "compile":
            if self._compiled_number_stage is None:  # once per instance; dynamic shapes
                self._compiled_number_stage = torch.compile(run, dynamic=True)
            run = self._compiled_number_stage
        return run(labels, columns, row_max, noise, unpack_index, number_ids, place_values)


@functools.cache
def grouped_kernel_module():
    """The grouped Triton number stage (ntil_ds.loss.grouped_kernel), or None where triton does not import."""
    try:
        from ntil_ds.loss import grouped_kernel
    except ImportError:
        return None
    return grouped_kernel


def kernel_grouped_terms(
    params, labels, columns, row_max, noise, unpack_index, column_map, tables, noise_half
):
    """`grouped_number_terms` on the Triton kernels (`grouped_kernel`): the same outputs, differentiable in
    `columns` `[N, K]` (fp32); two launches forward, a zero fill and one launch backward."""
    columns = columns.contiguous()
    noise = None if noise is None else noise.contiguous()
    unpack_index = None if unpack_index is None else unpack_index.contiguous()
    return _KernelGroupedTerms.apply(
        columns, labels.contiguous(), row_max.contiguous(), noise, unpack_index, column_map, tables,
        (params, noise_half),
    )  # fmt: skip


class _KernelGroupedTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, columns, labels, row_max, noise, unpack_index, column_map, tables, static):
        ctx.set_materialize_grads(False)
        params, noise_half = static
        ntil, parts, saved = grouped_kernel_module().forward(
            params, labels, columns, row_max, noise, unpack_index, column_map, tables, noise_half
        )
        ctx.static = static
        ctx.save_for_backward(columns, noise, unpack_index, tables, *saved)
        return ntil, parts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ntil, grad_parts):
        columns, noise, unpack_index, tables, *saved = ctx.saved_tensors
        params, noise_half = ctx.static
        grad_columns = grouped_kernel_module().backward(
            params, grad_ntil, grad_parts, columns, noise, unpack_index, tables, noise_half, saved
        )
        return grad_columns, None, None, None, None, None, None, None
