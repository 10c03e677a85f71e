"""Every shipped recipe (configs/train/*.yaml) and DeepSpeed JSON (configs/deepspeed/*.json) is valid.

A recipe passes when: the strict config loader accepts it; the DeepSpeed JSON it names exists, merges
with it (ds_config.merge_deepspeed_config) for the GPU count its header states, and the merged dict is
accepted by DeepSpeed's own config parser (which rejects misspelled keys); and its model section
(freeze flags, kind) applies to a tiny model of the same family, built offline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "configs" / "train").glob("*.yaml"))
DS_JSONS = sorted((REPO_ROOT / "configs" / "deepspeed").glob("*.json"))

# Which tiny offline family stands in for each recipe's model (launch/make_tiny_model.py kinds).
# A new recipe must be added here, so its freeze flags are checked against real parameter names.
TINY_STAND_IN = {
    "outputs/tiny-qwen2vl": "qwen2_vl",
    "outputs/tiny-qwen2": "qwen2",
    "Qwen/Qwen2-VL-2B-Instruct": "qwen2_vl",
    "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "llava-hf/llava-1.5-7b-hf": "llava",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
    "google/gemma-3-4b-it": "gemma3",
    "OpenGVLab/InternVL3-8B-hf": "internvl",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm",
    "meta-llama/Llama-3.2-11B-Vision-Instruct": "mllama",
    "zai-org/GLM-4.1V-9B-Thinking": "glm4v",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503": "mistral3",
    "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe",
    "Qwen/Qwen3.5-27B": "qwen3_5",
    "zai-org/GLM-4.5V": "glm4v_moe",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "llama4",
}

# Keys the recipe owns (ds_config.merge_deepspeed_config sets them); a JSON must not carry them.
RECIPE_OWNED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
}


def _gpus_in_header(recipe: Path) -> int:
    """World size a recipe is written for: "N process(es)" (CPU demo) or the first "N x ... GB" GPU line."""
    header = "".join(line for line in recipe.read_text().splitlines(keepends=True) if line.startswith("#"))
    if match := re.search(r"GPUs: (\d+) x \d+ GB", header):
        return int(match.group(1))
    if match := re.search(r"(\d+) process(?:es)?\b", header):
        return int(match.group(1))
    raise AssertionError(
        f"{recipe.name}: header must say what it runs on ('GPUs: N x M GB ...' or 'N processes')"
    )


def test_recipes_and_jsons_are_shipped():
    names = {p.name for p in RECIPES}
    assert "tiny_qwen2vl_clock.yaml" in names
    assert len(RECIPES) >= 6, names
    assert {p.name for p in DS_JSONS} >= {
        "zero3.json",
        "zero3_offload.json",
        "zero3_autotp.json",
        "zero2.json",
    }


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_merges_with_its_deepspeed_json(recipe: Path, monkeypatch):
    from deepspeed.runtime.config import DeepSpeedConfig

    from ntil_ds.config import LossConfig, load_config
    from ntil_ds.ds_config import load_deepspeed_json, merge_deepspeed_config, tensor_parallel_size

    monkeypatch.chdir(REPO_ROOT)  # recipes name repo-relative paths
    cfg = load_config(recipe)
    assert Path(cfg.deepspeed).is_file(), f"{recipe.name}: deepspeed={cfg.deepspeed} does not exist"
    assert cfg.model.name_or_path in TINY_STAND_IN, f"add {cfg.model.name_or_path} to TINY_STAND_IN"
    assert cfg.output_dir.startswith("outputs/"), cfg.output_dir

    ds_json = load_deepspeed_json(cfg.deepspeed)
    tp = tensor_parallel_size(ds_json)
    world = _gpus_in_header(recipe)
    assert world % tp == 0, f"{recipe.name}: {world} GPUs do not split into tensor-parallel groups of {tp}"
    merged = merge_deepspeed_config(cfg, ds_json, data_parallel_size=world // tp)
    assert merged["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch_size
    accumulation = merged["gradient_accumulation_steps"]
    assert accumulation * cfg.train.micro_batch_size * (world // tp) == cfg.train.global_batch_size
    assert merged["gradient_clipping"] == cfg.optim.grad_clip
    # DeepSpeed 0.19.8 counts tensor-parallel ranks in train_batch_size (its check uses the world size).
    assert merged["train_batch_size"] == cfg.train.global_batch_size * tp
    if cfg.model.dtype == "bfloat16":
        assert merged["bf16"]["enabled"] is True

    # DeepSpeed's own parser (pydantic, extra keys forbidden) on the merged dict. Without a process
    # group it counts 1 rank: give it that rank's view of the same batch.
    single_rank = merge_deepspeed_config(cfg, ds_json, data_parallel_size=1)
    single_rank["train_batch_size"] = cfg.train.global_batch_size
    parsed = DeepSpeedConfig(single_rank)
    assert parsed.zero_optimization_stage == ds_json["zero_optimization"]["stage"]

    # Every recipe here claims the paper's loss defaults in its header; hold it to that.
    if "paper's defaults" in recipe.read_text():
        assert cfg.loss == LossConfig(), f"{recipe.name}: loss section differs from the paper defaults"


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("tiny_models")
    kinds = sorted(set(TINY_STAND_IN.values()))
    return {kind: build_tiny_model_folder(kind, root / kind) for kind in kinds}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_model_section_applies_to_its_model_family(recipe: Path, tiny_folders, monkeypatch):
    """Freeze flags and model kind of the recipe, applied to a tiny model of the same class."""
    import dataclasses

    import torch

    from ntil_ds.config import load_config
    from ntil_ds.model import load_model, model_part

    monkeypatch.chdir(REPO_ROOT)
    cfg = load_config(recipe)
    kind = TINY_STAND_IN[cfg.model.name_or_path]
    model_cfg = dataclasses.replace(
        cfg.model,
        name_or_path=str(tiny_folders[kind]),
        init="random",
        dtype="float32",
        attn_implementation="sdpa",
        gradient_checkpointing=False,
        kernels="none",  # Liger patches a module-level rotary function process-wide (test_kernels.py)
    )
    torch.manual_seed(0)
    loaded = load_model(model_cfg)  # raises if a freeze flag matches no parameter
    # (Llama 4: its text model, the MLLM class refused in transformers 5.24; docs/models.md)
    expected_kind = "llm" if kind in ("qwen2", "llama4") else "mllm"
    assert loaded.kind == expected_kind, f"{recipe.name}: model.kind={cfg.model.kind} for a {kind} model"

    trainable = {model_part(n) for n, p in loaded.model.named_parameters() if p.requires_grad}
    frozen = {model_part(n) for n, p in loaded.model.named_parameters() if not p.requires_grad}
    assert trainable, f"{recipe.name}: nothing trains"
    if cfg.model.freeze_vision_tower:
        assert "vision_tower" in frozen and "vision_tower" not in trainable
    if expected_kind == "mllm" and not cfg.model.freeze_projector:
        assert "projector" in trainable


@pytest.mark.parametrize("path", DS_JSONS, ids=lambda p: p.stem)
def test_deepspeed_json_is_tuning_only_and_explicit(path: Path):
    """A DeepSpeed JSON holds ZeRO/offload/TP tuning only, with every size written out (no "auto")."""
    ds = json.loads(path.read_text())
    owned = RECIPE_OWNED_KEYS & set(ds)
    assert not owned, f"{path.name} sets {sorted(owned)}: those come from the recipe"
    assert '"auto"' not in path.read_text(), f'{path.name}: write explicit values, not "auto"'

    zero = ds["zero_optimization"]
    assert zero["stage"] in (2, 3)
    # NaN grad-norm reports with overlap_comm on ZeRO-3 (LLaMA-Factory, ms-swift issues)
    assert zero["overlap_comm"] is False
    assert isinstance(zero["reduce_bucket_size"], int) and zero["reduce_bucket_size"] > 0
    if zero["stage"] == 3:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            assert isinstance(zero[key], int) and zero[key] > 0, key
        # Export gathers 16-bit weights from the partitions; without this save writes empty weights.
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    else:
        assert isinstance(zero["allgather_bucket_size"], int) and zero["allgather_bucket_size"] > 0


def test_deepspeed_json_variants_do_what_their_name_says():
    def load(name: str) -> dict:
        return json.loads((REPO_ROOT / "configs" / "deepspeed" / name).read_text())

    assert load("zero2.json")["zero_optimization"]["stage"] == 2
    offload = load("zero3_offload.json")["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == "cpu"
    assert offload["offload_param"]["device"] == "cpu"
    assert load("zero3_autotp.json")["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": True}
    base = load("zero3.json")
    assert "tensor_parallel" not in base and "offload_param" not in base["zero_optimization"]
