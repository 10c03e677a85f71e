"""Tiny offline model folders: config + tokenizer + processor, no weights, no download.

Tests, the CPU demo and the benchmarks need real `transformers` model classes with real processors and
chat templates, but nothing may be downloaded. `build_tiny_model_folder(kind, out_dir)` writes a folder
that loads like a Hub checkpoint (`AutoConfig`, `AutoProcessor` / `AutoTokenizer`) and whose config builds
a model of a few hundred thousand parameters with random weights (`from_config`).

The tokenizer is a byte-level BPE trained here, deterministically, on a small fixed English corpus. It
spells numbers digit by digit (like Qwen's), holds every byte, so any text encodes, and keeps the model
family's special tokens (bos/eos/pad, image and vision markers) inside its small vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_KINDS = ("qwen2_vl", "qwen2_5_vl", "llava", "qwen2", "qwen3_vl", "gemma3", "internvl", "smolvlm")

# Tiny vocab: 256 bytes + special tokens + merges learned on the corpus below.
TINY_VOCAB_SIZE = 512

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
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

# InternVL-hf: Qwen's tokens plus the image markers its converted tokenizers add (<img>, </img>,
# <IMG_CONTEXT>; the real one also has <quad>, <ref>, <box> pairs, unused here) and <video>.
INTERNVL_SPECIAL_TOKENS = (*QWEN_SPECIAL_TOKENS, "<img>", "</img>", "<IMG_CONTEXT>", "<video>")

# The real Qwen2-VL / Qwen2.5-VL chat template (system prompt added when none is given).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-Instruct's template, without its tool-calling and thinking branches: like Qwen2-VL's but with
# no default system prompt.
QWEN3_VL_CHAT_TEMPLATE = QWEN_VL_CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}",
    "",
)

# Gemma 3-it's template (system prompt folded into the first user turn, "model" as the assistant role,
# <start_of_image> where an image goes; the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}<start_of_turn>{{ role }}\n{{ first_user_prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# The InternVL3-hf chat template (ChatML, no default system prompt; an image is "<IMG_CONTEXT>\n", which the
# processor expands to "<img>" + <IMG_CONTEXT> x (256 per tile) + "</img>").
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)

# The real Qwen2-Instruct chat template (text only: content is a string).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# LLaVA-1.5 style ("USER: <image>\n... ASSISTANT: ..."), with an explicit </s> closing each answer so a
# fine-tuned model learns to stop, and a newline after "ASSISTANT:" so the answer starts a fresh token.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ':' }}"
    "{% if message['role'] == 'assistant' %}{{ '\\n' }}{% else %}{{ ' ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:\\n' }}{% endif %}"
)

# Fixed training text for the BPE merges: the prompts of the synthetic tasks and common English, so
# typical prompts take few tokens. Digits never merge (they are split before BPE sees them).
_CORPUS = """
You are a helpful assistant. What time is it? What time does the clock show? Answer as HH:MM.
Where is the red square? Where is the blue circle? Where is the green triangle? Answer with the box
[x1, y1, x2, y2] in pixels. What is the value of the bar labelled A? What is the value of the bar?
Compute the sum. Compute the difference. Compute the product. What is the answer? The answer is
the number. Describe the image. What is in the picture? How many objects are there? Read the chart.
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words. This is a test of the
tokenizer with some ordinary English sentences, questions and answers about images, charts, clocks,
boxes, shapes, colours: red, green, blue, yellow, orange, purple, black, white, gray, cyan, magenta.
square circle triangle rectangle hour minute second left right top bottom width height value label
plus minus times divided equals sum difference product quotient result number digits
USER: ASSISTANT: system user assistant
"""


def _train_tokenizer(special_tokens: tuple[str, ...]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Digits first, one per token (as Qwen does), then GPT-2 byte-level splitting of the rest.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() for _ in range(3)]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def _fast_tokenizer(special_tokens: tuple[str, ...], chat_template: str, **token_roles: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(special_tokens),
        chat_template=chat_template,
        model_max_length=4096,
        **token_roles,
    )


def _qwen_tokenizer(chat_template: str):
    # Qwen's instruct models end a turn (and generation) with <|im_end|>; <|endoftext|> pads.
    return _fast_tokenizer(
        QWEN_SPECIAL_TOKENS, chat_template, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def _tiny_text_config_kwargs(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": tokenizer.convert_tokens_to_ids(tokenizer.bos_token or tokenizer.pad_token),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


# 28x28 .. 112x112 pixels: 1 to 16 image tokens after the 2x2 merge, so tests stay fast.
_QWEN_MIN_PIXELS = 28 * 28
_QWEN_MAX_PIXELS = 112 * 112


def _qwen_vl_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=_QWEN_MIN_PIXELS,
        max_pixels=_QWEN_MAX_PIXELS,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


def _save_qwen_vl_processor(out_dir: Path, processor_class: str, tokenizer) -> None:
    """Write the processor files a Hub Qwen-VL checkpoint has, without instantiating the processor.

    transformers 5.24's Qwen-VL processor classes cannot be built without torchvision (their video
    processor needs it), and CPU torch 2.13 has none; the files load with `AutoProcessor` where
    torchvision exists and with `ntil_ds.data.load_processor` everywhere.
    """
    image_processor = _qwen_vl_image_processor()
    video_config = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "cap_pixels_per_frame": True,
        "size": {"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": _QWEN_MAX_PIXELS},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": image_processor.image_mean,
        "image_std": image_processor.image_std,
    }
    _save_processor_files(
        out_dir, tokenizer, image_processor, {"processor_class": processor_class}, video_config
    )


def _save_processor_files(
    out_dir: Path, tokenizer, image_processor, processor_config: dict, video_config: dict
) -> None:
    """The files of a Hub processor folder, for processors that need torchvision to be built (a video
    slot): tokenizer, image processor, chat template, processor settings, video processor settings."""
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2))
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2))


def _qwen_vl_ids(tokenizer) -> dict:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in _QWEN_VL_ID_TOKENS.items()}
    return ids


_QWEN_VL_ID_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def _build_qwen2_vl(out_dir: Path) -> None:
    from transformers import Qwen2VLConfig

    tokenizer = _qwen_tokenizer(QWEN_VL_CHAT_TEMPLATE)
    text = _tiny_text_config_kwargs(tokenizer)
    # mrope_section sums to head_dim / 2 (head_dim = 64 / 4 = 16).
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=False,
        **_qwen_vl_ids(tokenizer),
    )
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen2VLProcessor", tokenizer)


def _build_qwen2_5_vl(out_dir: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    tokenizer = _qwen_tokenizer(QWEN_VL_CHAT_TEMPLATE)
    text = _tiny_text_config_kwargs(tokenizer)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        tie_word_embeddings=False,
        **_qwen_vl_ids(tokenizer),
    )
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen2_5_VLProcessor", tokenizer)


def _build_llava(out_dir: Path) -> None:
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor

    tokenizer = _fast_tokenizer(
        LLAVA_SPECIAL_TOKENS,
        LLAVA_CHAT_TEMPLATE,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    image_size, patch_size = 28, 7  # 4x4 = 16 image tokens (the CLS token is dropped: "default")
    text = _tiny_text_config_kwargs(tokenizer)
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
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    config.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def _build_qwen2(out_dir: Path) -> None:
    from transformers import Qwen2Config

    tokenizer = _qwen_tokenizer(QWEN2_CHAT_TEMPLATE)
    config = Qwen2Config(**_tiny_text_config_kwargs(tokenizer), tie_word_embeddings=False)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _build_qwen3_vl(out_dir: Path) -> None:
    from transformers import Qwen3VLConfig

    tokenizer = _qwen_tokenizer(QWEN3_VL_CHAT_TEMPLATE)
    text = _tiny_text_config_kwargs(tokenizer)
    # Interleaved M-RoPE; the sections sum to head_dim / 2 as in the real [24, 20, 20] for head_dim 128.
    text["head_dim"] = 16
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to the image's patches
            "deepstack_visual_indexes": [0],  # layer 0's features are also added to the LM's first layer
        },
        tie_word_embeddings=False,
        **_qwen_vl_ids(tokenizer),
    )
    config.save_pretrained(out_dir)
    _save_qwen_vl_processor(out_dir, "Qwen3VLProcessor", tokenizer)


# Gemma 3: SigLIP at 28x28 pixels in 7x7 patches (4x4 = 16), average-pooled to 2x2 = 4 image tokens.
_GEMMA3_IMAGE_SIZE, _GEMMA3_PATCH, _GEMMA3_IMAGE_TOKENS = 28, 7, 4


def _build_gemma3(out_dir: Path) -> None:
    from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = _fast_tokenizer(
        GEMMA3_SPECIAL_TOKENS,
        GEMMA3_CHAT_TEMPLATE,
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
    text = _tiny_text_config_kwargs(tokenizer)
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
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=_GEMMA3_IMAGE_TOKENS,
    )
    config.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


# InternVL: InternViT at 28x28 pixels in 7x7 patches (4x4 = 16, the CLS token dropped), pixel-shuffled
# by 0.5 to 2x2 = 4 image tokens per tile. The processor tiles an image (crop_to_patches, as the real
# InternVLProcessor does by default) into up to 4 tiles of 28x28 plus a thumbnail when there is more than
# one: a 64x48 image takes 2x2 tiles + 1 = 5 tiles = 20 tokens, a 28x28 one 1 tile = 4 (the real model:
# 448x448 tiles of 256 tokens, up to 12 tiles).
_INTERNVL_IMAGE_SIZE, _INTERNVL_PATCH, _INTERNVL_TOKENS_PER_TILE, _INTERNVL_MAX_TILES = 28, 7, 4, 4


def _build_internvl(out_dir: Path) -> None:
    """InternVL3-style (-hf layout): InternViT vision tower, 2-layer MLP projector, Qwen2 language model.

    InternVLProcessor cannot be built without torchvision (its video processor needs it): its files are
    written directly, as for Qwen-VL, and load with `ntil_ds.data.load_processor` everywhere.
    """
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig

    tokenizer = _fast_tokenizer(
        INTERNVL_SPECIAL_TOKENS,
        INTERNVL_CHAT_TEMPLATE,
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
    text = _tiny_text_config_kwargs(tokenizer)
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
    _save_processor_files(out_dir, tokenizer, image_processor, processor_config, video_config)


# SmolVLM (SmolVLM2-2.2B-Instruct's layout): SigLIP on 28x28 tiles in 7x7 patches (4x4 = 16), pixel-shuffled
# by 2 to 4 image tokens per tile. An image is resized to a longest edge of 84 and split into up to 3x3
# tiles of 28 plus the whole image at 28x28 (the real model: 1536 and 384, so up to 4x4 tiles + global).
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
# SmolVLM2-Instruct's template: "<|im_start|>" once, then "User:<image>question<end_of_utterance>\n" and
# "Assistant: answer<end_of_utterance>\n"; no space after "User:" when the turn starts with an image.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def _build_smolvlm(out_dir: Path) -> None:
    """SmolVLM: files written by hand like the Qwen-VL ones (SmolVLMProcessor needs a video processor,
    hence torchvision); `image_seq_len` goes to processor_config.json, where the Hub folders keep it."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessorPil

    tokenizer = _fast_tokenizer(
        SMOLVLM_SPECIAL_TOKENS,
        SMOLVLM_CHAT_TEMPLATE,
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
    text = _tiny_text_config_kwargs(tokenizer)
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
    _save_processor_files(out_dir, tokenizer, image_processor, processor_config, video_config)


_BUILDERS = {
    "qwen2_vl": _build_qwen2_vl,
    "qwen2_5_vl": _build_qwen2_5_vl,
    "llava": _build_llava,
    "qwen2": _build_qwen2,
    "qwen3_vl": _build_qwen3_vl,
    "gemma3": _build_gemma3,
    "smolvlm": _build_smolvlm,
    "internvl": _build_internvl,
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
    if fields["vision"] and kind != "qwen2_vl":
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
