"""flex_attention on packed rows is exact: each document sees only itself, as sdpa's block-diagonal mask does.

transformers 5.24 builds flex_attention's BlockMask from the packed ``position_ids`` (restarting at 0 per
sample, no ``attention_mask``: `ntil_ds.data.packing`) and calls flex_attention through
``torch.compile``. What these tests check is the project's part: that the boundaries PackedCollator writes
reach flex_attention's mask as one causal block per document. transformers' compiled flex_attention is
swapped for torch's eager one (its reference implementation; the BlockMask is still transformers'), not
inductor's compiled CPU kernel: torch 2.13's compiled CPU flex forward is wrong on CPUs without
AVX-512 (a CI machine without it got 0.9 % of the outputs wrong and NaN logits; reproduced here with
``ATEN_CPU_CAPABILITY=avx2`` or ``default``), and it is not a path this project runs: training with
flex_attention is refused on CPU (torch 2.13 has no FlexAttention backward there,
`ntil_ds.model.loading`). The compiled GPU kernel is measured by
``python -m benchmarks.attention_speed --device cuda``. The Qwen-VL classes do not support
flex_attention in transformers 5.24 (``_supports_flex_attn`` is False): the model here is the tiny Qwen2.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from ntil_ds.data import Collator, ConversationDataset, load_processor, tokenizer_of
from ntil_ds.data.packing import PACKING_KEYS, PackedCollator
from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer
from ntil_ds.tiny import build_tiny_model_folder
from tests.unit.test_packing import _text_only_data


@pytest.fixture
def reference_flex(monkeypatch):
    """transformers' flex path calling torch's reference flex_attention, not its torch.compile'd one (the
    module docstring says why not inductor's CPU kernel)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations.flex_attention import WrappedFlexAttention

    monkeypatch.setattr(WrappedFlexAttention, "__call__", lambda self: flex_attention)


def segments_of(positions: torch.Tensor) -> list[list[int]]:
    """The segment lengths of each row of packed position_ids (a new segment where they restart at 0)."""
    rows = []
    for row in positions.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] + [len(row)]
        rows.append([b - a for a, b in itertools.pairwise(starts)])
    return rows


def per_document_attention(q, k, v, rows: list[list[int]], scale: float) -> torch.Tensor:
    """The reference: causal attention of each segment alone, float64, GQA by repeating kv heads."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.zeros_like(q)
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            doc = slice(start, start + n)
            scores = q[r, :, doc] @ k[r, :, doc].transpose(-1, -2) * scale
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            out[r, :, doc] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[r, :, doc]
            start += n
    return out


@pytest.fixture(scope="module")
def packed_qwen2(tmp_path_factory):
    """The tiny Qwen2's folder and processor, 5 samples and their packed batch (rows of at most 100 tokens:
    several samples in a row, the shorter rows padded: a padding segment of their own), and the model
    built with sdpa and with flex_attention from the same seed. (Built here, before anything compiles:
    building registers pytree nodes, which would make dynamo recompile flex_attention.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("flex_qwen2")
    folder = build_tiny_model_folder("qwen2", root / "model")
    processor = load_processor(folder)
    dataset = ConversationDataset(_text_only_data(root / "data", 5), processor, max_seq_len=256)
    samples = [dataset[i] for i in range(5)]
    packed = PackedCollator(processor, row_tokens=100)(samples)
    rows = segments_of(packed["position_ids"])
    assert len(rows) > 1 and max(len(row) for row in rows) > 2  # several samples a row, padding
    models = {}
    for attn in ("sdpa", "flex_attention"):
        torch.manual_seed(0)
        # a config each: from_config writes the attention choice into the config it is given
        config = AutoConfig.from_pretrained(folder)
        models[attn] = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
        models[attn].eval()
    return folder, processor, samples, packed, models


def test_flex_kernel_on_packed_rows_equals_per_document_attention(packed_qwen2, reference_flex):
    """transformers' flex path (its BlockMask from PackedCollator's position ids, its flex_attention call)
    with the tiny Qwen2's GQA heads: equal to each segment's attention alone."""
    from transformers import AutoConfig
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import create_causal_mask

    folder, _, _, packed, _ = packed_qwen2
    positions = packed["position_ids"]
    config = AutoConfig.from_pretrained(folder)
    config._attn_implementation = "flex_attention"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    assert kv_heads < heads  # grouped-query attention, as in the real models
    batch, width = positions.shape
    embeds = torch.zeros(batch, width, config.hidden_size)
    with torch.no_grad():
        block_mask = create_causal_mask(
            config, embeds, attention_mask=None, cache=None, position_ids=positions
        )
    assert type(block_mask).__name__ == "BlockMask"

    generator = torch.Generator().manual_seed(0)
    # [B, H, T, D] views of [B, T, H, D], as the model's attention hands them over
    q = torch.randn(batch, width, heads, head_dim, generator=generator).transpose(1, 2)
    k, v = (
        torch.randn(batch, width, kv_heads, head_dim, generator=generator).transpose(1, 2) for _ in range(2)
    )
    scale = head_dim**-0.5
    with torch.no_grad():
        out, _ = flex_attention_forward(nn.Module().eval(), q, k, v, block_mask, scaling=scale)
    expected = per_document_attention(q, k, v, segments_of(positions), scale).transpose(1, 2)  # [B, T, H, D]
    # fp32 against float64: attention reaching one token of another segment differs by ~1e-1
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)


def _forward(model, loss_fn, batch: dict, packed: bool):
    inputs = {k: v for k, v in batch.items() if k not in ("targets", *PACKING_KEYS)}
    if packed:
        inputs.pop("attention_mask")  # packing: boundaries come from position_ids
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    return logits, loss_fn(logits, batch["targets"], unpack_index=batch.get("unpack_index"))


def test_tiny_qwen2_flex_equals_sdpa_and_unpacked_on_a_packed_batch(packed_qwen2, reference_flex):
    """A real Qwen2ForCausalLM built with flex_attention: on the packed micro-batch, the logits and
    NTILLoss's outputs equal sdpa's on the same rows and each sample's own unpacked forward."""
    _, processor, samples, packed, models = packed_qwen2
    loss_fn = NTILLoss(digit_token_ids_from_tokenizer(tokenizer_of(processor)), gumbel_noise_scale=0.0)

    logits_flex, out_flex = _forward(models["flex_attention"], loss_fn, packed, packed=True)
    logits_sdpa, out_sdpa = _forward(models["sdpa"], loss_fn, packed, packed=True)
    logits_alone, out_alone = _forward(models["sdpa"], loss_fn, Collator(processor)(samples), packed=False)
    assert {attn: m.config._attn_implementation for attn, m in models.items()} == {a: a for a in models}

    real = packed["attention_mask"].bool()
    torch.testing.assert_close(logits_flex[real], logits_sdpa[real], rtol=1e-5, atol=1e-5)
    flat = logits_flex.flatten(0, 1)
    for row, (sample, index) in enumerate(zip(samples, packed["unpack_index"], strict=True)):
        n = len(sample["input_ids"])
        torch.testing.assert_close(flat[index[:n]], logits_alone[row, :n], rtol=1e-5, atol=1e-5)
    assert out_alone.num_tokens > 0
    for field in ("loss", "ce_sum", "ntil", "emd", "rel", "mag", "num_tokens"):
        torch.testing.assert_close(getattr(out_flex, field), getattr(out_sdpa, field), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(getattr(out_flex, field), getattr(out_alone, field), rtol=1e-5, atol=1e-6)
