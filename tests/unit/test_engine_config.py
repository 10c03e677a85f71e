"""The recipe merged into the DeepSpeed JSON: what the recipe owns wins, contradictions are errors."""

import itertools
import json
import math
import os

import pytest

from ntil_ds.config import ConfigError, load_config
from ntil_ds.dist import COLLECTIVE_TIMEOUT_ENV, collective_timeout
from ntil_ds.ds_config import load_deepspeed_json, merge_deepspeed_config, tensor_parallel_size
from ntil_ds.engine import lr_ratio

ZERO3 = {"zero_optimization": {"stage": 3, "overlap_comm": False}, "steps_per_print": 1000}


def recipe(*overrides: str):
    base = [
        "model.name_or_path=m",
        "data.train_file=t.jsonl",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
    ]
    return load_config(None, [*base, *overrides])


def test_batch_sizes_clipping_and_optimizer_come_from_the_recipe():
    cfg = recipe("optim.name=adamw_torch", "optim.lr=2e-5", "optim.grad_clip=0.5", "model.dtype=bfloat16")
    merged = merge_deepspeed_config(cfg, ZERO3, data_parallel_size=4)
    assert merged["train_micro_batch_size_per_gpu"] == 2
    assert merged["gradient_accumulation_steps"] == 2  # 16 / (2 x 4)
    assert merged["train_batch_size"] == 16
    assert merged["gradient_clipping"] == 0.5
    assert merged["bf16"] == {"enabled": True}
    assert "fp16" not in merged
    assert merged["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
    }
    assert "scheduler" not in merged  # a client LambdaLR (lr_ratio) schedules
    assert merged["zero_optimization"] == ZERO3["zero_optimization"]  # tuning untouched
    assert ZERO3 == {"zero_optimization": {"stage": 3, "overlap_comm": False}, "steps_per_print": 1000}


def test_optimizer_choices():
    fused = merge_deepspeed_config(recipe("optim.name=adamw"), ZERO3, 1)
    assert "torch_adam" not in fused["optimizer"]["params"]
    eight_bit = merge_deepspeed_config(recipe("optim.name=adamw_8bit"), ZERO3, 1)
    assert "optimizer" not in eight_bit  # a bitsandbytes client optimizer
    assert eight_bit["zero_allow_untested_optimizer"] is True


def test_precision_follows_model_dtype():
    fp32 = merge_deepspeed_config(recipe("model.dtype=float32"), {**ZERO3, "bf16": {"enabled": False}}, 1)
    assert fp32["bf16"] == {"enabled": False} and "fp16" not in fp32
    fp16 = merge_deepspeed_config(
        recipe("model.dtype=float16"), {**ZERO3, "fp16": {"loss_scale_window": 500}}, 1
    )
    assert fp16["fp16"] == {"loss_scale_window": 500, "enabled": True}
    # "auto" and a repeat of the recipe's own value are accepted.
    same = merge_deepspeed_config(
        recipe(), {**ZERO3, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0}, 1
    )
    assert same["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"train_batch_size": 32}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps"),
        ({"gradient_clipping": 0.3}, "gradient_clipping"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, "'optimizer'"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler'"),
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ],
)
def test_a_json_that_contradicts_the_recipe_is_an_error_naming_the_key(extra, key):
    with pytest.raises(ConfigError, match=key) as error:
        merge_deepspeed_config(recipe("model.dtype=bfloat16"), {**ZERO3, **extra}, 1)
    assert "recipe" in str(error.value)


def test_bf16_json_with_a_float32_recipe_is_an_error():
    with pytest.raises(ConfigError, match=r"bf16.enabled=true .* model\.dtype='float32'"):
        merge_deepspeed_config(recipe("model.dtype=float32"), {**ZERO3, "bf16": {"enabled": True}}, 1)


def test_a_global_batch_that_does_not_divide_is_an_error():
    with pytest.raises(
        ConfigError, match=r"train.global_batch_size=16 is not divisible .*micro_batch_size=2 x 3"
    ):
        merge_deepspeed_config(recipe(), ZERO3, data_parallel_size=3)


def test_lora_with_autotp_is_an_error():
    autotp = {**ZERO3, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ConfigError, match="LoRA / QLoRA train under ZeRO-2 or ZeRO-3 without AutoTP"):
        merge_deepspeed_config(recipe("lora.enabled=true", "model.init=random"), autotp, data_parallel_size=1)
    assert merge_deepspeed_config(
        recipe("lora.enabled=true", "model.init=random"), ZERO3, data_parallel_size=1
    )


def test_tensor_parallel_size_and_json_loading(tmp_path):
    assert tensor_parallel_size(ZERO3) == 1
    assert tensor_parallel_size({"tensor_parallel": {"autotp_size": 2}}) == 2
    with pytest.raises(ConfigError, match="autotp_size"):
        tensor_parallel_size({"tensor_parallel": {"autotp_size": 0}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_deepspeed_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_deepspeed_json(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(ZERO3))
    assert load_deepspeed_json(good) == ZERO3


def test_shipped_zero3_json_merges_with_a_recipe():
    merged = merge_deepspeed_config(recipe(), load_deepspeed_json("configs/deepspeed/zero3.json"), 2)
    assert merged["zero_optimization"]["stage"] == 3
    assert merged["gradient_accumulation_steps"] == 4


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    kw = {"warmup_steps": 4, "max_steps": 14, "min_lr_ratio": 0.1}
    assert [lr_ratio(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_ratio(4, **kw) == 1.0  # cosine starts at the peak
    # Half-way through the decay: the midpoint between peak and floor.
    assert lr_ratio(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_ratio(14, **kw) == pytest.approx(0.1)
    assert lr_ratio(100, **kw) == pytest.approx(0.1)  # stays at the floor past the end
    decreasing = [lr_ratio(s, **kw) for s in range(4, 15)]
    assert all(a > b for a, b in itertools.pairwise(decreasing))
    no_warmup = {"warmup_steps": 0, "max_steps": 10, "min_lr_ratio": 0.0}
    assert lr_ratio(0, **no_warmup) == 1.0
    assert lr_ratio(5, **no_warmup) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_collective_timeout_is_deepspeeds_minutes_or_the_seconds_asked_for(monkeypatch):
    from datetime import timedelta

    from deepspeed.constants import default_pg_timeout

    from ntil_ds.ds_config import resolve_run

    # DeepSpeed's own reading of DEEPSPEED_TIMEOUT in this process (at its import), then other values
    assert collective_timeout(os.environ) == default_pg_timeout
    assert collective_timeout({}) == timedelta(minutes=10)
    assert collective_timeout({"DEEPSPEED_TIMEOUT": "7"}) == timedelta(minutes=7)
    assert collective_timeout({COLLECTIVE_TIMEOUT_ENV: " 45 ", "DEEPSPEED_TIMEOUT": "7"}) == timedelta(
        seconds=45
    )
    for bad in ("0", "-3", "1.5", "10m"):
        with pytest.raises(ConfigError, match=f"{COLLECTIVE_TIMEOUT_ENV}=.*whole number of seconds"):
            collective_timeout({COLLECTIVE_TIMEOUT_ENV: bad})
    # checked with the recipe, before any process group: train.py reports it as a config error
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=COLLECTIVE_TIMEOUT_ENV):
        resolve_run(None, ["model.name_or_path=m", "data.train_file=t.jsonl"])
