"""Tiny LLaVA-1.5 folder: a CLIP vision tower, a 2-layer MLP projector, a Llama language model.

Chat template (``templates/llava.jinja``): LLaVA-1.5 style ("USER: <image>\\n... ASSISTANT: ..."), with an
explicit </s> closing each answer so a fine-tuned model learns to stop, and a newline after "ASSISTANT:"
so the answer starts a fresh token.
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.tokenizer import chat_template, fast_tokenizer, tiny_text_config_kwargs

LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")


def build_llava(out_dir: Path) -> None:
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    template = chat_template("llava")
    tokenizer = fast_tokenizer(
        LLAVA_SPECIAL_TOKENS,
        template,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    image_size, patch_size = 28, 7  # 4x4 = 16 image tokens (the CLS token is dropped: "default")
    text = tiny_text_config_kwargs(tokenizer)
    text["model_type"] = "llama"
    config = LlavaConfig(
        text_config=text,
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": patch_size,
            "projection_dim": 32,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )
    config.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
