"""`loss.name=ntl`: cross-entropy plus the Wasserstein Number Token Loss of the `ntloss` package
(Zausinger et al., ICML 2025), the nearest published peer of NTIL, so the two can be compared on the same
trainer, data and steps.

    loss_sum = ce_sum + ntl_lambda * sum over digit-labelled positions of NTL_t

where `NTL_t` is ntloss's per-token Wasserstein distance between the predicted distribution over the
digit tokens and the label digit (with its default reweighing by the probability mass on digits). The
trainer divides `loss_sum` by the step's global count of labelled tokens, like the cross-entropy, so
every labelled token weighs the same however the batch is split over micro-batches and ranks (ntloss's
own `reduction="mean"` would average over each micro-batch's digits instead, which changes with the
split). NTIL and its parts are still computed and reported (without gradient), as for `loss.name=ce`.

`ntloss` is optional (`pip install ntil-ds[ntl]`); it needs the full vocabulary at every position (its
reweighing takes a softmax over all tokens), so it refuses vocabulary-parallel logit shards.
"""

from __future__ import annotations

from typing import Any

import torch

from ntil_ds.loss.ntil import NTILLoss, NTILOutput

NTLOSS_REQUIREMENT = "ntloss==0.3.2"


class NTLUnavailableError(ImportError):
    """`loss.name=ntl` without the `ntloss` package installed."""


def _import_ntloss():
    try:
        import ntloss
    except ImportError as e:
        raise NTLUnavailableError(
            f"loss.name=ntl needs the ntloss package, which is not installed ({e}). Install it with "
            f"`pip install {NTLOSS_REQUIREMENT}` (or `pip install -e '.[ntl]'`), or choose "
            "loss.name=ntil, emd or ce."
        ) from e
    return ntloss


class NTLLoss:
    """Cross-entropy + `ntl_lambda` x ntloss's Wasserstein NTL, with NTIL's parts reported.

    `ntil` is an `NTILLoss` with `ntil_lambda=0`: it gives the cross-entropy (and the NTIL parts for
    the log) exactly as the other loss choices compute them. Called like `NTILLoss`; returns an
    `NTILOutput` whose `loss`/`loss_sum` include the NTL term.
    """

    def __init__(
        self, ntil: NTILLoss, tokenizer: Any, ntl_lambda: float, *, digit_level: bool = True
    ) -> None:
        if ntil.ntil_lambda != 0.0:
            raise ValueError("NTLLoss needs the NTILLoss of its cross-entropy with ntil_lambda=0")
        if not ntl_lambda >= 0:
            raise ValueError(f"ntl_lambda must be >= 0, got {ntl_lambda!r}")
        self._ntloss = _import_ntloss()  # fail at build time, not at the first step
        self.ntil = ntil
        self.tokenizer = tokenizer
        self.ntl_lambda = float(ntl_lambda)
        # ntloss's: "0".."9" only, or every token that parses as a number
        self.digit_level = bool(digit_level)
        self.digit_token_ids = ntil.digit_token_ids
        self.ignore_index = ntil.ignore_index
        self._ntl = None  # built at the first call: ntloss needs the logits' vocabulary size

    def __repr__(self) -> str:
        return f"NTLLoss(ntl_lambda={self.ntl_lambda}, digit_level={self.digit_level}, ce_and_report={self.ntil!r})"

    def _number_token_loss(self, vocab_size: int):
        if self._ntl is None:
            # ntloss adds the digits "0".."9" to a tokenizer that lacks them (changing the vocabulary
            # under a model that was built for it): never let it, the ids must already be there.
            vocab = self.tokenizer.get_vocab()
            ids = [vocab.get(str(d)) for d in range(10)]
            if ids != self.digit_token_ids:
                raise ValueError(
                    f"loss.name=ntl needs the tokens '0'..'9' at ids {self.digit_token_ids}; the tokenizer "
                    f"has {ids}"
                )
            self._ntl = self._ntloss.NTLoss(
                self.tokenizer, vocab_size=vocab_size, digit_level=self.digit_level
            )
        return self._ntl

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        process_group=None,
        vocab_start: int = 0,
        generator: torch.Generator | None = None,
        unpack_index: torch.Tensor | None = None,
        step: int | None = None,
    ) -> NTILOutput:
        """Like `NTILLoss.__call__` (``step`` is unused: ntl has no lambda ramp, the config refuses one); `unpack_index` (packed samples) goes to the NTIL parts only: the NTL
        term is a sum over digit positions, the same however samples are packed."""
        if process_group is not None or vocab_start != 0:
            raise ValueError(
                "loss.name=ntl cannot run on vocabulary-parallel logit shards (ntloss takes a softmax over "
                "the full vocabulary at every digit position); use loss.name=ntil, emd or ce with tensor "
                "parallelism, or train ntl without autotp_size"
            )
        out = self.ntil(logits, labels, generator=generator, unpack_index=unpack_index)
        ntl_sum = self._number_token_loss(logits.shape[-1])(
            logits, labels, reduction="sum", ignore_index=self.ignore_index
        ).to(out.loss_sum.dtype)
        loss_sum = out.ce_sum + self.ntl_lambda * ntl_sum
        loss = loss_sum / out.num_tokens.clamp_min(1).to(loss_sum.dtype)
        return NTILOutput(
            loss=loss,
            ntil=out.ntil,
            emd=out.emd,
            rel=out.rel,
            mag=out.mag,
            ce_sum=out.ce_sum,
            ce_mean=out.ce_mean,
            num_tokens=out.num_tokens,
            loss_sum=loss_sum,
        )
