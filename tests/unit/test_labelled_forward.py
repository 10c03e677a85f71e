"""loss.logits=labelled against loss.logits=all on every tiny model family: the same loss, its parts, and
the gradient of every parameter (the head's weight, tied or not, and everything below it), fp32 to 1e-5
of each tensor's scale; padded and packed batches; the head trained in full, frozen, or as the number
rows' delta; a family that softcaps its logits after the head (Gemma 3's causal LM)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from ntil_ds.data import Collator, ConversationDataset, load_processor, tokenizer_of
from ntil_ds.data.batch import MicroBatch
from ntil_ds.data.packing import PackedCollator
from ntil_ds.loss import NTILLoss, digit_token_ids_from_tokenizer, number_token_ids
from ntil_ds.model.head_rows import attach_number_rows
from ntil_ds.model.packing import rope_fn_for
from ntil_ds.objective import Objective
from ntil_ds.tiny import TINY_KINDS, build_tiny_model_folder
from tests.distributed.training_runs import write_mixed_arithmetic_data
from tests.unit.test_packing import _text_only_data

# The single-digit NTIL path: mistral3's PixtralProcessor needs torchvision (CPU torch has none) and the
# grouped-digit families (mllama, glm4v, glm4v_moe, llama, llama4) take GroupedNTILLoss, covered in test_loss_grouped.py
KINDS = tuple(
    k for k in TINY_KINDS if k not in ("mistral3", "mllama", "glm4v", "glm4v_moe", "llama", "llama4")
)

FIELDS = ("loss", "ce_sum", "ntil", "emd", "rel", "mag", "num_tokens", "loss_sum")


class ModelAsEngine:
    """What Objective uses of the training engine (``module`` and ``forward``), for a plain model in one
    process; the distributed tests run the same paths through DeepSpeed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model

    def forward(self, **inputs):
        return self.module(**inputs)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("labelled")


def _setup(root, kind: str):
    folder = build_tiny_model_folder(kind, root / kind / "model")
    text_only = kind == "qwen2"
    data = (
        _text_only_data(root / kind / "data", 8)
        if text_only
        else write_mixed_arithmetic_data(root / kind / "data", n=8, image_size=56)
    )
    processor = load_processor(folder)
    dataset = ConversationDataset(data, processor, max_seq_len=256)
    config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForCausalLM if text_only else AutoModelForImageTextToText
    torch.manual_seed(0)
    model = auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return processor, dataset, model


def _loss_and_grads(model, loss_fn, micro_batch: MicroBatch, labelled: bool, seed: int = 5):
    model.zero_grad(set_to_none=True)
    objective = Objective(ModelAsEngine(model), loss_fn, None, torch.device("cpu"), torch.float32, labelled)
    out = objective.loss(micro_batch, torch.Generator().manual_seed(seed))
    out.loss_sum.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, loss_fn, micro_batch: MicroBatch) -> None:
    want, want_grads = _loss_and_grads(model, loss_fn, micro_batch, labelled=False)
    got, got_grads = _loss_and_grads(model, loss_fn, micro_batch, labelled=True)
    assert want.num_tokens > 0 and want.rel > 0  # the sequence-level terms (and their noise) are live
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-7, msg=name)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, grad in want_grads.items():
        error = (got_grads[name] - grad).abs().max()
        assert error <= 1e-5 * grad.abs().max() + 1e-9, f"{name}: max |diff| {error:.3g}"


def _loss_fn(processor, **options) -> NTILLoss:
    return NTILLoss(digit_token_ids_from_tokenizer(tokenizer_of(processor)), kernel="torch", **options)


def _batch(collate, dataset, ids) -> MicroBatch:
    return MicroBatch(list(ids), collate([dataset[i] for i in ids]))


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_padded(root, kind):
    processor, dataset, model = _setup(root, kind)
    micro_batch = _batch(Collator(processor, fake_image=True), dataset, range(4))
    assert micro_batch.num_targets < micro_batch.targets.numel() / 3  # mostly prompt, as in fine-tuning
    _assert_same(model, _loss_fn(processor), micro_batch)


def test_packed_rows(root):
    processor, dataset, model = _setup(root, "qwen2_vl")
    collate = PackedCollator(processor, fake_image=True, rope_fn=rope_fn_for(model), row_tokens=200)
    micro_batch = _batch(collate, dataset, range(6))
    assert micro_batch.packed and micro_batch.targets.shape[0] > 1
    _assert_same(model, _loss_fn(processor), micro_batch)


def test_heads_frozen_or_number_rows_delta(root):
    processor, dataset, model = _setup(root, "qwen2")
    micro_batch = _batch(Collator(processor, fake_image=True), dataset, range(4))
    model.lm_head.weight.requires_grad_(False)  # lora.head=frozen (tied: the embedding too)
    _assert_same(model, _loss_fn(processor), micro_batch)
    head = attach_number_rows(model, number_token_ids(tokenizer_of(processor), True, True))
    with torch.no_grad():
        head.delta.normal_(0, 0.5)  # a trained delta: its rows' logits differ from the frozen head's
    _assert_same(model, _loss_fn(processor), micro_batch)
    assert head.delta.grad is not None and head.delta.grad.abs().sum() > 0


def test_lora_adapters_with_peft_trained_copy_of_the_head(root):
    """lora.head=full: peft calls its trained copy of the head (modules_to_save); the labelled head must
    compute that copy, so the adapters and the copy get the whole-logits gradients."""
    from ntil_ds.config import LoraConfig, ModelConfig
    from ntil_ds.model.lora import apply_lora

    processor, dataset, model = _setup(root, "qwen2_vl")
    lora = LoraConfig(enabled=True, r=4, dropout=0.0, head="full")
    model = apply_lora(model, ModelConfig(freeze_vision_tower=True), lora)
    with torch.no_grad():  # adapters away from their zero start, so their gradients are not trivially equal
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    micro_batch = _batch(Collator(processor, fake_image=True), dataset, range(4))
    _assert_same(model, _loss_fn(processor), micro_batch)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("modules_to_save" in n for n in trained) and any("lora_A" in n for n in trained)


def test_signed_decimal_numbers_and_softcapped_logits(root):
    """Gemma 3's causal LM applies ``final_logit_softcapping`` after its head; the labelled head applies
    it itself (and the model's is off meanwhile). Signed mode reads the minus column and the row max."""
    processor, dataset, _ = _setup(root, "gemma3")
    text_config = AutoConfig.from_pretrained(root / "gemma3" / "model").text_config
    text_config.final_logit_softcapping = 3.0  # small: most logits are bent by the cap
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text_config, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = tokenizer_of(processor)
    minus, point = number_token_ids(tokenizer, True, True)[10:]
    loss_fn = _loss_fn(
        processor, signed_numbers=True, minus_sign_id=minus, decimal_numbers=True, decimal_point_id=point
    )
    text = [i for i in range(8) if "pixel_values" not in dataset[i]]
    micro_batch = _batch(Collator(processor, fake_image=False), dataset, text[:3])
    _assert_same(model, loss_fn, micro_batch)
    assert model.config.final_logit_softcapping == 3.0  # restored after the forward


def test_a_micro_batch_without_targets_still_gives_the_head_its_zero_gradient(root):
    """A rank whose micro-batch has no target must still produce every gradient (ZeRO reduces each
    parameter's on all ranks): zero loss, the same parameters with gradients as on whole logits, all 0."""
    processor, dataset, model = _setup(root, "qwen2")
    micro_batch = _batch(Collator(processor, fake_image=True), dataset, range(2)).without_targets()
    assert micro_batch.num_targets == 0
    want, want_grads = _loss_and_grads(model, _loss_fn(processor), micro_batch, labelled=False)
    got, got_grads = _loss_and_grads(model, _loss_fn(processor), micro_batch, labelled=True)
    assert got.loss.item() == want.loss.item() == 0.0
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    assert all(torch.count_nonzero(grad) == 0 for grad in got_grads.values())
    assert "forward" not in vars(model.lm_head)  # the class's forward is back
