"""Tiny SmolVLM folder (SmolVLM2-2.2B-Instruct's layout): SigLIP on 28x28 tiles in 7x7 patches (4x4 = 16),
pixel-shuffled by 2 to 4 image tokens per tile, a linear connector, a Llama (SmolLM2) language model. An
image is resized to a longest edge of 84 and split into up to 3x3 tiles of 28 plus the whole image at
28x28 (the real model: 1536 and 384, so up to 4x4 tiles + global).

Chat template (``templates/smolvlm.jinja``): SmolVLM2-Instruct's: "<|im_start|>" once, then
"User:<image>question<end_of_utterance>\\n" and "Assistant: answer<end_of_utterance>\\n"; no space after
"User:" when the turn starts with an image.
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.processor_files import save_processor_files
from ntil_ds.tiny.tokenizer import chat_template, fast_tokenizer, tiny_text_config_kwargs

_SMOLVLM_TILE, _SMOLVLM_PATCH, _SMOLVLM_SCALE, _SMOLVLM_LONGEST_EDGE = 28, 7, 2, 84
_SMOLVLM_IMAGE_TOKENS = (_SMOLVLM_TILE // _SMOLVLM_PATCH) ** 2 // _SMOLVLM_SCALE**2
# SmolVLM2's tokenizer (SmolLM2's plus the image markers; rows/columns up to 6, as in the real vocabulary).
SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)),
)


def build_smolvlm(out_dir: Path) -> None:
    """Files written by hand like the Qwen-VL ones (SmolVLMProcessor needs a video processor, hence
    torchvision); ``image_seq_len`` goes to processor_config.json, where the Hub folders keep it."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil

    tokenizer = fast_tokenizer(
        SMOLVLM_SPECIAL_TOKENS,
        chat_template("smolvlm"),
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",  # the -Instruct models end each turn (and generation) with it
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )
    text = tiny_text_config_kwargs(tokenizer)
    text["model_type"] = "llama"  # SmolLM2
    config = SmolVLMConfig(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": _SMOLVLM_TILE,
            "patch_size": _SMOLVLM_PATCH,
        },
        scale_factor=_SMOLVLM_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,  # as in SmolVLM2-2.2B
    )
    sizes = {
        "size": {"longest_edge": _SMOLVLM_LONGEST_EDGE},
        "max_image_size": {"longest_edge": _SMOLVLM_TILE},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    image_processor = SmolVLMImageProcessorPil(do_image_splitting=True, **sizes)
    config.save_pretrained(out_dir)
    processor_config = {"processor_class": "SmolVLMProcessor", "image_seq_len": _SMOLVLM_IMAGE_TOKENS}
    video_config = {
        "video_processor_type": "SmolVLMVideoProcessor",
        **sizes,
        "video_sampling": {"fps": 1, "max_frames": 8, "video_size": {"longest_edge": _SMOLVLM_TILE}},
    }
    save_processor_files(out_dir, tokenizer, image_processor, processor_config, video_config)
