"""ntil-ds: NTIL training for (multimodal) LLMs on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"

# The public loss API, importable without DeepSpeed (docs/integrations.md): imported on first use, so that
# `import ntil_ds` stays free of torch for the CLIs that only read configs.
_PUBLIC = {
    "NTILLoss": "ntil_ds.loss",
    "GroupedNTILLoss": "ntil_ds.loss",
    "ntil_loss": "ntil_ds.integrations",
    "attach_ntil": "ntil_ds.integrations.hf_trainer",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ntil_ds' has no attribute {name!r}")
