"""A model folder with Qwen2-VL-2B's dimensions, offline (random init, no download).

It starts from the tiny offline Qwen2-VL folder (ntil_ds.tiny) and sets config.json to the
published Qwen2-VL-2B-Instruct sizes: LLM 1536 hidden, 28 layers, 12 heads / 2 KV heads, 8960 MLP,
vocab 151,936, tied embeddings, M-RoPE sections [16, 24, 24], rope theta 1e6; ViT depth 32, width 1280,
16 heads (2.21 B parameters). The tokenizer stays tiny (ids < 512): the logits are full-size
[tokens, 151936] while the text encodes as in the demo. The image processor upscales the small
generated clock faces to ~448 px (~256 image tokens each; ~310 tokens per clock sample), as on the GPU
where the first measurements were taken.
"""

from __future__ import annotations

import json
from pathlib import Path

from ntil_ds.tiny import build_tiny_model_folder

HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, VOCAB = 1536, 28, 12, 2, 8960, 151936


def build_2b_folder(out_dir: Path) -> Path:
    folder = build_tiny_model_folder("qwen2_vl", out_dir)
    config_file = folder / "config.json"
    cfg = json.loads(config_file.read_text())
    cfg["tie_word_embeddings"] = True
    text = cfg["text_config"]
    text.update(
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=32768,
        layer_types=["full_attention"] * LAYERS,
        tie_word_embeddings=True,
    )
    text["rope_parameters"]["mrope_section"] = [16, 24, 24]
    text["rope_parameters"]["rope_theta"] = 1000000.0
    cfg["vision_config"].update(depth=32, embed_dim=1280, hidden_size=HIDDEN, mlp_ratio=4, num_heads=16)
    config_file.write_text(json.dumps(cfg, indent=2))
    processor_file = folder / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text())
    processor["size"] = {"shortest_edge": 448 * 448, "longest_edge": 448 * 448 * 2}
    processor_file.write_text(json.dumps(processor, indent=2))
    return folder


def matmul_params(config_file: Path) -> dict[str, int]:
    """Parameters the language model multiplies by: "decoder" (its projections, every token) and "head"
    (h x vocab, every position the output head runs at); norms and the embedding lookup do no matrix
    product. Model FLOPs of training = 6 x these per token / per head position."""
    text = json.loads(Path(config_file).read_text())["text_config"]
    h, inter, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    kv = h // text["num_attention_heads"] * text["num_key_value_heads"]
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k, v, o, gate/up/down
    return {"decoder": text["num_hidden_layers"] * per_layer, "head": h * vocab}
