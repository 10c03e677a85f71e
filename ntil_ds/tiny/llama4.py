"""Tiny Llama 4 (``llama4``, Llama-4-Scout's layout) folder: a ViT (28x28 in 7x7 patches) whose pixel-shuffle
adapter (``vision_model.vision_adapter``) feeds a linear projector (``multi_modal_projector``), and a text
model of mixture-of-experts layers: a top-1 sigmoid router (``feed_forward.router``), fused routed experts
(``feed_forward.experts``, 3-D weights) and a shared expert in every layer (Scout: 16 experts, 1 per token),
chunked attention with RoPE and one NoPE layer; the tokenizer groups digits as Llama 4's does
(``\\p{N}{1,3}`` from the left), so NTIL trains it with the grouped loss.

Llama 4's image processor (``Llama4ImageProcessor``) exists only as a torchvision backend in transformers
5.24, so neither it nor ``Llama4Processor`` can be built where torchvision is missing (CPU torch 2.13 has
none): the folder's files are written directly, as the Hub checkpoint has them, and
``ntil_ds.data.load_processor`` loads the tokenizer alone there (text-only data; image samples are refused
at start with the reason).

Chat template (``templates/llama4.jinja``): Llama 4's header/eot turns, <|image|> where an image goes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ntil_ds.tiny.tokenizer import chat_template, grouped_fast_tokenizer, tiny_text_config_kwargs

# Llama 4's text and image special tokens (Scout's tokenizer, in its order; the fill-in-the-middle ones and
# the reserved ones left out)
LLAMA4_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eom|>",
    "<|eot|>",
    "<|step|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "<|image|>",
    "<|finetune_right_pad|>",
)
_LLAMA4_IMAGE, _LLAMA4_PATCH = 28, 7

# 4 routed experts, top-1, one shared expert, in both layers (Scout: interleave_moe_layer_step 1); expert
# weights not square (hidden 64, expert width 24); layer 0 chunked attention with RoPE, layer 1 NoPE.
_LLAMA4_TEXT = {
    "num_local_experts": 4,
    "num_experts_per_tok": 1,
    "intermediate_size": 24,
    "intermediate_size_mlp": 128,
    "interleave_moe_layer_step": 1,
    "head_dim": 16,
    "no_rope_layer_interval": 2,
    "attention_chunk_size": 8192,
}


def build_llama4(out_dir: Path) -> None:
    from transformers import Llama4Config

    template = chat_template("llama4")
    tokenizer = grouped_fast_tokenizer(
        LLAMA4_SPECIAL_TOKENS,
        template,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
        pad_token="<|finetune_right_pad|>",
    )
    text = {**tiny_text_config_kwargs(tokenizer), **_LLAMA4_TEXT}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config = Llama4Config(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": _LLAMA4_IMAGE,
            "patch_size": _LLAMA4_PATCH,
            "pixel_shuffle_ratio": 0.5,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
            "vision_output_dim": 32,
        },
        boi_token_index=tokenizer.convert_tokens_to_ids("<|image_start|>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<|image_end|>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<|patch|>"),
        tie_word_embeddings=False,
    )
    config.save_pretrained(out_dir)
    # Llama4Processor / Llama4ImageProcessor cannot be built without torchvision: their files are written
    # as the Hub checkpoint has them (Scout's values, the tile size ours).
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(template)
    image_processor = {
        "image_processor_type": "Llama4ImageProcessor",
        "processor_class": "Llama4Processor",
        "size": {"height": _LLAMA4_IMAGE, "width": _LLAMA4_IMAGE},
        "max_patches": 1,
        "resize_to_max_canvas": False,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    settings = {"processor_class": "Llama4Processor", "patch_size": _LLAMA4_PATCH, "downsample_ratio": 2}
    (out_dir / "processor_config.json").write_text(json.dumps(settings, indent=2))
