"""Tiny InternVL3 folder (-hf layout): InternViT vision tower, 2-layer MLP projector, Qwen2 language model.

InternViT at 28x28 pixels in 7x7 patches (4x4 = 16, the CLS token dropped), pixel-shuffled by 0.5 to
2x2 = 4 image tokens per tile. The processor tiles an image (crop_to_patches, as the real
InternVLProcessor does by default) into up to 4 tiles of 28x28 plus a thumbnail when there is more than
one: a 64x48 image takes 2x2 tiles + 1 = 5 tiles = 20 tokens, a 28x28 one 1 tile = 4 (the real model:
448x448 tiles of 256 tokens, up to 12 tiles).

Chat template (``templates/internvl.jinja``): InternVL3-hf's (ChatML, no default system prompt; an image
is "<IMG_CONTEXT>\\n", which the processor expands to "<img>" + <IMG_CONTEXT> x (256 per tile) + "</img>").
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.processor_files import save_processor_files
from ntil_ds.tiny.tokenizer import QWEN_SPECIAL_TOKENS, chat_template, fast_tokenizer, tiny_text_config_kwargs

# InternVL-hf: Qwen's tokens plus the image markers its converted tokenizers add (<img>, </img>,
# <IMG_CONTEXT>; the real one also has <quad>, <ref>, <box> pairs, unused here) and <video>.
INTERNVL_SPECIAL_TOKENS = (*QWEN_SPECIAL_TOKENS, "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
_INTERNVL_IMAGE_SIZE, _INTERNVL_PATCH, _INTERNVL_TOKENS_PER_TILE, _INTERNVL_MAX_TILES = 28, 7, 4, 4


def build_internvl(out_dir: Path) -> None:
    """InternVLProcessor cannot be built without torchvision (its video processor needs it): its files
    are written directly, as for Qwen-VL (see ``processor_files``)."""
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    tokenizer = fast_tokenizer(
        INTERNVL_SPECIAL_TOKENS,
        chat_template("internvl"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        # the attributes InternVLProcessor reads from the tokenizer
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )
    text = tiny_text_config_kwargs(tokenizer)
    text["model_type"] = "qwen2"
    config = InternVLConfig(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": _INTERNVL_IMAGE_SIZE,
            "patch_size": _INTERNVL_PATCH,
            "attention_bias": True,  # InternViT-300M's qkv bias
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        image_seq_length=_INTERNVL_TOKENS_PER_TILE,
        downsample_ratio=0.5,
        tie_word_embeddings=False,  # as in InternVL3-8B (Qwen2.5-7B)
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": _INTERNVL_IMAGE_SIZE, "width": _INTERNVL_IMAGE_SIZE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=_INTERNVL_MAX_TILES,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    config.save_pretrained(out_dir)
    processor_config = {"processor_class": "InternVLProcessor", "image_seq_length": _INTERNVL_TOKENS_PER_TILE}
    video_config = {
        "video_processor_type": "InternVLVideoProcessor",
        "size": {"height": _INTERNVL_IMAGE_SIZE, "width": _INTERNVL_IMAGE_SIZE},
        "image_mean": image_processor.image_mean,
        "image_std": image_processor.image_std,
    }
    save_processor_files(out_dir, tokenizer, image_processor, processor_config, video_config)
