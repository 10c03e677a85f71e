"""The loss a recipe asks for (``cfg.loss``), and what each loss cannot run on."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ntil_ds.config import Config, ConfigError
from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.loss.grouped import GroupedNTILLoss
from ntil_ds.loss.ntil import NTILLoss
from ntil_ds.loss.ntl import NTLLoss
from ntil_ds.loss.tokenizer import (
    number_sign_and_point_ids_from_tokenizer,
    number_token_table_from_tokenizer,
    single_character_digit_ids,
)

log = logging.getLogger(__name__)


def build_loss(cfg: Config, tokenizer: Any) -> NTILLoss | NTLLoss:
    """NTILLoss from ``cfg.loss``: ``ce`` is NTIL with lambda 0 (parts still reported, no gradient);
    ``emd`` drops the sequence-level terms (the paper's EMD-only baseline); ``ntl`` is that ``ce`` plus
    the ntloss package's number token loss (:mod:`ntil_ds.loss.ntl`)."""
    c = cfg.loss
    if c.name == "ntl":
        return NTLLoss(
            build_loss(replace(cfg, loss=replace(c, name="ce")), tokenizer),
            tokenizer,
            c.ntl_lambda,
            digit_level=c.ntl_digit_level,
        )
    point_id = minus_id = None
    if c.decimal_numbers or c.signed_numbers:
        try:
            minus_id, point_id = number_sign_and_point_ids_from_tokenizer(tokenizer)
        except ValueError as error:
            raise ConfigError(
                f"{error} Set loss.signed_numbers=false and loss.decimal_numbers=false for this tokenizer: "
                "cross-entropy still trains the sign and the point, NTIL then reads each number's digits."
            ) from error
    # One digit per token: NTILLoss on the ten digit ids; 1-3 digits grouped from the left: GroupedNTILLoss
    # on the tokenizer's number token table (the probe refuses anything else, saying what it found).
    table = _number_token_table(c.name, tokenizer)
    numbers = {"digit_token_ids": table[1]} if len(table) == 1 else {"number_token_table": table}
    return (NTILLoss if len(table) == 1 else GroupedNTILLoss)(
        **numbers,
        ntil_lambda=0.0 if c.name == "ce" else c.ntil_lambda,
        digit_alpha=c.digit_alpha,
        abs_alpha=0.0 if c.name == "emd" else c.abs_alpha,
        mag_alpha=0.0 if c.name == "emd" else c.mag_alpha,
        digit_exp=c.digit_exp,
        gumbel_tau=c.gumbel_tau,
        gumbel_noise_scale=c.gumbel_noise_scale,
        ignore_index=IGNORE_INDEX,
        decimal_numbers=c.decimal_numbers,
        signed_numbers=c.signed_numbers,
        decimal_point_id=point_id,
        minus_sign_id=minus_id,
        kernel=c.kernel,  # loss.name=ntl gets both through its inner ce loss (the recursion above)
        number_stage=c.number_stage,
        ntil_lambda_ramp_steps=c.ntil_lambda_ramp_steps,
        ntil_ratio=c.ntil_ratio,
    )


def _number_token_table(loss_name: str, tokenizer: Any) -> dict[int, list[int]]:
    """The number token table the loss reads. A tokenizer NTIL cannot read (groups from the right, digits
    merged with letters) is refused for every loss that trains on numbers; ``ce`` trains it all the same,
    its NTIL parts (reported, no gradient) then reading only the labels' single-character digit tokens."""
    try:
        return number_token_table_from_tokenizer(tokenizer)
    except ValueError as error:
        if loss_name != "ce":
            raise ConfigError(f"loss.name={loss_name}: {error}") from error
        try:
            table = {1: single_character_digit_ids(tokenizer)}
        except ValueError as no_digits:
            raise ConfigError(f"loss.name=ce: {no_digits}") from error
        log.warning(
            "loss.name=ce: %s The reported NTIL parts read only single-character digit labels.", error
        )
        return table


def check_loss_supports(cfg: Config, *, vocab_parallel: bool) -> None:
    """Raise ConfigError when the recipe's loss cannot run on this model's logits: ntloss needs the full
    vocabulary at every position. (Packing, which it cannot run on either, is refused by the config.)"""
    if cfg.loss.name == "ntl" and vocab_parallel:
        raise ConfigError(
            "loss.name=ntl cannot run on vocabulary-parallel logits (autotp_size > 1 shards the LM head; "
            "ntloss needs the full vocabulary): use loss.name=ntil, emd or ce, or train without tensor "
            "parallelism"
        )


def head_on_labelled_rows(cfg: Config) -> bool:
    """Whether the output head runs at the labelled positions only (``loss.logits=labelled``): every loss
    but ``ntl``, which reads the full-vocabulary logits of every position (ntloss needs them)."""
    return cfg.loss.logits == "labelled" and cfg.loss.name != "ntl"
