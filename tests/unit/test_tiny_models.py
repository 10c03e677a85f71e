"""Tiny offline model folders: they load like Hub checkpoints, run forward+backward, and their tokenizers
spell numbers digit by digit. Qwen-VL logits with the processor's `mm_token_type_ids` equal a forward with
independently computed M-RoPE positions."""

import json
import shutil

import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    Qwen2_5_VLProcessor,
)

from ntil_ds.data.processor import load_processor, tokenizer_of
from ntil_ds.model import model_part
from ntil_ds.tiny import TINY_KINDS, build_tiny_model_folder

MLLM_KINDS = (
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "qwen3_vl",
    "gemma3",
    "internvl",
    "smolvlm",
    "qwen3_vl_moe",
    "qwen3_5",
    "mllama",
    "glm4v",
)
# LLaMA-3-style tokenizers: digits in groups of 1-3 from the left (mistral3: the regex trap, as loaded)
GROUPED_KINDS = ("mllama", "glm4v", "glm4v_moe", "mistral3", "llama", "llama4")

# Each family's vision tower and projector by parameter-name prefix (transformers 5.24's module names),
# written out here independently of ntil_ds.model.parts, which they check: (tower, projector prefixes).
VISION_PARTS = {
    "qwen2_vl": ("model.visual.", ("model.visual.merger.",)),
    "qwen2_5_vl": ("model.visual.", ("model.visual.merger.",)),
    "qwen3_vl": ("model.visual.", ("model.visual.merger.", "model.visual.deepstack_merger_list.")),
    "qwen3_vl_moe": ("model.visual.", ("model.visual.merger.", "model.visual.deepstack_merger_list.")),
    "qwen3_5": ("model.visual.", ("model.visual.merger.",)),
    "llava": ("model.vision_tower.", ("model.multi_modal_projector.",)),
    "gemma3": ("model.vision_tower.", ("model.multi_modal_projector.",)),
    "internvl": ("model.vision_tower.", ("model.multi_modal_projector.",)),
    "smolvlm": ("model.vision_model.", ("model.connector.",)),
    "mllama": ("model.vision_model.", ("model.multi_modal_projector.",)),
    "glm4v": ("model.visual.", ("model.visual.merger.",)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in TINY_KINDS}


def _image_conversation(answer: str = "10:42"):
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What time is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def _encode_image_sample(processor, size=(84, 56)):
    text = processor.apply_chat_template(_image_conversation(), tokenize=False)
    image = Image.new("RGB", size, (200, 30, 30))
    return processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)


def _build_model(folder, kind):
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    model_cls = AutoModelForCausalLM if kind == "qwen2" else AutoModelForImageTextToText
    return model_cls.from_config(config).eval()


@pytest.mark.parametrize("kind", MLLM_KINDS)
def test_mllm_folder_loads_and_trains(folders, kind):
    processor = load_processor(folders[kind])
    model = _build_model(folders[kind], kind)
    batch = _encode_image_sample(processor)
    tokenizer = tokenizer_of(processor)
    assert model.config.text_config.vocab_size == len(tokenizer)
    image_id = model.config.image_token_id
    # Gemma 3's text placeholder (<start_of_image>) differs from the token its features replace
    expanded_token = getattr(tokenizer, "image_token", None) or processor.image_token
    assert tokenizer.convert_ids_to_tokens(image_id) == expanded_token
    n_image_tokens = int((batch["input_ids"] == image_id).sum())
    assert n_image_tokens > 0

    tower, projector = VISION_PARTS[kind]
    names = [n for n, _ in model.named_parameters()]
    projector_names = {n for n in names if n.startswith(projector)}
    tower_names = {n for n in names if n.startswith(tower)} - projector_names
    assert tower_names and projector_names
    # the project's classifier (freezing, LoRA placement, QLoRA's 4-bit rule) agrees with the list
    assert {n for n in names if model_part(n) == "projector"} == projector_names
    assert {n for n in names if model_part(n) == "vision_tower"} == tower_names

    if kind == "mllama":  # its cross-attention gates start at 0 (tanh-gated): opened so the image shows
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                    param.fill_(0.5)
    out = model(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, len(tokenizer))
    out.logits.float().logsumexp(-1).mean().backward()
    # (CLIP's post_layernorm is unused by LLaVA and keeps no gradient, as in the full-size model.
    # transformers initialises Gemma 3's projector weight to zeros: at random init only the projector's
    # own gradient shows that the image reached the loss.)
    vision_grads = [
        p.grad
        for n, p in model.named_parameters()
        if n in tower_names | projector_names and p.grad is not None
    ]
    assert vision_grads and all(torch.isfinite(g).all() for g in vision_grads)
    assert any(g.abs().sum() > 0 for g in vision_grads)  # the image reached the loss


@pytest.mark.parametrize("layout", ["preprocessor_config", "model_type_only"])
def test_qwen_processor_class_found_as_in_hub_folders(folders, tmp_path, layout):
    # Older Hub Qwen-VL folders name the processor in preprocessor_config.json, or not at all.
    folder = tmp_path / layout
    shutil.copytree(folders["qwen2_5_vl"], folder)
    (folder / "processor_config.json").unlink()
    if layout == "preprocessor_config":
        config = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(
            json.dumps({**config, "processor_class": "Qwen2_5_VLProcessor"})
        )
    processor = load_processor(folder)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert "mm_token_type_ids" in _encode_image_sample(processor)


@pytest.mark.parametrize("kind", MLLM_KINDS)
def test_saved_processor_loads_back_the_same(folders, tmp_path, kind):
    # What the trainer's export does: processor.save_pretrained(export_dir), later load_processor(export_dir).
    processor = load_processor(folders[kind])
    processor.save_pretrained(tmp_path / "export")
    again = load_processor(tmp_path / "export")
    assert type(again).__name__ == type(processor).__name__
    assert json.loads((tmp_path / "export" / "processor_config.json").read_text())["processor_class"] in (
        "Qwen2VLProcessor",
        "Qwen2_5_VLProcessor",
        "LlavaProcessor",
        "Qwen3VLProcessor",
        "Gemma3Processor",
        "InternVLProcessor",
        "SmolVLMProcessor",
        "MllamaProcessor",
        "Glm4vProcessor",
    )
    if kind.startswith("qwen") or kind in (
        "internvl",
        "smolvlm",
        "glm4v",
    ):  # processors with a video slot (not built)
        assert (tmp_path / "export" / "video_preprocessor_config.json").is_file()
    first, second = _encode_image_sample(processor), _encode_image_sample(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_llava_and_text_folders_load_with_stock_auto_classes(folders):
    assert type(AutoProcessor.from_pretrained(folders["llava"])).__name__ == "LlavaProcessor"
    tokenizer = AutoTokenizer.from_pretrained(folders["qwen2"])
    model = _build_model(folders["qwen2"], "qwen2")
    messages = [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n42<|im_end|>\n")
    batch = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tokenizer_spells_digits_and_encodes_any_ascii(folders, kind):
    # (PixtralProcessor needs torchvision, which CPU torch lacks: mistral3's tokenizer is read alone, as
    # loaded: the trap; test_mistral3_tokenizer_is_fixed_to_single_digits checks the fix)
    folder = folders[kind]
    tokenizer = (
        AutoTokenizer.from_pretrained(folder) if kind == "mistral3" else tokenizer_of(load_processor(folder))
    )
    assert len(tokenizer) <= (2000 if kind in GROUPED_KINDS else 1000)  # + the 1,100 tokens "00".."999"
    ids = tokenizer("Year 2026: 12345.", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    numbers = ["202", "6", "123", "45"] if kind in GROUPED_KINDS else list("2026") + list("12345")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == numbers
    for digit in "0123456789":
        assert tokenizer.convert_ids_to_tokens(tokenizer(digit, add_special_tokens=False)["input_ids"]) == [
            digit
        ]
    printable = "".join(chr(c) for c in range(32, 127)) + "\nhello World"
    assert tokenizer.decode(tokenizer(printable, add_special_tokens=False)["input_ids"]) == printable
    config = AutoConfig.from_pretrained(folders[kind])
    text_config = config.get_text_config()
    for token_id in (text_config.eos_token_id, text_config.pad_token_id, text_config.bos_token_id):
        assert 0 <= token_id < len(tokenizer)
    assert text_config.eos_token_id == tokenizer.eos_token_id


def test_folder_is_deterministic(folders, tmp_path):
    again = build_tiny_model_folder("qwen2_vl", tmp_path / "again")
    for name in ("tokenizer.json", "config.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (folders["qwen2_vl"] / name).read_bytes(), name
    assert json.loads((again / "tiny_model.json").read_text()) == {"kind": "qwen2_vl"}


def test_unknown_kind_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind 'gpt5'.*qwen2_vl"):
        build_tiny_model_folder("gpt5", tmp_path)


def _reference_mrope_positions(input_ids, image_grid_thw, image_token_id, merge_size):
    """Qwen2-VL's 3D positions written from the paper's rule, independently of transformers: text tokens
    advance all three axes by one; an image's tokens take (t, row, col) offsets from the current start, and
    the text after it starts one past the largest position used."""
    positions, start, grids = [], 0, iter(image_grid_thw.tolist())
    ids = input_ids.tolist()
    i = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            positions.append((start, start, start))
            start += 1
            i += 1
            continue
        t, h, w = next(grids)
        h, w = h // merge_size, w // merge_size
        block = [
            (start + ti, start + hi, start + wi) for ti in range(t) for hi in range(h) for wi in range(w)
        ]
        positions.extend(block)
        start = max(max(p) for p in block) + 1
        i += len(block)
    return torch.tensor(positions).T.unsqueeze(1)  # (3, 1, T)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_qwen_mm_token_type_ids_give_mrope_positions(folders, kind):
    processor = load_processor(folders[kind])
    model = _build_model(folders[kind], kind)
    batch = _encode_image_sample(processor, size=(84, 56))  # 3x2 merged grid: rows and columns differ
    image_id = model.config.image_token_id
    assert torch.equal(batch["mm_token_type_ids"][0], (batch["input_ids"][0] == image_id).long())

    with torch.no_grad():
        logits = model(**batch).logits
        reference_positions = _reference_mrope_positions(
            batch["input_ids"][0],
            batch["image_grid_thw"],
            image_id,
            model.config.vision_config.spatial_merge_size,
        )
        without_types = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
        reference = model(**without_types, position_ids=reference_positions).logits
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)
        if kind == "qwen2_5_vl":  # silently falls back to 1D positions: the logits move
            assert (model(**without_types).logits - reference).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2"])
def test_small_size_widens_the_text_model(tmp_path, kind):
    """size="small" (launch/make_tiny_model.py --size small, compare.py --tiny-model qwen2:small)."""
    folder = build_tiny_model_folder(kind, tmp_path / kind, size="small")
    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    assert (text.hidden_size, text.intermediate_size, text.num_attention_heads) == (128, 256, 8)
    if kind == "qwen2_vl":
        assert (config.vision_config.depth, config.vision_config.embed_dim) == (2, 64)
        assert config.vision_config.hidden_size == 128  # the merger feeds the wider text model
    assert json.loads((folder / "tiny_model.json").read_text()) == {"kind": kind, "size": "small"}
    model = _build_model(folder, kind)
    ids = torch.randint(0, text.vocab_size, (1, 8))
    assert model(input_ids=ids).logits.shape == (1, 8, text.vocab_size)


def test_small_size_is_refused_for_other_kinds(tmp_path):
    with pytest.raises(ValueError, match="defined for qwen2_vl and qwen2 only, not 'llava'"):
        build_tiny_model_folder("llava", tmp_path / "llava", size="small")


def test_mllama_rows_read_their_own_images_by_cross_attention(folders, tmp_path):
    """Llama 3.2 Vision reads images per row: the collated batch of an image line and a text line equals
    the processor's own padded batch of the two (the text row's image slot zero-padded, its cross-attention
    mask 0), so the logits are equal; the image row's logits depend on its image; the <|image|> placeholder
    stays one token; a batch without images gets the blank image in row 0, unread (mask 0)."""
    from ntil_ds.data.collate import Collator
    from ntil_ds.data.dataset import ConversationDataset
    from tests.distributed.training_runs import write_mixed_arithmetic_data

    processor = load_processor(folders["mllama"])
    data = write_mixed_arithmetic_data(tmp_path, n=2, image_size=28)  # line 0 with an image, line 1 without
    dataset = ConversationDataset(data, processor, max_seq_len=128)
    collator = Collator(processor)
    batch = collator([dataset[0], dataset[1]])
    batch.pop("targets")
    image_id = processor.image_token_id
    assert (
        int((batch["input_ids"][0] == image_id).sum()) == 1 and not (batch["input_ids"][1] == image_id).any()
    )
    assert batch["pixel_values"].shape[:2] == (2, 1) and not batch["cross_attention_mask"][1].any()
    with Image.open(dataset.conversations[0].images[0]) as image:
        texts = [dataset._encoded[i].text for i in (0, 1)]
        reference = processor(
            text=texts,
            images=[[image.convert("RGB")], []],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
    model = _build_model(folders["mllama"], "mllama")
    with torch.no_grad():
        for name, param in model.named_parameters():  # (the gates start at 0: opened so images show)
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(0.5)
        logits = model(**batch).logits
        expected = model(**{k: v for k, v in reference.items() if isinstance(v, torch.Tensor)}).logits
        for row in (0, 1):
            n = int(batch["attention_mask"][row].sum())
            torch.testing.assert_close(logits[row, :n], expected[row, :n], rtol=0, atol=1e-5)
        other = dict(batch, pixel_values=torch.randn_like(batch["pixel_values"]))
        assert not torch.allclose(model(**other).logits[0], logits[0])
    text_only = collator([dataset[1], dataset[1]])
    assert text_only["pixel_values"].shape[:2] == (2, 1) and not text_only["cross_attention_mask"].any()
    assert text_only["aspect_ratio_mask"][0].all() and not text_only["aspect_ratio_mask"][1].any()


def test_mistral3_tokenizer_is_fixed_to_single_digits(folders, caplog):
    """The tiny Mistral Small 3.1 folder's tokenizer.json carries the LLaMA-3 regex, as the real one does:
    as loaded it groups digits and the probe says so, with the fix_mistral_regex note; the data pipeline's
    fix (load_processor applies it) makes it one digit per token, says so, and the fix survives saving."""
    from ntil_ds.data.processor import fix_mistral_regex
    from ntil_ds.loss.tokenizer import probe_number_tokenization

    folder = folders["mistral3"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with pytest.warns(UserWarning, match="fix_mistral_regex=True"):
        assert probe_number_tokenization(tokenizer).kind == "grouped"
    with caplog.at_level("WARNING"):
        assert fix_mistral_regex(tokenizer, folder)
    assert "loaded with fix_mistral_regex=True" in caplog.text
    found = probe_number_tokenization(tokenizer)
    assert (found.kind, found.note) == ("single", "")
    ids = tokenizer("Year 2026: 12345.", add_special_tokens=False)["input_ids"]
    assert [t for t in tokenizer.convert_ids_to_tokens(ids) if t.isdigit()] == list("2026") + list("12345")
    assert not fix_mistral_regex(tokenizer, folder)  # once is enough
    tokenizer.save_pretrained(saved := folder.parent / "mistral3_saved")
    again = AutoTokenizer.from_pretrained(saved)
    assert (
        again("2026", add_special_tokens=False)["input_ids"]
        == tokenizer("2026", add_special_tokens=False)["input_ids"]
    )
    for kind in ("mllama", "glm4v"):  # grouped tokenizers of families trained so: left as they are
        other = AutoTokenizer.from_pretrained(folders[kind])
        assert not fix_mistral_regex(other, folders[kind])
        assert probe_number_tokenization(other).kind == "grouped"


def test_mistral3_processor_loads_without_torchvision_with_the_pil_image_processor(folders):
    """transformers gives a torchvision placeholder for PixtralProcessor where torchvision is missing;
    load_processor builds the stock class with the folder's PixtralImageProcessorPil, and it expands an
    image into Pixtral's rows of [IMG] ended by [IMG_BREAK] / [IMG_END], one digit per token."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from transformers.utils import is_torchvision_available

    processor = load_processor(folders["mistral3"])
    assert type(processor).__module__ == "transformers.models.pixtral.processing_pixtral"
    assert type(processor).__name__ == "PixtralProcessor"
    assert isinstance(processor.image_processor, PixtralImageProcessorPil)
    batch = _encode_image_sample(processor, size=(56, 28))  # 28 px longest edge: 14 x 28 -> 1 x 2 tokens
    tokens = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    start = tokens.index("[IMG]")
    assert tokens[start : start + 3] == ["[IMG]", "[IMG]", "[IMG_END]"]
    assert tuple(batch["pixel_values"].shape[-2:]) == (14, 28) and batch["image_sizes"].tolist() == [[14, 28]]
    assert [t for t in tokens if t.isdigit()] == list("1042")
    if not is_torchvision_available():  # the stock AutoProcessor still refuses, naming torchvision
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(folders["mistral3"])
