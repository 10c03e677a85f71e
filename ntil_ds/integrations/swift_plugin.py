"""NTIL as an ms-swift loss (``--loss_type ntil``), loaded with ``--external_plugins``:

    NTIL_LOSS_KEYS='{"ntil_lambda": 0.3}' swift sft --model ... --dataset ... --deepspeed zero3 \
        --external_plugins "$(python -c 'import ntil_ds.integrations.swift_plugin as p; print(p.__file__)')" \
        --loss_type ntil

``NTIL_LOSS_KEYS``: the recipe's ``loss.*`` keys as a JSON object (empty: the paper's defaults). The loss is the
one ``attach_ntil`` uses (:class:`~ntil_ds.integrations.hf_trainer.NTILComputeLoss`), normalised as ms-swift's
own cross-entropy (``num_items_in_batch``), its parts in the trainer's logs. Refused: ms-swift's sequence
parallelism (its trainer gathers a per-token cross-entropy, not logits) and per-token ``loss_scale`` weights
(NTIL's number terms are per number, not per token).

Not run in this project's tests: ms-swift 4.6 requires transformers<5.20 and peft<0.21, which do not install
beside the pinned stack (docs/integrations.md).
"""

from __future__ import annotations

import json
import os

from swift.loss import BaseLoss, loss_map

from ntil_ds.integrations.hf_trainer import NTILComputeLoss, report_parts
from ntil_ds.integrations.loss import ntil_loss


class NTILSwiftLoss(BaseLoss):
    def __init__(self, args, trainer):
        super().__init__(args, trainer)
        template = getattr(trainer, "template", None)
        if template is not None and getattr(template, "sequence_parallel_size", 1) > 1:
            raise ValueError(
                "--loss_type ntil cannot run under ms-swift's sequence parallelism (its trainer hands the loss a "
                "gathered per-token cross-entropy, not logits): drop --sequence_parallel_size, or train long rows "
                "with ntil-ds's trainer (parallel.sequence_parallel_size)"
            )
        keys = json.loads(os.environ.get("NTIL_LOSS_KEYS") or "{}")
        tokenizer = getattr(trainer, "processing_class", None) or template.tokenizer
        self.hook = NTILComputeLoss(ntil_loss(tokenizer, **keys))
        report_parts(trainer, self.hook.meter)

    def __call__(self, outputs, labels, *, num_items_in_batch=None, loss_scale=None, **kwargs):
        if loss_scale is not None and bool((loss_scale != 1).any()):
            raise ValueError(
                "--loss_type ntil does not weight tokens: remove --loss_scale (NTIL's terms are per number)"
            )
        return self.hook(outputs, labels, num_items_in_batch=num_items_in_batch)


loss_map["ntil"] = NTILSwiftLoss
