"""Tiny Llama 3.2 Vision (``mllama``) folder: a tiled ViT (one 28x28 tile in 7x7 patches, a local and a
global layer), a linear projector, and a Llama text model whose image features enter through
cross-attention layers (layer 1 of 2 here, every 5th in the real 11B) instead of image tokens in the
sequence; the tokenizer groups digits as LLaMA-3 does (``\\p{N}{1,3}`` from the left), so NTIL trains it
with the grouped loss.

Chat template (``templates/mllama.jinja``): Llama 3.2 Vision-Instruct's header/eot turns, <|image|> where
an image goes (one token: the cross-attention layers read the image).
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.llama import LLAMA3_SPECIAL_TOKENS
from ntil_ds.tiny.tokenizer import chat_template, grouped_fast_tokenizer, tiny_text_config_kwargs

# Llama 3's text tokens, then the vision model's (same ids as the text model's, then two more)
MLLAMA_SPECIAL_TOKENS = (*LLAMA3_SPECIAL_TOKENS, "<|python_tag|>", "<|image|>")
_MLLAMA_TILE = 28


def build_mllama(out_dir: Path) -> None:
    from transformers import MllamaConfig, MllamaImageProcessorPil, MllamaProcessor

    template = chat_template("mllama")
    tokenizer = grouped_fast_tokenizer(
        MLLAMA_SPECIAL_TOKENS,
        template,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
    )
    text = tiny_text_config_kwargs(tokenizer)
    text.update(cross_attention_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    config = MllamaConfig(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_global_layers": 1,
            "attention_heads": 2,
            "image_size": _MLLAMA_TILE,
            "patch_size": 7,
            "max_num_tiles": 1,
            "intermediate_layers_indices": [0],
            "vision_output_dim": 64,  # hidden_size x (1 + the one intermediate layer)
            "supported_aspect_ratios": [[1, 1]],
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"),
        tie_word_embeddings=False,
    )
    image_processor = MllamaImageProcessorPil(
        size={"height": _MLLAMA_TILE, "width": _MLLAMA_TILE}, max_image_tiles=1
    )
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    config.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
