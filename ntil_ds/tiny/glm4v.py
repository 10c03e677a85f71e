"""Tiny GLM-4.1V (``glm4v``) folder: GLM-4.1V's vision tower (14x14 patches, 2x2 spatial merge by a
strided convolution, then the merger MLP), a GLM-4 text model with M-RoPE; the tokenizer groups digits
as GLM-4.xV does (``\\p{N}{1,3}`` from the left), so NTIL trains it with the grouped loss.

Chat template (``templates/glm4v.jinja``): GLM-4.1V's ``[gMASK]<sop>`` and ``<|role|>`` turns, an image as
``<|begin_of_image|><|image|><|end_of_image|>`` (the processor expands <|image|>), without the thinking
branch.
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.processor_files import save_processor_files
from ntil_ds.tiny.tokenizer import chat_template, grouped_fast_tokenizer, tiny_text_config_kwargs

GLM4V_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
_GLM4V_MIN_PIXELS, _GLM4V_MAX_PIXELS = 28 * 28, 112 * 112


def build_glm4v(out_dir: Path) -> None:
    from transformers import Glm4vConfig, Glm4vImageProcessorPil

    template = chat_template("glm4v")
    tokenizer = grouped_fast_tokenizer(
        GLM4V_SPECIAL_TOKENS, template, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    text = tiny_text_config_kwargs(tokenizer)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],  # sums to the rotary half: head_dim 16 x 0.5 / 2 (real: [8, 12, 12])
        "partial_rotary_factor": 0.5,
    }
    ids = {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
        for name, token in {
            "image": "<|image|>",
            "video": "<|video|>",
            "image_start": "<|begin_of_image|>",
            "image_end": "<|end_of_image|>",
            "video_start": "<|begin_of_video|>",
            "video_end": "<|end_of_video|>",
        }.items()
    }
    config = Glm4vConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "image_size": 28,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=False,
        **ids,
    )
    config.save_pretrained(out_dir)
    image_processor = Glm4vImageProcessorPil(
        size={"shortest_edge": _GLM4V_MIN_PIXELS, "longest_edge": _GLM4V_MAX_PIXELS},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    video_config = {
        "video_processor_type": "Glm4vVideoProcessor",
        "size": {"shortest_edge": _GLM4V_MIN_PIXELS, "longest_edge": _GLM4V_MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": image_processor.image_mean,
        "image_std": image_processor.image_std,
    }
    save_processor_files(
        out_dir, tokenizer, image_processor, {"processor_class": "Glm4vProcessor"}, video_config
    )
