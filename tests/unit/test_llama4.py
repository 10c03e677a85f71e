"""Llama 4 (``llama4``), one process: the text-only processor without torchvision and the image sample it
refuses at start; the MLLM class refused (its forward fails in transformers 5.24) and the text model
built instead; its MoE parts found by name and by shape; no aux loss (the family defines none); LoRA on
attention and on the experts, ``lora.head=number_rows``, and the merged export reloading as a plain
model. The 2-rank ZeRO-3 training is tests/distributed/test_train_zero3.py's llama4 job."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.utils import is_torchvision_available

from ntil_ds.config import ConfigError, load_config
from ntil_ds.data import ConversationDataset, is_multimodal, load_processor, tokenizer_of
from ntil_ds.data.records import DataError
from ntil_ds.export import save_lora_export
from ntil_ds.loss import number_token_ids
from ntil_ds.model import load_model
from ntil_ds.model.experts import experts_kwargs
from ntil_ds.model.parts import auto_model_class, expert_modules, moe_part
from ntil_ds.moe import router_terms_for
from ntil_ds.tiny import build_tiny_model_folder

WITHOUT_TORCHVISION = pytest.mark.skipif(
    is_torchvision_available(), reason="checks the loading without torchvision"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny folder with saved random weights of the whole checkpoint (vision tower included), as on
    the Hub: the text model loads from it."""
    folder = build_tiny_model_folder("llama4", tmp_path_factory.mktemp("llama4") / "model")
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def _lines(tmp_path, with_image: bool):
    from PIL import Image

    Image.new("RGB", (28, 28), (255, 255, 255)).save(tmp_path / "a.png")
    image = [{"type": "image", "image": "a.png"}] if with_image else []
    lines = [
        {
            "messages": [
                {"role": "user", "content": "What is 123 + 456?"},
                {"role": "assistant", "content": "579"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [*image, {"type": "text", "text": "What is 2 + 2?"}]},
                {"role": "assistant", "content": "4"},
            ]
        },
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@WITHOUT_TORCHVISION
@pytest.mark.parametrize("on_bad_sample", ["error", "skip"])
def test_without_torchvision_text_trains_and_an_image_is_refused_at_start(folder, tmp_path, on_bad_sample):
    processor = load_processor(folder)
    assert not is_multimodal(processor)  # the tokenizer alone, grouping digits as Llama 4's
    assert processor.tokenize("2024") == ["202", "4"]
    text = ConversationDataset(_lines(tmp_path, with_image=False), processor, 128, on_bad_sample)
    assert len(text) == 2
    # never skipped: every image sample would be
    with pytest.raises(
        DataError, match=r"train.jsonl:2: has an image, but .*Llama4ImageProcessor.*torchvision"
    ):
        ConversationDataset(_lines(tmp_path, with_image=True), processor, 128, on_bad_sample)


def test_the_mllm_class_is_refused_and_the_text_model_loads_the_checkpoint(folder):
    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(ConfigError, match="no attribute 'image_outputs'.*set model.kind=llm"):
        auto_model_class("auto", config)
    assert auto_model_class("llm", config) is AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    full = AutoModelForImageTextToText.from_config(config)  # (random; only its names)
    saved = {
        k.removeprefix("language_model."): k for k in full.state_dict() if k.startswith("language_model.")
    }
    assert set(model.state_dict()) == set(saved)


def test_moe_parts_no_aux_loss_and_the_familys_own_experts(folder):
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config)
    names = dict(model.named_parameters())
    routers = {n for n in names if moe_part(n) == "router"}
    experts = {n for n in names if moe_part(n) == "experts"}
    assert routers == {f"model.layers.{i}.feed_forward.router.weight" for i in range(2)}
    assert experts == {
        f"model.layers.{i}.feed_forward.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")
    }
    assert not any(moe_part(n) for n in names if ".shared_expert." in n)  # the shared expert is a dense MLP
    assert {type(m).__name__ for m in expert_modules(model)} == {"Llama4TextExperts"}
    terms = router_terms_for(model, None)
    assert (terms.has_aux, terms.coef, terms.num_experts, terms.top_k) == (False, 0.0, 4, 1)
    with pytest.raises(ValueError, match="computes no router load-balancing loss"):
        router_terms_for(model, 0.001)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), output_router_logits=True)
    assert out.aux_loss is None and len(out.router_logits) == 2
    terms.record(out, None)
    sums: dict = {}
    terms.add_sums(sums, 3)
    assert set(sums) == {"expert_counts"} and sums["expert_counts"].sum() == 2 * 3  # top-1, 2 layers
    assert experts_kwargs(config, "auto", None, AutoModelForCausalLM) == {}
    with pytest.raises(ConfigError, match="set model.experts_implementation=auto"):
        experts_kwargs(config, "grouped_mm", None, AutoModelForCausalLM)


def _cfg(folder, *overrides):
    return load_config(
        None,
        [
            f"model.name_or_path={folder}",
            "model.kind=llm",
            "model.init=pretrained",
            "model.dtype=float32",
            "data.train_file=x",
            "lora.enabled=true",
            "lora.dropout=0.0",
            "lora.r=2",
            "lora.alpha=6",
            *overrides,
        ],
    )


@pytest.mark.parametrize("experts", [False, True])
def test_lora_what_trains_and_the_merged_export_reloads(folder, tmp_path, experts):
    cfg = _cfg(
        folder, f"lora.experts={str(experts).lower()}", "lora.merge_on_export=true", "lora.head=number_rows"
    )
    rows = number_token_ids(tokenizer_of(load_processor(folder)), signed=True, decimal=True)
    assert len(rows) == 1112  # 0..9, 00..99, 000..999, '-', '.': every number token grouped NTIL reads
    torch.manual_seed(0)
    model = load_model(cfg.model, lora=cfg.lora, number_rows=rows).model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    attention = {
        n for n in trainable if "lora_" in n and n.split(".")[-4] in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    expert_adapters = {
        n for n in trainable if "lora_" in n and moe_part(n.replace(".base_layer", "")) == "experts"
    }
    shared = {n for n in trainable if "lora_" in n and ".shared_expert." in n}
    assert len(attention) == 2 * 4 * 2
    assert len(expert_adapters) == (2 * 2 * 2 if experts else 0), sorted(trainable)
    assert trainable == attention | expert_adapters | shared | {"base_model.model.lm_head.delta"}, sorted(
        trainable
    )
    assert model.get_base_model().lm_head.delta.shape[0] == len(rows)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(model.get_parameter(n).grad is not None for n in trainable)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or name.endswith("lm_head.delta"):
                param.normal_(std=0.1)
        expected = model.eval()(input_ids=ids).logits
    save_lora_export(model, model.state_dict(), tmp_path / "export")
    merged, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "export" / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert (expected - base(input_ids=ids).logits).abs().max() > 0.01
