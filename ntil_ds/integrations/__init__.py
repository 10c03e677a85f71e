"""NTIL in the training stacks people already run (docs/integrations.md).

- :func:`ntil_loss`: the loss ntil-ds's own trainer builds, from a tokenizer (or processor) and the recipe's
  ``loss.*`` keys; importable without DeepSpeed.
- :func:`attach_ntil` (``ntil_ds.integrations.hf_trainer``): that loss in a ``transformers.Trainer`` or TRL
  ``SFTTrainer``, on whole logits or through the labelled head, its parts in the trainer's logs.
- ``ntil_ds.integrations.swift_plugin``: an ms-swift loss plugin (``--external_plugins``).
"""

from ntil_ds.integrations.loss import ntil_loss

__all__ = ["attach_ntil", "ntil_loss"]


def __getattr__(name: str):
    # transformers' Trainer machinery is imported only by who asks for the adapter
    if name == "attach_ntil":
        from ntil_ds.integrations.hf_trainer import attach_ntil

        return attach_ntil
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
