"""NTIL + cross-entropy, on full or vocabulary-parallel logits (torch; fused Triton kernels on CUDA)."""

from ntil_ds.loss.ntil import NTILLoss, NTILOutput
from ntil_ds.loss.tokenizer import (
    digit_token_ids_from_tokenizer,
    number_sign_and_point_ids_from_tokenizer,
    number_token_ids,
)

__all__ = [
    "NTILLoss",
    "NTILOutput",
    "digit_token_ids_from_tokenizer",
    "number_sign_and_point_ids_from_tokenizer",
    "number_token_ids",
]
