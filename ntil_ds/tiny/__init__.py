"""Tiny offline model folders: config + tokenizer + processor, no weights, no download.

Tests, the CPU demo and the benchmarks need real `transformers` model classes with real processors and
chat templates, but nothing may be downloaded. `build_tiny_model_folder(kind, out_dir)` writes a folder
that loads like a Hub checkpoint (`AutoConfig`, `AutoProcessor` / `AutoTokenizer`) and whose config builds
a model of a few hundred thousand parameters with random weights (`from_config`).

One module per family (qwen: Qwen2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE; llava; gemma3; internvl; smolvlm; mllama, glm4v and mistral3 with a LLaMA-3-style digit-grouping tokenizer; glm4v_moe, GLM-4.5V, on glm4v's folder; llama, a text-only Llama 3 with the grouping tokenizer; llama4, Llama 4 Scout's MoE layout with the grouping tokenizer); the
tokenizer (a byte-level BPE trained here, deterministically) is `tokenizer.py`; the families' chat
templates are `templates/*.jinja` (package data, as Hub folders ship `chat_template.jinja`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ntil_ds.tiny.gemma3 import build_gemma3
from ntil_ds.tiny.glm4v import build_glm4v
from ntil_ds.tiny.glm4v_moe import build_glm4v_moe
from ntil_ds.tiny.internvl import build_internvl
from ntil_ds.tiny.llama import build_llama
from ntil_ds.tiny.llama4 import build_llama4
from ntil_ds.tiny.llava import build_llava
from ntil_ds.tiny.mistral3 import build_mistral3
from ntil_ds.tiny.mllama import build_mllama
from ntil_ds.tiny.qwen import (
    build_qwen2,
    build_qwen2_5_vl,
    build_qwen2_vl,
    build_qwen3_5,
    build_qwen3_5_moe,
    build_qwen3_vl,
    build_qwen3_vl_moe,
)
from ntil_ds.tiny.smolvlm import build_smolvlm

TINY_KINDS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "qwen2",
    "qwen3_vl",
    "gemma3",
    "internvl",
    "smolvlm",
    "qwen3_vl_moe",
    "qwen3_5",
    "mllama",
    "glm4v",
    "mistral3",
    "qwen3_5_moe",
    "glm4v_moe",
    "llama",
    "llama4",
)

_BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen2_vl": build_qwen2_vl,
    "qwen2_5_vl": build_qwen2_5_vl,
    "llava": build_llava,
    "qwen2": build_qwen2,
    "qwen3_vl": build_qwen3_vl,
    "qwen3_vl_moe": build_qwen3_vl_moe,
    "qwen3_5": build_qwen3_5,
    "gemma3": build_gemma3,
    "smolvlm": build_smolvlm,
    "internvl": build_internvl,
    "mllama": build_mllama,
    "glm4v": build_glm4v,
    "mistral3": build_mistral3,
    "qwen3_5_moe": build_qwen3_5_moe,
    "glm4v_moe": build_glm4v_moe,
    "llama": build_llama,
    "llama4": build_llama4,
}

# Sizes beyond the default ("tiny", what the tests use): "small" is the smallest we measured to learn the
# easy synthetic tasks within minutes on 2 CPU cores (configs/train/tiny_*, `make demo`, docs/results.md).
# Each entry overrides text-model fields, and vision-tower fields of Qwen2-VL.
TINY_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {"text": {}, "vision": {}},
    "small": {
        # head_dim stays 16 (128 / 8), so the Qwen-VL mrope_section [4, 2, 2] still fits
        "text": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8},
        "vision": {"depth": 2, "embed_dim": 64, "num_heads": 4},
    },
}


def _resize(out: Path, kind: str, size: str) -> None:
    """Rewrite the folder's config with the size's fields (the tokenizer and processor stay)."""
    from transformers import AutoConfig

    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(TINY_SIZES)}")
    fields = TINY_SIZES[size]
    if not fields["text"] and not fields["vision"]:
        return
    if fields["vision"] and kind not in ("qwen2_vl", "qwen2"):  # (qwen2 has no vision tower to resize)
        raise ValueError(f"tiny model size {size!r} is defined for qwen2_vl and qwen2 only, not {kind!r}")
    config = AutoConfig.from_pretrained(out)
    text = getattr(config, "text_config", config)
    for key, value in fields["text"].items():
        setattr(text, key, value)
    if hasattr(config, "vision_config"):
        for key, value in fields["vision"].items():
            setattr(config.vision_config, key, value)
        config.vision_config.hidden_size = text.hidden_size  # the merger's output feeds the text model
    config.save_pretrained(out)


def build_tiny_model_folder(kind: str, out_dir: str | Path, size: str = "tiny") -> Path:
    """Write a tiny Hugging Face model folder (config, tokenizer, processor; no weights) and return it.

    `kind` is one of `TINY_KINDS`. Load it with `AutoConfig.from_pretrained(folder)` and
    `AutoProcessor.from_pretrained(folder)` (`AutoTokenizer` for "qwen2"), then build random weights with
    `AutoModelForImageTextToText.from_config(config)` (`AutoModelForCausalLM` for "qwen2").
    `size` is a key of `TINY_SIZES` ("small": wider text model, 2-layer vision tower; qwen2 and
    qwen2_vl). The folder's `tiny_model.json` records the kind and size.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _BUILDERS[kind](out)
    _resize(out, kind, size)
    recorded = {"kind": kind, **({"size": size} if size != "tiny" else {})}
    (out / "tiny_model.json").write_text(json.dumps(recorded) + "\n")
    return out
