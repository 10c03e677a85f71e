"""ntil-ds: NTIL training for (multimodal) LLMs on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"
