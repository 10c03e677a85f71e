"""lora.head=number_rows: the output head frozen, a trained delta on the rows of the tokens NTIL reads.

Against independent references: the delta's gradient is that of a trainable copy of the whole head,
restricted to the rows; the logits of other rows do not move; the merged export's head is the base
head with the delta added to the rows, exactly, and computes what the training model computes; the
adapter folder loads back with peft alone. An untied (Qwen2) and a tied-embedding family (Gemma 3), and
QLoRA's 4-bit base.
"""

import json

import pytest
import torch
from torch import nn

from ntil_ds.config import ConfigError, load_config
from ntil_ds.data import load_processor, tokenizer_of
from ntil_ds.export import save_lora_export
from ntil_ds.loss import number_token_ids
from ntil_ds.model import load_model
from ntil_ds.model.head_rows import NumberRowsHead
from ntil_ds.tiny import build_tiny_model_folder

KINDS = ("qwen2", "gemma3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny folders with saved random weights: a "pretrained" base that peft can load back onto."""
    root = tmp_path_factory.mktemp("head_rows")
    folders = {}
    for kind in KINDS:
        folder = build_tiny_model_folder(kind, root / kind)
        torch.manual_seed(0)
        _auto(kind).from_config(_config(folder), dtype=torch.float32).save_pretrained(folder)
        folders[kind] = folder
    return folders


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def _auto(kind):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText


def _base(kind, folder):
    return _auto(kind).from_pretrained(folder, dtype=torch.float32).eval()


def _rows(folder):
    """The digits, '-' and '.': what NTIL reads with loss.signed_numbers and loss.decimal_numbers."""
    return number_token_ids(tokenizer_of(load_processor(folder)), signed=True, decimal=True)


def _cfg(folder, *overrides):
    return load_config(
        None,
        [
            f"model.name_or_path={folder}",
            "model.init=pretrained",
            "model.dtype=float32",
            "data.train_file=x",
            "lora.enabled=true",
            "lora.r=4",
            "lora.alpha=8",
            "lora.dropout=0.0",
            "lora.head=number_rows",
            "lora.merge_on_export=true",
            "model.freeze_vision_tower=true",
            "model.freeze_projector=true",
            *overrides,
        ],
    )


def _load(folder, *overrides):
    cfg = _cfg(folder, *overrides)
    return load_model(cfg.model, lora=cfg.lora, number_rows=_rows(folder)).model


def _head(model) -> NumberRowsHead:
    head = model.get_base_model().lm_head
    assert isinstance(head, NumberRowsHead)
    return head


def _ids(vocab):
    torch.manual_seed(1)
    return torch.randint(0, vocab, (2, 12)), torch.randint(0, vocab, (2, 12))


def _randomize(model):
    """What training leaves: B and the delta away from their zero start."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or name.endswith("lm_head.delta"):
                param.normal_(std=0.1)


def test_the_rows_are_the_tokens_ntil_reads(folders):
    tokenizer = tokenizer_of(load_processor(folders["qwen2"]))
    rows = _rows(folders["qwen2"])
    assert [tokenizer.decode([i]) for i in rows] == [*"0123456789", "-", "."]
    assert number_token_ids(tokenizer, signed=False, decimal=False) == rows[:10]


@pytest.mark.parametrize("kind", KINDS)
def test_only_adapters_and_the_delta_train_and_its_gradient_is_the_full_heads_on_the_rows(folders, kind):
    model = _load(folders[kind]).train()
    head = _head(model)
    rows = _rows(folders[kind])
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.lm_head.delta" in trained and head.delta.shape == (len(rows), head.in_features)
    assert all("lora_" in n for n in trained - {"base_model.model.lm_head.delta"}), sorted(trained)
    assert not any("modules_to_save" in n for n, _ in model.named_parameters())  # no copy of the head

    # The reference: the base model with a trainable copy of its whole head (for Gemma 3 an untied one:
    # the gradient of the head alone, not of the embedding it shares its matrix with).
    reference = _base(kind, folders[kind]).train()
    full_head = nn.Linear(head.in_features, head.out_features, bias=False)
    full_head.weight = nn.Parameter(reference.lm_head.weight.detach().clone())
    reference.lm_head = full_head
    ids, labels = _ids(head.out_features)

    def loss_of(m):
        logits = m(input_ids=ids).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    loss_of(model).backward()
    loss_of(reference).backward()
    torch.testing.assert_close(head.delta.grad, full_head.weight.grad[rows], rtol=1e-5, atol=1e-6)
    assert head.delta.grad.abs().max() > 0
    assert head.weight.grad is None and not head.weight.requires_grad  # the head itself stays frozen


@pytest.mark.parametrize("kind", KINDS)
def test_the_delta_moves_its_rows_only(folders, kind):
    model = _load(folders[kind]).eval()
    head = _head(model)
    rows = torch.tensor(_rows(folders[kind]))
    ids, _ = _ids(head.out_features)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        _randomize(model)
        for name, param in model.named_parameters():  # the adapters back to zero: the delta alone
            if "lora_B" in name:
                param.zero_()
        hidden = []
        handle = head.register_forward_hook(lambda m, args, out: hidden.append(args[0]))  # (None: no change)
        after = model(input_ids=ids).logits
        handle.remove()
    others = torch.ones(head.out_features, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(after[..., others], before[..., others])
    moved = before[..., rows] + hidden[0] @ head.delta.T
    torch.testing.assert_close(after[..., rows], moved, rtol=1e-6, atol=1e-6)
    assert (after[..., rows] - before[..., rows]).abs().max() > 1e-3


@pytest.mark.parametrize(("kind", "quantize"), [("qwen2", "none"), ("gemma3", "none"), ("qwen2", "nf4")])
def test_merged_export_is_the_base_head_plus_the_delta_and_the_adapter_loads_back(
    folders, tmp_path, kind, quantize
):
    from peft import PeftModel
    from safetensors.torch import load_file

    model = _load(folders[kind], f"lora.quantize={quantize}").eval()
    head = _head(model)
    rows = torch.tensor(_rows(folders[kind]))
    _randomize(model)
    ids, _ = _ids(head.out_features)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    save_lora_export(model, model.state_dict(), tmp_path / "export")
    assert "lm_head" not in model.peft_config["default"].target_modules  # the training model as it was

    # merged/: the base head (the folder's matrix) with the delta added to its rows, exactly
    base = _base(kind, folders[kind])
    want = base.lm_head.weight.detach().clone()
    want[rows] += head.delta.detach()
    merged = _auto(kind).from_pretrained(tmp_path / "export" / "merged", dtype=torch.float32).eval()
    assert torch.equal(merged.lm_head.weight, want)
    assert not any("delta" in name for name, _ in merged.named_parameters())
    if kind == "gemma3":  # the input embedding kept the shared matrix; the head is its own matrix now
        assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)
        assert merged.lm_head.weight is not merged.get_input_embeddings().weight
        config = json.loads((tmp_path / "export" / "merged" / "config.json").read_text())
        assert config["tie_word_embeddings"] is False
    if quantize == "none":  # (QLoRA: the 4-bit matmul rounds its inputs to bf16 on CPU)
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

        # The adapter folder: peft alone loads it back onto the untouched base (the delta as peft's own
        # rank-k LoRA on lm_head, scaling 1), and it computes what the training model computes.
        adapter_config = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
        k = len(rows)
        assert adapter_config["rank_pattern"] == {"lm_head": k} == adapter_config["alpha_pattern"]
        saved = load_file(tmp_path / "export" / "adapter_model.safetensors")
        assert adapter_config["r"] == 4 and "lm_head" in adapter_config["target_modules"]
        assert all("lora_" in key for key in saved), sorted(saved)
        assert saved["base_model.model.lm_head.lora_B.weight"].shape == (head.out_features, k)
        adapted = PeftModel.from_pretrained(_base(kind, folders[kind]), tmp_path / "export").eval()
        with torch.no_grad():
            torch.testing.assert_close(adapted(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.modules_to_save=lm_head"], "contradicts lora.head=number_rows; remove lm_head"),
        (["lora.enabled=false"], "lora.head=number_rows needs lora.enabled=true"),
    ],
)
def test_contradicting_recipes_are_clear_errors(folders, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(folders["qwen2"], *overrides)


def test_the_old_spelling_of_a_full_head_trains_the_same(folders):
    """lora.modules_to_save=lm_head (the recipes before lora.head) is lora.head=full."""

    def trained(*overrides):
        cfg = _cfg(folders["qwen2"], *overrides)
        return sorted(
            n for n, p in load_model(cfg.model, lora=cfg.lora).model.named_parameters() if p.requires_grad
        )

    full = trained("lora.head=full")
    assert full == trained("lora.head=full", "lora.modules_to_save=lm_head")
    assert any("lm_head.modules_to_save" in n for n in full)
    assert not any("lm_head" in n for n in trained("lora.head=frozen"))
