"""Sequence packing is exact: a packed row gives every sample the logits, loss and gradients it gets alone.

For each model kind the project trains (tiny random Qwen2-VL, Qwen2.5-VL, LLaVA, Qwen2; real
transformers classes, sdpa attention, float32), the same samples go through the model twice: padded one
per row (`Collator`, the reference) and packed into one row (`PackedCollator`). Compared: each sample's
logits, NTILLoss's every output (with unpack_index), and every parameter's gradient. Mixed image/text
samples, and a text-only micro-batch (the fake image then sits in the packed row as its own segment).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from ntil_ds.data import Collator, ConversationDataset, load_processor, tokenizer_of
from ntil_ds.data.packing import PACKING_KEYS, PackedCollator, plan_micro_batches
from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer
from ntil_ds.model.packing import check_packing_supported, rope_fn_for
from ntil_ds.tiny import build_tiny_model_folder
from tests.distributed.training_runs import write_mixed_arithmetic_data

KINDS = ("qwen2_vl", "qwen2_5_vl", "llava", "qwen2")


def _text_only_data(out_dir: Path, n: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        a, b = 17 * i + 3, 29 * i + 11
        lines.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                   {"role": "assistant", "content": str(a + b)}]})  # fmt: skip
    path = out_dir / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=KINDS)
def setup(request, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kind = request.param
    root = tmp_path_factory.mktemp(f"packing_{kind}")
    folder = build_tiny_model_folder(kind, root / "model")
    data = (
        _text_only_data(root / "data", 12)
        if kind == "qwen2"
        else write_mixed_arithmetic_data(root / "data", n=12, image_size=56)
    )
    processor = load_processor(folder)
    dataset = ConversationDataset(data, processor, max_seq_len=256)
    config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    loss = NTILLoss(digit_token_ids_from_tokenizer(tokenizer_of(processor)), gumbel_noise_scale=0.0)
    return kind, processor, dataset, model, loss


def _run(model, loss_fn, batch: dict, packed: bool):
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k not in ("targets", *PACKING_KEYS)}
    if packed:
        inputs.pop("attention_mask")  # packing: boundaries come from position_ids
    logits = model(**inputs, use_cache=False).logits
    out = loss_fn(logits, batch["targets"], unpack_index=batch.get("unpack_index"))
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), out, grads


# index sets: mixed image/text; text only (fake image); one sample
GROUPS = ([0, 1, 2, 3, 8], [4, 5, 6, 7], [1])


@pytest.mark.parametrize("row_tokens", [None, 100], ids=("one_row", "rows_of_100"))
@pytest.mark.parametrize("ids", GROUPS, ids=("mixed", "text_only", "single"))
def test_packed_equals_unpacked(setup, ids, row_tokens):
    kind, processor, dataset, model, loss_fn = setup
    samples = [dataset[i] for i in ids]
    reference = Collator(processor, fake_image=True)(samples)
    packed = PackedCollator(processor, fake_image=True, rope_fn=rope_fn_for(model), row_tokens=row_tokens)(
        samples
    )
    rows = packed["input_ids"].shape[0]
    assert rows == 1 if row_tokens is None else rows > 1 or len(ids) == 1
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        assert packed["position_ids"].shape[:2] == (4, rows)  # text positions + 3-D M-RoPE ones

    logits_u, out_u, grads_u = _run(model, loss_fn, reference, packed=False)
    logits_p, out_p, grads_p = _run(model, loss_fn, packed, packed=True)

    flat = logits_p.flatten(0, 1)
    for row, (sample, index) in enumerate(zip(samples, packed["unpack_index"], strict=True)):
        n = len(sample["input_ids"])
        assert (index >= 0).sum() == n
        torch.testing.assert_close(flat[index[:n]], logits_u[row, :n], rtol=1e-5, atol=1e-5)
    for field in ("loss", "ce_sum", "ntil", "emd", "rel", "mag", "num_tokens", "loss_sum"):
        torch.testing.assert_close(getattr(out_p, field), getattr(out_u, field), rtol=1e-5, atol=1e-6)
    assert out_u.num_tokens > 0
    assert grads_u.keys() == grads_p.keys()
    for name, grad in grads_u.items():
        # float32 sums in another order: equal to ~1e-7 of the tensor's scale (wrong masks or positions
        # give differences of order 1)
        error = (grads_p[name] - grad).abs().max()
        assert error <= 1e-5 * grad.abs().max() + 1e-8, f"{name}: max |diff| {error:.3g}"


def test_without_unpack_index_numbers_of_adjacent_samples_would_mix(setup):
    """The per-sample number terms need unpack_index: without it a row of several answers is one
    sequence and NTIL's per-sequence means change (this is what the keyword is for)."""
    _, processor, dataset, model, loss_fn = setup
    samples = [dataset[i] for i in GROUPS[0]]
    packed = PackedCollator(processor, fake_image=True, rope_fn=rope_fn_for(model))(samples)
    _, out_p, _ = _run(model, loss_fn, packed, packed=True)
    no_index = {k: v for k, v in packed.items() if k != "unpack_index"}
    _, out_rows, _ = _run(model, loss_fn, no_index, packed=True)
    torch.testing.assert_close(out_rows.ce_sum, out_p.ce_sum)
    assert not torch.isclose(out_rows.ntil, out_p.ntil)


def test_packed_targets_end_every_sample_ignored(setup):
    """No position of a packed row is trained to predict the next sample's first token, and no digit run
    can reach into the next sample: every sample's last target is ignored, and packing moves targets
    as they are (the alignment is the dataset's, per sample)."""
    _, processor, dataset, model, _ = setup
    samples = [dataset[i] for i in GROUPS[1]]
    packed = PackedCollator(processor, fake_image=True, rope_fn=rope_fn_for(model))(samples)
    index = packed["unpack_index"]
    last = index.gather(1, (index >= 0).sum(1, keepdim=True) - 1).squeeze(1)
    assert (packed["targets"].flatten()[last] == -100).all()
    for sample, positions in zip(samples, index, strict=True):
        n = len(sample["input_ids"])
        assert torch.equal(packed["targets"].flatten()[positions[:n]], sample["targets"])


def test_aligned_targets_shift_per_sample_and_end_ignored():
    """A label on every token, the first and last included: position t targets token t+1 and the last
    position targets nothing (a roll or a pad on the wrong side would leak the next sample's token)."""
    import numpy as np

    from ntil_ds.data.encoding import aligned_targets

    assert aligned_targets(np.array([5, 6, 7, 8])).tolist() == [6, 7, 8, -100]
    assert aligned_targets(np.array([-100, 6, -100])).tolist() == [6, -100, -100]


def test_plan_micro_batches():
    assert plan_micro_batches([3, 3, 3, 3], max_tokens=6) == [[0, 1], [2, 3]]
    assert plan_micro_batches([5, 2, 4, 1], max_tokens=6) == [[0], [1, 2], [3]]
    # a rank with fewer groups than another splits its largest until the counts match
    assert plan_micro_batches([3, 3, 3, 3], max_tokens=100, min_count=3) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="exceeds data.max_tokens_per_micro_batch"):
        plan_micro_batches([3, 9], max_tokens=6)


def test_unverified_model_type_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from ntil_ds.config import ConfigError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=0"):
        check_packing_supported(model)


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    folder = build_tiny_model_folder("qwen2", root / "model")
    processor = load_processor(folder)
    return processor, ConversationDataset(_text_only_data(root / "data", 24), processor, max_seq_len=64)


def test_step_batches_agree_across_ranks_and_resume_exactly(text_dataset):
    """Every rank plans the same number of packed micro-batches per step from the same stream; a loader
    started from a resumed sampler yields exactly the steps the first one yields there; workers keep
    the order."""
    from ntil_ds.data import ResumableDistributedSampler
    from ntil_ds.data.steps import StepBatches, step_loader

    processor, dataset = text_dataset
    collate = PackedCollator(processor)
    lengths = [dataset.num_tokens(i) for i in range(len(dataset))]
    # (lengths 42-47) a pair fits only when one is below the median: ranks need different row counts
    budget = 2 * sorted(lengths)[len(lengths) // 2] - 1

    def steps_of(rank: int, consumed: int = 0) -> StepBatches:
        sampler = ResumableDistributedSampler(len(dataset), dp_rank=rank, dp_size=2, seed=3)
        sampler.skip(consumed // 2)
        return StepBatches(
            dataset, sampler, collate, samples_per_rank=5, micro_batch_size=1, max_tokens=budget
        )

    ranks = [steps_of(0), steps_of(1)]
    uneven = 0
    for k in range(6):  # 6 steps x 10 samples: crosses an epoch boundary (24 samples)
        groups = [r.step_groups(k) for r in ranks]
        assert len(groups[0]) == len(groups[1])
        # what each rank would need alone (its groups flattened are its samples in stream order)
        flat = [list(itertools.chain.from_iterable(gs)) for gs in groups]
        alone = [len(plan_micro_batches([lengths[i] for i in ids], budget)) for ids in flat]
        uneven += alone[0] != alone[1]
        stream = ResumableDistributedSampler(len(dataset), 0, 1, seed=3).indices_at(10 * k, 10)
        assert sorted(flat[0] + flat[1]) == sorted(stream)
        for g in groups[0]:
            assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    assert uneven  # the equalizing split was exercised

    resumed = steps_of(0, consumed=3 * 10)  # after 3 steps of 10 samples (both ranks)
    for k in range(3):
        assert resumed.step_groups(k) == ranks[0].step_groups(3 + k)
    direct = [ranks[0][k] for k in range(3)]
    with_worker = step_loader(ranks[0], num_workers=1, pin_memory=False)
    for expected in direct:
        got = next(with_worker)
        assert [mb.sample_ids for mb in got] == [mb.sample_ids for mb in expected]
        for a, b in zip(got, expected, strict=True):
            assert a.tensors.keys() == b.tensors.keys()
            assert all(torch.equal(a.tensors[key], b.tensors[key]) for key in a.tensors)


def test_hybrid_linear_attention_packing_leaks_on_the_torch_path_and_is_refused():
    """Qwen3.5's Gated DeltaNet layers on transformers 5.24's torch path: a sample packed behind another
    the way this project packs (positions restarting, no attention mask) does not compute what it
    computes alone: the convolution and the delta rule run across the whole row. Given the boundaries
    (cu_seq_lens), transformers refuses without flash-linear-attention (a CUDA Triton package). So
    packing is refused for the family at start, with the reason."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from ntil_ds.config import ConfigError

    config = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    first, second = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 5))
    row = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    bounds = torch.tensor([0, 7, 12], dtype=torch.int32)
    with torch.no_grad():
        alone = model(input_ids=second).logits
        packed = model(input_ids=row, position_ids=positions).logits[:, 7:]
        assert not torch.allclose(packed, alone, atol=1e-4)  # the first sample leaked into the second
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            model(input_ids=row, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    with pytest.raises(ConfigError, match="linear-attention layers .*max_tokens_per_micro_batch=0"):
        check_packing_supported(model)


def test_tiny_qwen3_5_folder_is_refused_packing_with_the_reason(tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ntil_ds.config import ConfigError

    config = AutoConfig.from_pretrained(build_tiny_model_folder("qwen3_5", tmp_path / "qwen3_5"))
    model = AutoModelForImageTextToText.from_config(config)
    with pytest.raises(ConfigError, match="'qwen3_5'.*linear-attention layers"):
        rope_fn_for(model)  # what the trainer asks before it builds the packing collator
