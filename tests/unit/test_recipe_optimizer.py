"""The GPU recipes' optimizer needs no JIT-compiled DeepSpeed op at start (issue 35 item 4, review F13).

`optim.name=adamw` makes DeepSpeed build FusedAdam (CPUAdam under optimizer offload) at
`deepspeed.initialize`: nvcc and ninja, minutes, and a failure on a runtime-only image. The GPU recipes use
`adamw_torch` with `fused: true`, which DeepSpeed 0.19.8 turns into torch.optim.AdamW(fused=True); the CPU
ones (tiny_*) keep adamw_torch's default. `adamw` elsewhere is refused before `deepspeed.initialize` when
the build's tools are missing (`optimizer_build_problem`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ntil_ds.config import ConfigError, load_config
from ntil_ds.ds_config import (
    jit_optimizer_op,
    load_deepspeed_json,
    merge_deepspeed_config,
    optimizer_build_problem,
)
from tests.conftest import REPO_ROOT

GPU_RECIPES = sorted(
    p for p in (REPO_ROOT / "configs" / "train").glob("*.yaml") if not p.name.startswith("tiny_")
)
NO_OPS_BUILT = {"fused_adam": False, "cpu_adam": False}


def merged_for(recipe: Path, *overrides: str) -> dict:
    cfg = load_config(recipe, list(overrides))
    return merge_deepspeed_config(cfg, load_deepspeed_json(cfg.deepspeed), data_parallel_size=1)


def deepspeeds_optimizer(merged: dict) -> torch.optim.Optimizer:
    """The optimizer deepspeed 0.19.8 builds from this config block: its own choice
    (`DeepSpeedEngine.get_optimizer_configuration`, whose torch_adam branch reads nothing of the engine),
    then the optimizer class built with the remaining params, as `_configure_basic_optimizer` does."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = dict(merged["optimizer"]["params"])
    optimizer_class, extra = DeepSpeedEngine.get_optimizer_configuration(None, params, True)
    return optimizer_class([torch.nn.Parameter(torch.zeros(3))], **params, **extra)


def test_there_are_gpu_recipes_and_one_offloads_the_optimizer(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert len(GPU_RECIPES) >= 10
    offloading = [
        p.name
        for p in GPU_RECIPES
        if jit_optimizer_op(merged_for(p, "optim.name=adamw", "optim.fused=false")) == "cpu_adam"
    ]
    assert offloading, "no GPU recipe offloads its optimizer: the CPUAdam case is untested"


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_builds_no_deepspeed_op(recipe: Path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # recipes name repo-relative paths
    merged = merged_for(recipe)
    assert jit_optimizer_op(merged) is None, merged["optimizer"]
    assert optimizer_build_problem(merged, NO_OPS_BUILT, lambda tool: None) is None
    optimizer = deepspeeds_optimizer(merged)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    # The same recipe on adamw would build an op: the check above can see one.
    assert jit_optimizer_op(merged_for(recipe, "optim.name=adamw", "optim.fused=false")) in (
        "fused_adam",
        "cpu_adam",
    )


def test_adamw_torch_without_fused_is_torchs_default_adamw(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    merged = merged_for(REPO_ROOT / "configs" / "train" / "tiny_qwen2vl_clock.yaml")
    assert "fused" not in merged["optimizer"]["params"]
    assert not deepspeeds_optimizer(merged).defaults["fused"]


def test_fused_is_only_for_adamw_torch(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(
        ConfigError, match="optim.fused=true is torch's fused AdamW, for optim.name=adamw_torch"
    ):
        load_config(GPU_RECIPES[0], ["optim.name=adamw"])


def test_the_build_check_names_the_missing_tools_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO_ROOT)
    merged = merged_for(GPU_RECIPES[0], "optim.name=adamw", "optim.fused=false")
    op = jit_optimizer_op(merged)
    nowhere = lambda tool: shutil.which(tool, path=str(tmp_path))  # noqa: E731 (an empty PATH)
    problem = optimizer_build_problem(merged, NO_OPS_BUILT, nowhere)
    assert problem and f"JIT-compile its {op} op" in problem and "missing here: ninja" in problem
    assert "optim.name=adamw_torch optim.fused=true" in problem
    assert optimizer_build_problem(merged, {**NO_OPS_BUILT, op: True}, nowhere) is None  # prebuilt
    assert optimizer_build_problem(merged, NO_OPS_BUILT, lambda tool: f"/usr/bin/{tool}") is None


def test_the_engine_refuses_an_unbuildable_op_on_an_accelerator_only(monkeypatch, tmp_path):
    """`check_optimizer_build` (called by the trainer before the model is built, and before
    `deepspeed.initialize`): on a GPU accelerator (a stand-in: this machine has none) with no build tools
    on PATH, adamw is refused and the GPU recipe's optimizer passes; on the CPU accelerator nothing is."""
    from types import SimpleNamespace

    from ntil_ds import engine

    monkeypatch.chdir(REPO_ROOT)
    adamw = merged_for(GPU_RECIPES[0], "optim.name=adamw", "optim.fused=false")
    engine.check_optimizer_build(adamw)  # DS_ACCELERATOR=cpu: the CPU runs' ops are prebuilt
    monkeypatch.setattr(engine, "get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    with pytest.raises(ConfigError, match=r"missing here: ninja, (nvcc|c\+\+)\. Use optim.name=adamw_torch"):
        engine.check_optimizer_build(adamw)
    engine.check_optimizer_build(merged_for(GPU_RECIPES[0]))
