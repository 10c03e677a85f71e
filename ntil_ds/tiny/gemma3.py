"""Tiny Gemma 3 folder: SigLIP at 28x28 pixels in 7x7 patches (4x4 = 16), average-pooled to 2x2 = 4 image
tokens; tied input/output embeddings, as in the real Gemma 3.

Chat template (``templates/gemma3.jinja``): Gemma 3-it's (system prompt folded into the first user
turn, "model" as the assistant role, <start_of_image> where an image goes; the processor expands it).
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.tokenizer import chat_template, fast_tokenizer, tiny_text_config_kwargs

# Gemma 3's: ids 0-3 as in the real vocabulary (pad, eos, bos, unk), turn and image markers after them.
GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
_GEMMA3_IMAGE_SIZE, _GEMMA3_PATCH, _GEMMA3_IMAGE_TOKENS = 28, 7, 4


def build_gemma3(out_dir: Path) -> None:
    from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    template = chat_template("gemma3")
    tokenizer = fast_tokenizer(
        GEMMA3_SPECIAL_TOKENS,
        template,
        pad_token="<pad>",
        eos_token="<end_of_turn>",  # the -it models stop generating at the end of the turn
        bos_token="<bos>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    text = tiny_text_config_kwargs(tokenizer)
    text.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=64)
    config = Gemma3Config(
        text_config=text,
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": _GEMMA3_IMAGE_SIZE,
            "patch_size": _GEMMA3_PATCH,
            "vision_use_head": False,
        },
        mm_tokens_per_image=_GEMMA3_IMAGE_TOKENS,
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        tie_word_embeddings=True,  # as in the real Gemma 3
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": _GEMMA3_IMAGE_SIZE, "width": _GEMMA3_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=template,
        image_seq_length=_GEMMA3_IMAGE_TOKENS,
    )
    config.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
