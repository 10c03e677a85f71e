"""Model building without DeepSpeed: class choice, dtype, attention, checkpointing, freeze flags."""

import pytest
import torch

from ntil_ds.config import ConfigError, load_config
from ntil_ds.model import load_model, model_part, resolve_attn_implementation
from ntil_ds.tiny import build_tiny_model_folder


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        kind: build_tiny_model_folder(kind, root / kind)
        for kind in ("qwen2_vl", "llava", "qwen2", "qwen3_vl", "gemma3", "internvl", "smolvlm")
    }


def model_cfg(folder, *overrides):
    return load_config(
        None, [f"model.name_or_path={folder}", "model.init=random", "data.train_file=x", *overrides]
    ).model


def trainable_parts(model) -> dict[str, bool]:
    """part -> whether any of its parameters trains."""
    parts: dict[str, bool] = {}
    for name, param in model.named_parameters():
        part = model_part(name)
        parts[part] = parts.get(part, False) or param.requires_grad
    return parts


def test_mllm_and_llm_classes_dtype_and_attention(tiny_folders):
    vl = load_model(model_cfg(tiny_folders["qwen2_vl"], "model.dtype=bfloat16"))
    assert vl.kind == "mllm" and type(vl.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert {p.dtype for p in vl.model.parameters()} == {torch.bfloat16}
    assert vl.attn_implementation == "sdpa" == vl.model.config._attn_implementation
    llm = load_model(
        model_cfg(tiny_folders["qwen2"], "model.dtype=float32", "model.gradient_checkpointing=true")
    )
    assert llm.kind == "llm" and type(llm.model).__name__ == "Qwen2ForCausalLM"
    assert llm.model.is_activation_checkpointing and llm.model.config.use_cache is False


def test_random_weights_are_created_on_the_training_device(tiny_folders):
    """Not built on the CPU and moved (a 2B model's CPU init took tens of seconds per GPU job): created
    where they train. The meta device stands in for a GPU here: nothing on it can come from the CPU."""
    on_device = load_model(model_cfg(tiny_folders["qwen2_vl"]), device=torch.device("meta")).model
    assert {p.device.type for p in on_device.parameters()} == {"meta"}
    on_cpu = load_model(model_cfg(tiny_folders["qwen2_vl"]), device=torch.device("cpu")).model
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}


def test_attention_choice_without_flash_attn():
    assert resolve_attn_implementation("eager") == "eager"
    if not torch.cuda.is_available():
        assert resolve_attn_implementation("auto") == "sdpa"
        with pytest.raises(ConfigError, match="flash-attn"):
            resolve_attn_implementation("flash_attention_2")
    with pytest.raises(ConfigError, match="flex_attention needs a CUDA GPU"):
        resolve_attn_implementation("flex_attention", torch.device("cpu"))


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava", "qwen3_vl", "gemma3", "internvl", "smolvlm"])
def test_freeze_flags_address_the_same_parts_across_families(tiny_folders, kind):
    every = trainable_parts(load_model(model_cfg(tiny_folders[kind])).model)
    assert every == {"vision_tower": True, "projector": True, "language_model": True}
    vision = trainable_parts(
        load_model(model_cfg(tiny_folders[kind], "model.freeze_vision_tower=true")).model
    )
    assert vision == {"vision_tower": False, "projector": True, "language_model": True}
    both = load_model(
        model_cfg(tiny_folders[kind], "model.freeze_vision_tower=true", "model.freeze_projector=true")
    ).model
    assert trainable_parts(both) == {"vision_tower": False, "projector": False, "language_model": True}
    lm = load_model(model_cfg(tiny_folders[kind], "model.freeze_language_model=true")).model
    assert trainable_parts(lm) == {"vision_tower": True, "projector": True, "language_model": False}
    assert not lm.get_output_embeddings().weight.requires_grad  # the head belongs to the language model


def test_a_freeze_flag_that_matches_nothing_is_an_error(tiny_folders):
    with pytest.raises(
        ConfigError, match="freeze_vision_tower=true but Qwen2ForCausalLM has no vision tower"
    ):
        load_model(model_cfg(tiny_folders["qwen2"], "model.freeze_vision_tower=true"))


@pytest.mark.parametrize(
    ("kind", "recipe_kind", "checkpoint_type", "fix"),
    [
        ("qwen2_vl", "llm", "qwen2_vl", "set model.kind=mllm or model.kind=auto"),
        ("qwen2", "mllm", "qwen2", "set model.kind=llm or model.kind=auto"),
    ],
)
def test_a_kind_the_checkpoint_contradicts_is_a_config_error_before_any_weight_is_read(
    tiny_folders, kind, recipe_kind, checkpoint_type, fix
):
    """An `llm` recipe on a Qwen2-VL folder used to fail on every rank inside transformers
    ("Unrecognized configuration class ... AutoModelForCausalLM"). model.init=pretrained on a folder
    without weights: had loading gone as far as from_pretrained, that would be an OSError instead."""
    assert not list(tiny_folders[kind].glob("*.safetensors"))
    cfg = model_cfg(tiny_folders[kind], f"model.kind={recipe_kind}", "model.init=pretrained")
    with pytest.raises(ConfigError) as error:
        load_model(cfg)
    message = str(error.value)
    assert f"model.kind={recipe_kind} contradicts the checkpoint" in message
    assert f"model_type '{checkpoint_type}'" in message and fix in message


def test_a_kind_the_checkpoint_allows_either_way_is_kept(tiny_folders):
    """Gemma 3's config builds as a causal LM too (transformers maps it to the same class): model.kind=llm
    stays allowed there, as before."""
    llm = load_model(model_cfg(tiny_folders["gemma3"], "model.kind=llm"))
    assert llm.kind == "llm" and type(llm.model).__name__ == "Gemma3ForConditionalGeneration"
