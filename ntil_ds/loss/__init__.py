"""NTIL + cross-entropy, on full or vocabulary-parallel logits (torch; fused Triton kernels on CUDA)."""

from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.grouped_terms import NumberTokenTable
from ntil_ds.loss.ntil import NTILLoss, NTILOutput
from ntil_ds.loss.tokenizer import (
    NumberTokenization,
    digit_token_ids_from_tokenizer,
    number_sign_and_point_ids_from_tokenizer,
    number_token_ids,
    number_token_table_from_tokenizer,
    probe_number_tokenization,
)

__all__ = [
    "GroupedNTILLoss",
    "NTILLoss",
    "NTILOutput",
    "NumberTokenTable",
    "NumberTokenization",
    "digit_token_ids_from_tokenizer",
    "number_sign_and_point_ids_from_tokenizer",
    "number_token_ids",
    "number_token_table_from_tokenizer",
    "probe_number_tokenization",
]
