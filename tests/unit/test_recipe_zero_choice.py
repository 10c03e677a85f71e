"""Each GPU recipe is sized for the GPUs its header names, and its ZeRO stage follows the estimator.

The convention, in every GPU recipe's header (configs/train/*.yaml):

    # GPUs: N x M GB ...                                  what it is for
    # launch/estimate.py --gpus N --gpu-memory-gb M: ...  the estimator's line for those GPUs
    # ZeRO-3 although ZeRO-2 fits: <reason>               only where it keeps ZeRO-3 by choice

The rule: ZeRO-2 (configs/deepspeed/zero2.json) wherever launch/estimate.py says the recipe fits on its
GPUs with it; ZeRO-3 (its per-module hooks, gathers and the F.linear wrapper) only where ZeRO-2 does not
fit, or with the reason line. Each DeepSpeed JSON says in its top-level ``_comment`` when it is the
choice (DeepSpeed ignores unknown top-level keys and rejects them inside ``zero_optimization``).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

RECIPES = sorted((REPO_ROOT / "configs" / "train").glob("*.yaml"))
GPU_RECIPES = [p for p in RECIPES if "# GPUs:" in p.read_text()]
DS_JSONS = sorted((REPO_ROOT / "configs" / "deepspeed").glob("*.json"))
ZERO2_JSON = REPO_ROOT / "configs" / "deepspeed" / "zero2.json"

GPUS_LINE = re.compile(r"^# GPUs: (\d+) x (\d+) GB", re.MULTILINE)
ESTIMATE_LINE = re.compile(r"^# launch/estimate\.py --gpus (\d+) --gpu-memory-gb (\d+):", re.MULTILINE)
ZERO3_REASON = re.compile(r"^# ZeRO-3 although ZeRO-2 fits: (\S.*)$", re.MULTILINE)


def _gpus(recipe: Path) -> tuple[int, int]:
    text = recipe.read_text()
    stated, estimated = GPUS_LINE.search(text), ESTIMATE_LINE.search(text)
    assert stated, f"{recipe.name}: no '# GPUs: N x M GB' line"
    assert estimated, f"{recipe.name}: no '# launch/estimate.py --gpus N --gpu-memory-gb M: ...' line"
    assert stated.groups() == estimated.groups(), (
        f"{recipe.name}: the header says 'GPUs: {stated[1]} x {stated[2]} GB' but its estimator line is for "
        f"--gpus {estimated[1]} --gpu-memory-gb {estimated[2]}; size the estimate for the GPUs it is for"
    )
    return int(stated[1]), int(stated[2])


@functools.cache
def _estimate(recipe: Path, ds_json: Path | None = None):
    """The estimator on the recipe's stated GPUs, with its own DeepSpeed JSON or ``ds_json``."""
    from ntil_ds.config import load_config
    from ntil_ds.ds_config import load_deepspeed_json
    from ntil_ds.memory_estimate import estimate

    cfg = load_config(recipe)
    gpus, memory_gb = _gpus(recipe)
    return estimate(cfg, load_deepspeed_json(ds_json or REPO_ROOT / cfg.deepspeed), gpus, memory_gb)


def test_gpu_recipes_for_80_and_141_gb_are_shipped():
    sizes = {_gpus(recipe)[1] for recipe in GPU_RECIPES}
    assert {80, 141} <= sizes, sizes


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_gpu_recipe_fits_the_gpus_its_header_names(recipe: Path):
    result = _estimate(recipe)
    gpus, memory_gb = _gpus(recipe)
    assert result.fits, (
        f"{recipe.name}: launch/estimate.py --gpus {gpus} --gpu-memory-gb {memory_gb} says it does NOT fit:\n"
        + result.report()
    )


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_zero_stage_is_the_one_the_estimate_calls_for(recipe: Path):
    own = _estimate(recipe)
    zero2 = own if own.stage == 2 else _estimate(recipe, ZERO2_JSON)
    reason = ZERO3_REASON.search(recipe.read_text())
    if own.stage == 2:
        # (test above: the total fits) the rule's premise, stated on its own: the model states fit whole
        assert own.model_states() <= own.usable and own.fits, recipe.name
        assert not reason, f"{recipe.name}: a 'ZeRO-3 although ZeRO-2 fits' line on a ZeRO-2 recipe"
    elif zero2.fits:
        assert reason, (
            f"{recipe.name} uses ZeRO-3 ({own.total / 2**30:.1f} GiB per GPU) although ZeRO-2 fits on its GPUs "
            f"({zero2.total / 2**30:.1f} of {zero2.usable / 2**30:.1f} GiB): use "
            "deepspeed: configs/deepspeed/zero2.json, or state why in a header line "
            "'# ZeRO-3 although ZeRO-2 fits: <reason>'"
        )
    else:
        assert not reason, f"{recipe.name}: says 'ZeRO-3 although ZeRO-2 fits', but ZeRO-2 does not fit"


@pytest.mark.parametrize("path", DS_JSONS, ids=lambda p: p.stem)
def test_deepspeed_json_states_when_to_use_it_and_deepspeed_parses_it(path: Path):
    """A ``_comment`` saying when this JSON is the choice; the project's merge with a recipe and
    DeepSpeed's own config class (pydantic, extra keys forbidden) accept the file as shipped."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ntil_ds.config import load_config
    from ntil_ds.ds_config import load_deepspeed_json, merge_deepspeed_config

    ds_json = load_deepspeed_json(path)
    comment = ds_json.get("_comment")
    assert isinstance(comment, str) and len(comment) > 80, f"{path.name}: say in _comment when to use it"
    assert "_comment" not in json.dumps(ds_json["zero_optimization"]), "DeepSpeed rejects it there"
    cfg = load_config(None, ["model.name_or_path=m", "data.train_file=x", "model.dtype=bfloat16", "train.global_batch_size=4",
                             "train.micro_batch_size=2", f"deepspeed={path}"])  # fmt: skip
    merged = merge_deepspeed_config(cfg, ds_json, data_parallel_size=1)
    # Without a process group DeepSpeed counts one rank (AutoTP's x autotp_size included): its view
    merged["train_batch_size"] = cfg.train.global_batch_size
    parsed = DeepSpeedConfig(merged)
    assert parsed.zero_optimization_stage == ds_json["zero_optimization"]["stage"]
    if path.name == "zero3_gpu.json":  # ZeRO-3 for GPUs: F.linear not wrapped (the profile's 451 ms/step)
        assert parsed.zero_config.memory_efficient_linear is False
