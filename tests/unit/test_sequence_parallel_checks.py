"""parallel.sequence_parallel_size: what is refused at start (and with what fix), the rank layout, and
how a micro-batch is sliced on the sequence dimension."""

from __future__ import annotations

import pytest
import torch

from ntil_ds.config import ConfigError, load_config
from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import DistInfo, SequenceSlice, check_sequence_layout
from ntil_ds.model.sequence_parallel import check_sequence_parallel_supported

RECIPE = "configs/train/tiny_qwen2vl_clock.yaml"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.sequence_parallel_size=0"], "must be >= 1"),
        (["parallel.sequence_parallel_size=2", "data.max_tokens_per_micro_batch=4096"], "max_tokens_per"),
        (["parallel.sequence_parallel_size=2", "loss.name=ntl"], "loss.name"),
        (["parallel.sequence_parallel_size=2", "model.attn_implementation=eager"], "attn_implementation"),
        (["parallel.sequence_parallel_sise=2"], "sequence_parallel_sise"),  # a typo is an unknown key
    ],
)
def test_the_recipe_refuses_what_sequence_parallelism_cannot_run(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(RECIPE, overrides)


def test_the_recipe_accepts_sequence_parallelism_with_the_labelled_head():
    cfg = load_config(RECIPE, ["parallel.sequence_parallel_size=2", "model.kind=llm"])
    assert cfg.parallel.sequence_parallel_size == 2 and cfg.loss.logits == "labelled"


def test_ranks_of_a_sequence_parallel_group_read_one_batch_and_zero_averages_over_all():
    info = DistInfo(rank=3, world_size=4, sp_size=2)
    assert (info.dp_size, info.dp_rank, info.sp_rank) == (2, 1, 1)
    assert DistInfo(rank=2, world_size=4, sp_size=2).dp_rank == 1
    check_sequence_layout(info, [2, 3])
    with pytest.raises(RuntimeError, match=r"consecutive ranks \[2, 3\]"):
        check_sequence_layout(info, [1, 3])
    with pytest.raises(ConfigError, match="not divisible by parallel.sequence_parallel_size=2"):
        DistInfo(world_size=3, sp_size=2)
    with pytest.raises(ConfigError, match="autotp_size"):
        DistInfo(world_size=4, tp_size=2, sp_size=2)


def _qwen2_config(**kwargs):
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def test_models_ulysses_can_wrap_pass_and_the_others_are_refused_with_the_fix(tmp_path):
    from transformers import AutoConfig, Qwen2MoeConfig

    from ntil_ds.tiny import build_tiny_model_folder

    check_sequence_parallel_supported(_qwen2_config(), 2)
    check_sequence_parallel_supported(_qwen2_config(), 4)  # 2 key/value heads replicated to 4 ranks
    with pytest.raises(ConfigError, match="4 attention heads and 2 key/value heads"):
        check_sequence_parallel_supported(_qwen2_config(), 3)
    eager = _qwen2_config()
    eager._attn_implementation = "eager"
    with pytest.raises(ConfigError, match="attn_implementation=auto or sdpa"):
        check_sequence_parallel_supported(eager, 2)
    moe = Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts=4)
    with pytest.raises(ConfigError, match="mixture of experts"):
        check_sequence_parallel_supported(moe, 2)
    hybrid = AutoConfig.from_pretrained(build_tiny_model_folder("qwen3_5", tmp_path / "hybrid"))
    with pytest.raises(ConfigError, match="linear-attention"):
        check_sequence_parallel_supported(hybrid, 2)
    gemma3 = AutoConfig.from_pretrained(build_tiny_model_folder("gemma3", tmp_path / "gemma3"))
    with pytest.raises(ConfigError, match="sliding-window"):  # a multimodal family refused for its reason
        check_sequence_parallel_supported(gemma3, 2)
    with pytest.raises(ConfigError, match="linear-attention"):
        check_sequence_parallel_supported(hybrid.text_config, 2)


def _micro_batch(lengths: list[int], length: int) -> MicroBatch:
    rows = len(lengths)
    input_ids = torch.arange(rows * length).reshape(rows, length) + 5
    mask = torch.stack([torch.arange(length) < n for n in lengths]).long()
    targets = torch.where(mask.bool(), input_ids + 100, IGNORE_INDEX)
    targets[:, :2] = IGNORE_INDEX  # a prompt
    return MicroBatch([0, 1][:rows], {"input_ids": input_ids, "attention_mask": mask, "targets": targets})


@pytest.mark.parametrize("size", [2, 3])
def test_a_micro_batch_slices_into_padded_parts_whose_counts_add_up(size):
    whole = _micro_batch([7, 5], 7)
    parts = [whole.slice_sequence(rank, size) for rank in range(size)]
    padded = -(-7 // size) * size
    assert [p.sequence for p in parts] == [SequenceSlice.of(7, r, size) for r in range(size)]
    for key in ("input_ids", "attention_mask", "targets"):
        joined = torch.cat([p.tensors[key] for p in parts], dim=1)
        assert joined.shape == (2, padded)
        assert torch.equal(joined[:, :7], whole.tensors[key]), key
    joined_targets = torch.cat([p.targets for p in parts], dim=1)
    assert (joined_targets[:, 7:] == IGNORE_INDEX).all()
    positions = torch.cat([p.tensors["position_ids"] for p in parts], dim=1)
    assert torch.equal(positions[:, :7], torch.arange(7).expand(2, 7))
    assert sum(p.num_targets for p in parts) == whole.num_targets
    assert sum(p.num_input_tokens for p in parts) == whole.num_input_tokens
    inputs = parts[0].model_inputs(torch.device("cpu"), torch.float32)
    assert "attention_mask" not in inputs and "position_ids" in inputs  # Ulysses masks by positions


def test_a_micro_batch_with_images_keeps_its_whole_rows_and_packed_rows_are_not_sliced():
    batch = _micro_batch([7, 7], 7)
    with_pixels = MicroBatch([0, 1], dict(batch.tensors, pixel_values=torch.zeros(40, 12)))
    with pytest.raises(ValueError, match="pixel_values"):
        with_pixels.slice_sequence(0, 2)
    # A multimodal model's micro-batch keeps its whole rows (pixels too) for the model to slice after merging.
    sliced = with_pixels.slice_sequence(1, 2, whole_rows=True)
    inputs = sliced.model_inputs(torch.device("cpu"), torch.float32)
    assert inputs.keys() == {"input_ids", "attention_mask", "pixel_values"}
    assert torch.equal(inputs["input_ids"], batch.tensors["input_ids"])
    assert sliced.targets.shape == (2, 4) and torch.equal(sliced.targets[:, :3], batch.targets[:, 4:])
    assert "pixel_values" not in sliced.tensors
    packed = MicroBatch([0], dict(batch.tensors, unpack_index=torch.zeros(2, 7, dtype=torch.long)))
    with pytest.raises(ValueError, match="packed"):
        packed.slice_sequence(0, 2)


def test_zero3_without_reduce_scatter_is_refused_before_deepspeed_registers_anything():
    from transformers import Qwen2ForCausalLM

    from ntil_ds.engine import register_sequence_parallel

    model = Qwen2ForCausalLM(_qwen2_config(vocab_size=64, num_hidden_layers=1, intermediate_size=32))
    model.config._attn_implementation = "sdpa"
    cfg = load_config(RECIPE, ["parallel.sequence_parallel_size=2", "model.kind=llm"])
    zero3 = {"zero_optimization": {"stage": 3, "reduce_scatter": False}}
    with pytest.raises(ConfigError, match="remove reduce_scatter from the JSON"):
        register_sequence_parallel(model, cfg, zero3)
    assert register_sequence_parallel(model, load_config(RECIPE), zero3) is None  # size 1: nothing to do


def test_sliding_windows_and_rows_past_the_position_window_are_refused_naming_the_fix():
    """Ulysses drops the attention mask, where sdpa keeps a sliding window: refused, not silently full
    attention. A row longer than max_position_embeddings needs rope scaling (YaRN), named with its factor."""
    sliding = _qwen2_config(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ConfigError, match=r"sliding-window attention layers \(window 16\)"):
        check_sequence_parallel_supported(sliding, 2)
    short = _qwen2_config(max_position_embeddings=64)
    check_sequence_parallel_supported(short, 2, max_seq_len=64)
    with pytest.raises(
        ConfigError, match=r'"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64'
    ):
        check_sequence_parallel_supported(short, 2, max_seq_len=130)
    yarn = _qwen2_config(
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 1e4,
        },
    )
    check_sequence_parallel_supported(yarn, 2, max_seq_len=256)


def test_the_trainer_refuses_at_start_from_the_config_alone(tmp_path):
    """check_sequence_parallel_at_start reads the model folder's config.json only: the tiny folders hold no
    weights at all, so a refusal (or a pass) here happened before any weight could load."""
    from ntil_ds.model.sequence_parallel import check_sequence_parallel_at_start
    from ntil_ds.tiny import build_tiny_model_folder

    llm = build_tiny_model_folder("qwen2", tmp_path / "llm")
    vl = build_tiny_model_folder("qwen2_vl", tmp_path / "vl")
    cross = build_tiny_model_folder("mllama", tmp_path / "cross")
    assert not [*llm.glob("*.safetensors"), *vl.glob("*.safetensors"), *cross.glob("*.safetensors")]
    on = ["parallel.sequence_parallel_size=2", "model.kind=llm", "model.init=random"]
    check_sequence_parallel_at_start(
        load_config(RECIPE, [*on, f"model.name_or_path={llm}"]), torch.device("cpu")
    )
    check_sequence_parallel_at_start(load_config(RECIPE, [*on[:1], f"model.name_or_path={vl}"]), None)
    with pytest.raises(
        ConfigError, match="multimodal model: its language model reads the images through cross"
    ):
        check_sequence_parallel_at_start(load_config(RECIPE, [*on[:1], f"model.name_or_path={cross}"]), None)
    with pytest.raises(ConfigError, match="data.max_seq_len=8192 .* position window is 4096"):
        check_sequence_parallel_at_start(
            load_config(RECIPE, [*on, f"model.name_or_path={llm}", "data.max_seq_len=8192"]), None
        )
    with pytest.raises(ConfigError, match="3 ranks"):
        check_sequence_parallel_at_start(
            load_config(
                RECIPE, ["parallel.sequence_parallel_size=3", "model.kind=llm", f"model.name_or_path={llm}"]
            ),
            None,
        )


def test_the_long_sequence_recipes_against_their_models_configs():
    """The 64k recipes' models, by the Hub config.json numbers: Qwen2.5-VL-7B (a 128,000-token window)
    passes at SP=4; Qwen2.5-7B (32,768 without rope scaling) is refused naming YaRN, as its recipe's
    header says (the command points model.name_or_path at a YaRN copy)."""
    from ntil_ds.memory_estimate import hf_config_for

    def check(recipe: str) -> None:
        cfg = load_config(f"configs/train/{recipe}")
        size, length = cfg.parallel.sequence_parallel_size, cfg.data.max_seq_len
        assert size == 4 and length == 65536
        config = hf_config_for(cfg.model.name_or_path)
        check_sequence_parallel_supported(config, size, max_seq_len=length, attention="sdpa")

    check("qwen25vl_7b_64k_sequence_parallel.yaml")
    with pytest.raises(ConfigError, match='"rope_type": "yarn", "factor": 2.0'):
        check("qwen25_7b_64k_sequence_parallel.yaml")
