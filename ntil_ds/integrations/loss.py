"""The one NTIL loss object, built outside the recipe: what ``launch/train.py`` builds from ``loss.*``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ntil_ds.config import Config, LossConfig
from ntil_ds.data.processor import tokenizer_of
from ntil_ds.loss import NTILLoss
from ntil_ds.loss.build import build_loss
from ntil_ds.loss.ntl import NTLLoss
from ntil_ds.typed_config import build


def ntil_loss(tokenizer_or_processor: Any, **loss_keys: Any) -> NTILLoss | NTLLoss:
    """The loss of a recipe whose ``loss`` section holds ``loss_keys`` (``ntil_lambda=0.3``, ``name="emd"``,
    ``digit_alpha=0``, ``kernel="torch"``, ...; a ``loss.`` prefix is allowed), for this tokenizer: single-digit
    tokenizers get :class:`NTILLoss`, those grouping 1-3 digits the grouped loss, and a tokenizer NTIL cannot
    read (digits merged with letters, groups from the right) the recipe's ``ConfigError`` saying so. An unknown
    key is a ``ConfigError`` naming the valid ones.

    Call it as ``loss(logits [B, T, V], targets [B, T])`` with *aligned* targets (``targets[t]`` is the token at
    ``t + 1``, -100 where nothing is trained): it returns :class:`~ntil_ds.loss.NTILOutput` (``loss``,
    ``loss_sum``, ``ce_mean``, ``emd``, ``rel``, ``mag``, ``num_tokens``)."""
    keys = {key.removeprefix("loss."): value for key, value in loss_keys.items()}
    loss_config: LossConfig = build(LossConfig, keys, prefix="loss.")
    return build_loss(replace(Config(), loss=loss_config), tokenizer_of(tokenizer_or_processor))
