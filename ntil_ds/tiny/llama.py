"""Tiny Llama 3 text model (``llama``): a 2-layer ``LlamaForCausalLM`` with the LLaMA-3-style tokenizer that
groups digits 1-3 from the left (``\\p{N}{1,3}``: "2024" -> "202" "4"), so NTIL trains it with the grouped
loss. It is the text-only grouped-digit model of the loss comparison on arithmetic (docs/results.md), the
grouped counterpart of the single-digit ``qwen2``.

Chat template: Llama 3's header/eot turns (``templates/mllama.jinja`` with no image in the messages).
"""

from __future__ import annotations

from pathlib import Path

from ntil_ds.tiny.tokenizer import chat_template, grouped_fast_tokenizer, tiny_text_config_kwargs

LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


def build_llama(out_dir: Path) -> None:
    from transformers import LlamaConfig

    tokenizer = grouped_fast_tokenizer(
        LLAMA3_SPECIAL_TOKENS,
        chat_template("mllama"),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
    )
    config = LlamaConfig(
        **tiny_text_config_kwargs(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
