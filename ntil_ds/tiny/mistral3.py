"""Tiny Mistral Small 3.1 (``mistral3``) folder, the regex-trap case: a Pixtral vision tower (28x28 in
7x7 patches), Mistral 3's patch-merging projector, a Mistral text model; its ``tokenizer.json`` carries the
LLaMA-3 digit-grouping regex, as the real Mistral-Small-3.1-24B's does, although the model reads one digit
per token. The config records a transformers 4.x version, as the real one does, so transformers detects
the trap on loading; ``ntil_ds.data.load_processor`` then loads the tokenizer with
``fix_mistral_regex=True`` (single digits) and says so.

Chat template (``templates/mistral3.jinja``): [INST] ... [/INST] turns, [IMG] where an image goes (the
processor expands it into rows of [IMG] ended by [IMG_BREAK] / [IMG_END]).
"""

from __future__ import annotations

import json
from pathlib import Path

from ntil_ds.tiny.tokenizer import chat_template, grouped_fast_tokenizer, tiny_text_config_kwargs

MISTRAL3_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
_MISTRAL3_IMAGE, _MISTRAL3_PATCH = 28, 7
# The transformers version the real checkpoint's config.json records (before 5.0 fixed the regex).
_MISTRAL3_TRANSFORMERS_VERSION = "4.50.0.dev0"


def build_mistral3(out_dir: Path) -> None:
    from transformers import Mistral3Config, PixtralImageProcessorPil

    template = chat_template("mistral3")
    tokenizer = grouped_fast_tokenizer(
        MISTRAL3_SPECIAL_TOKENS,
        template,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    text = tiny_text_config_kwargs(tokenizer)
    text.update(model_type="mistral", head_dim=16, sliding_window=None)
    config = Mistral3Config(
        text_config=text,
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": _MISTRAL3_IMAGE,
            "patch_size": _MISTRAL3_PATCH,
            "head_dim": 16,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": _MISTRAL3_IMAGE},
        patch_size={"height": _MISTRAL3_PATCH, "width": _MISTRAL3_PATCH},
    )
    # PixtralProcessor cannot be built without torchvision (CPU torch has none): its files are written
    # directly, as a Hub checkpoint has them.
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(template)
    settings = {"processor_class": "PixtralProcessor", "patch_size": _MISTRAL3_PATCH, "spatial_merge_size": 2}
    (out_dir / "processor_config.json").write_text(json.dumps(settings, indent=2))
    config.save_pretrained(out_dir)
    saved = json.loads((out_dir / "config.json").read_text())
    saved["transformers_version"] = _MISTRAL3_TRANSFORMERS_VERSION
    (out_dir / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
